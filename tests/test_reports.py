"""The reports package: shared helpers, the import rule, and one tiny report end to end."""

import ast
import csv
import json
import os
import pathlib
import re
import warnings

import jax
import numpy as np
import pytest
from conftest import TINY, tiny_config

from jaxmech import results
from jaxmech.config import Config
from jaxmech.families.dual_encoder.evaluate import METRICS
from jaxmech.reports import common
from jaxmech.reports.subjects import TrainedSubject

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxmech"


def test_spread_ignores_non_finite_values_and_is_nan_when_none_are_left():
    assert common.spread([1.0, np.nan, 3.0, np.inf]) == (2.0, 1.0, 1.0, 3.0)
    assert all(np.isnan(common.spread([np.nan])))


def test_ablation_rows_are_model_major_with_labels_before_metrics():
    table = {"a_acc": np.asarray([[0.1, 0.2], [0.3, 0.4]]), "b_acc": np.ones((2, 2))}
    rows = common.ablation_rows(table, [{"ablation": "x", "heads": "all"}, {"ablation": "y", "heads": "0"}], ["b_acc", "a_acc"])  # fmt: skip
    assert [list(r) for r in rows] == [["model", "ablation", "heads", "b_acc", "a_acc"]] * 4
    assert [(r["model"], r["ablation"], r["a_acc"]) for r in rows] == [
        (0, "x", 0.1), (0, "y", 0.2), (1, "x", 0.3), (1, "y", 0.4)
    ]  # fmt: skip


def test_the_two_ablation_table_styles_print_as_before():
    table = {"single_acc": np.asarray([[0.5, 0.25], [1.0, 0.75]])}
    summary = common.ablation_summary(table, ["none", "ep"], ["single_acc"])
    assert summary["ep"]["single_acc"] == {"mean": 0.5, "std": 0.25, "min": 0.25, "max": 0.75}
    lines = []
    common.print_ablation_summary(summary, ["single_acc"], lines.append, "rotation off")
    assert lines == [
        "rotation off               single_acc",
        "        none  0.750 +-0.250 [0.50,1.00]",
        "          ep  0.500 +-0.250 [0.25,0.75]",
    ]
    lines = []
    common.print_ablation_summary(summary, ["single_acc"], lines.append, style=common.COMPACT)
    assert lines == ["  ablation          single", "      none   0.750 +-0.250"] + [
        "        ep   0.500 +-0.250"
    ]


def test_fmt_ci_is_mean_std_and_a_clipped_t_interval():
    assert common.fmt_ci([0.5, 0.5, 0.5]) == "+0.500 +-0.000 [+0.500,+0.500]"
    # n = 2: t = 12.706, sd 0.5 / sqrt 2: the interval is clipped to [0, 1]
    assert common.fmt_ci([0.0, 1.0], 0.0, 1.0) == "+0.500 +-0.500 [+0.000,+1.000]"
    # no finite value: said to be empty, without a numpy warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert common.fmt_ci([np.nan, np.nan]) == common.fmt_ci([]) == "empty (n = 0)"
    # one model: its value, said to have no interval (not "+-0.000 [+nan,+nan]")
    assert common.fmt_ci([np.nan, 0.25]) == "+0.250 (n = 1: no interval)"


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """jaxmech modules `module` (file `path`) imports, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("jaxmech")}


def _module_files() -> dict[str, pathlib.Path]:
    files = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = p
    return files


def test_nothing_outside_reports_imports_it_and_cli_loads_no_report():
    files = _module_files()
    graph = {m: {i for i in _imports(p, m) if i in files} for m, p in files.items()}
    for m, deps in graph.items():
        if not m.startswith("jaxmech.reports"):
            assert not [d for d in deps if d.startswith("jaxmech.reports")], m
    # everything `import jaxmech.cli` runs: the module, its packages and their imports
    seen, todo = set(), ["jaxmech.cli"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parents = [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
        todo += [d for d in graph.get(m, ()) | set(parents) if d in files]
    assert "jaxmech.presets" in seen and "jaxmech.sweep" in seen
    assert not [m for m in seen if m.startswith("jaxmech.reports")]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A results folder of two freshly initialised tiny models (reports need no training)."""
    from jaxmech.train import init_program, stack_settings

    config = Config().replace(**TINY)
    out = str(tmp_path_factory.mktemp("reports") / "run")
    settings = stack_settings([config.replace(seed=s).settings() for s in (0, 1)])
    params = jax.device_get(init_program(settings, config).params)
    curves = {"step": np.asarray([[0], [0]]), "loss": np.ones((2, 1))}
    curves.update({m: np.full((2, 1), 0.5) for m in METRICS})
    results.write_files(out, config, settings, params, curves, np.asarray([-1, -1]))
    return out


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# the protocol study's ablations: every mechanism report below shares one compiled table
ABLATIONS = ("none", "ep", "ep+bp", "ep+pp+bp")


def test_mechanism_report_writes_what_it_prints(tiny_run):
    from jaxmech.reports.mechanism import analyse_run

    lines = []
    res = analyse_run(tiny_run, ABLATIONS, log=lines.append)
    out = os.path.join(tiny_run, "mechanism")
    rows = _read(os.path.join(out, "ablations.csv"))
    assert list(rows[0]) == ["model", "ablation", *METRICS]
    assert [(r["model"], r["ablation"]) for r in rows][:3] == [("0", "none"), ("0", "ep"), ("0", "ep+bp")]  # fmt: skip
    summary = json.load(open(os.path.join(out, "summary.json")))
    for a in ABLATIONS:
        for m in METRICS:
            vals = [float(r[m]) for r in rows if r["ablation"] == a]
            assert summary["ablations"][a][m]["mean"] == pytest.approx(np.mean(vals))
        printed = [ln for ln in lines if ln.split()[:1] == [a]]
        mean = summary["ablations"][a]["single_acc"]["mean"]
        assert printed and printed[0].split()[1] == f"{mean:.3f}"
    heads = _read(os.path.join(out, "heads.csv"))
    assert len(heads) == 2 * TINY["d_model"] // TINY["d_head"]
    assert len(_read(os.path.join(out, "shares.csv"))) == len(heads) * 9
    assert all(os.path.isfile(p) for p in lines[-1].split() if "/" in p)  # CSV, figures
    assert res["unseen"].tolist() == [0.5, 0.5]


def test_reports_refuse_runs_they_do_not_apply_to(tiny_run):
    from jaxmech.reports.relations import analyse_relations_run
    from jaxmech.reports.rope import analyse_rope_run

    with pytest.raises(ValueError, match="vision_pos = 'learned'.*needs vision_pos = 'rope'"):
        analyse_rope_run(tiny_run)
    with pytest.raises(ValueError, match="task_kind = '1d' has no relations report"):
        analyse_relations_run(tiny_run)
    with pytest.raises(ValueError, match="does not exist"):
        analyse_rope_run(tiny_run + "_missing")


# ---------------------------------------------------------------------------
# diverged models: left out of every report and named; report entry points fail cleanly


@pytest.fixture(scope="module")
def diverged_run(tmp_path_factory):
    """A trained run of four tiny models: lr = 10 (models 0, 1) diverges, lr = 1e-3
    (models 2, 3) does not. Two finite models: the reports compile the same programs
    as for `tiny_run`."""
    from jaxmech.sweep import expand, run_grid

    grid = expand(tiny_config(weight_decay=100.0), {"lr": "10,1e-3"}, seeds=2)
    out = str(tmp_path_factory.mktemp("diverged") / "run")
    # chunks of 2: the streaming program of tests/test_sweep.py (compiled once a session)
    rows = run_grid(grid, out, chunk_size=2, log=lambda line: None)["rows"]
    assert [r["diverged_step"] >= 0 for r in rows] == [True, True, False, False]
    return out


def _finite_only(path: str, out: str) -> str:
    """The same folder with its finite models only (a run trained without the others)."""
    run = results.load_run(path)
    keep = [i for i, r in enumerate(run.results) if r["diverged_step"] < 0]
    take = lambda tree: jax.tree_util.tree_map(lambda x: np.asarray(x)[keep], tree)  # noqa: E731
    curves = {"step": np.zeros((len(keep), 1), int), "loss": np.ones((len(keep), 1))}
    curves.update({m: np.asarray([[run.results[i][m]] for i in keep]) for m in METRICS})
    results.write_files(out, run.config, take(run.settings), take(run.params), curves, np.full(len(keep), -1))  # fmt: skip
    return out


def test_mechanism_report_leaves_out_and_names_diverged_models(diverged_run, tmp_path):
    from jaxmech.reports.mechanism import analyse_run

    lines = []
    res = analyse_run(diverged_run, ABLATIONS, log=lines.append)
    named = [ln for ln in lines if ln.startswith("excluded:")]
    assert len(named) == 2 and lines[:2] == named
    assert re.fullmatch(r"excluded: model 0 \(.*lr=10\.0, weight_decay=100\.0, seed=0\): diverged at step \d+", named[0])  # fmt: skip
    assert named[1].startswith("excluded: model 1 (") and "seed=1)" in named[1]
    assert res["summary"]["models"] == 2 and res["summary"]["excluded"] == named
    # per-model rows and lines keep the run's model index
    out = os.path.join(diverged_run, "mechanism")
    for name in ("ablations.csv", "heads.csv", "shares.csv"):
        assert {r["model"] for r in _read(os.path.join(out, name))} == {"2", "3"}, name
    assert any(ln.lstrip().startswith("model   2 unseen") for ln in lines)
    # every number is the report of the finite models alone
    alone = analyse_run(_finite_only(diverged_run, str(tmp_path / "alone")), ABLATIONS, log=lambda line: None)  # fmt: skip
    assert res["summary"]["ablations"] == alone["summary"]["ablations"]
    assert res["summary"]["mean_shares"] == alone["summary"]["mean_shares"]
    np.testing.assert_array_equal(res["strong"]["ep_slope"], alone["strong"]["ep_slope"])
    heads = _read(os.path.join(out, "heads.csv"))
    heads_alone = _read(str(tmp_path / "alone" / "mechanism" / "heads.csv"))
    assert [{**r, "model": int(r["model"]) - 2} for r in heads] == [{**r, "model": int(r["model"])} for r in heads_alone]  # fmt: skip


def test_protocol_analysis_and_report_leave_out_and_name_diverged_models(diverged_run, tmp_path):
    from jaxmech.presets import Protocol
    from jaxmech.reports import protocol

    rows = results.load_run(diverged_run).results
    mech = protocol.protocol_mechanism(diverged_run, rows)
    assert sorted(mech) == [2, 3]  # the finite models, by their index in the run
    merged = protocol.merge_mechanism(rows, mech)
    assert all(np.isnan(merged[i]["unseen_ep"]) for i in (0, 1))
    assert merged[2]["unseen_ep"] == mech[2]["unseen_ep"]
    study = str(tmp_path)
    os.makedirs(os.path.join(study, "x"))
    prot = Protocol("x", "weight_decay", "weight decay 100", {})
    cells = ((5, 5),)
    path = protocol.write_report(study, [prot], {"x": merged}, cells, 2, None)
    text = open(path).read()
    assert "| x | 5 | 5 | 2 |" in text  # the cell counts its two finite models
    assert re.search(r"- x: excluded: model 0 \(.*seed=0\): diverged at step \d+", text)
    assert "- x: excluded: model 1 (" in text
    # a broken record of the study names its file
    with open(os.path.join(study, "x", "protocol_time.json"), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match=re.escape(os.path.join(study, "x", "protocol_time.json"))):  # fmt: skip
        protocol.write_report(study, [prot], {"x": merged}, cells, 2, None)


RESULTS_CSV = "model,seed,diverged_step\n0,0,-1\n"


def _fake_run(path, config=None, results_csv=RESULTS_CSV):
    """A folder with the files `results.load_config` checks for (no real params)."""
    os.makedirs(os.path.join(path, "params"))
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write((config or tiny_config()).to_json())
    open(os.path.join(path, "curves.csv"), "w").close()
    if results_csv is not None:
        with open(os.path.join(path, "results.csv"), "w") as f:
            f.write(results_csv)
    return str(path)


def _usage_error(entry, *argv) -> str:
    """The UsageError message of an entry point's main for these flags (in-process)."""
    from absl import app

    try:
        entry.FLAGS([entry.__file__, *argv])
        with pytest.raises(app.UsageError) as e:
            entry.main([])
    finally:
        entry.FLAGS.unparse_flags()
    return str(e.value)


def test_mechanism_entry_point_refuses_bad_runs_before_any_compute(tmp_path):
    from experiments import mechanism as entry
    from jaxmech.reports.relations import relations_refusal
    from jaxmech.reports.rope import rope_refusal
    from jaxmech.reports.text_align import text_refusal

    for text in ("", ",", " , ,"):
        assert "--run" in _usage_error(entry, f"--run={text}")
    for kind in ("2d", "three"):
        run = _fake_run(tmp_path / kind, Config().replace(task_kind=kind))
        msg = _usage_error(entry, f"--run={run}")
        assert f"task_kind = {kind!r}" in msg and f"experiments.relations --run={run}" in msg
    msg = rope_refusal(Config().replace(task_kind="2d", vision_pos="rope"), "r")
    assert "task_kind = '2d' has no rope report" in msg
    bad = {
        "broken": ("{", RESULTS_CSV, "has a broken config.json"),
        "missing": (None, None, "has no results.csv"),
        "header_only": (None, "model,seed,diverged_step\n", "holds no model rows"),
        "not_results": (None, "a,b\n1,2\n", "is not a results table"),
        "all_diverged": (None, "model,diverged_step\n0,3\n1,5\n", "every model of this run"),
    }
    for name, (config_text, results_csv, message) in bad.items():
        run = _fake_run(tmp_path / name, results_csv=results_csv)
        if config_text is not None:
            with open(os.path.join(run, "config.json"), "w") as f:
                f.write(config_text)
        msg = _usage_error(entry, f"--run={run}")
        assert run in msg and message in msg, (name, msg)
        # every report's entry point checks the same way (`common.check_runs`)
        for refusal in (relations_refusal, text_refusal):
            with pytest.raises(ValueError, match=re.escape(message)):
                common.check_runs(run, refusal)
    with pytest.raises(ValueError, match="--run"):
        common.check_runs(",", text_refusal)


def _hand_run(unseen_min, **settings):
    """A LoadedRun of len(unseen_min) hand-made models (no params worth running)."""
    from jaxmech.config import Settings

    k = len(unseen_min)
    flat = Config().replace(task_kind="scenes").flat()
    cols = {n: np.full(k, settings.get(n, flat[n])) for n in Settings._fields}
    rows = [{"model": 10 + i, "unseen_min_acc": u} for i, u in enumerate(unseen_min)]
    return common.LoadedRun("hand", Config().replace(task_kind="scenes"), {"w": np.arange(k)},
                            Settings(**cols), None, rows, tuple(10 + i for i in range(k)), (),
                            subject=TrainedSubject())  # fmt: skip


def test_report_parts_split_question_sets_and_model_groups():
    run = _hand_run([0.95, 0.5, 0.92, 0.89])
    seen = []

    def compute(r):
        return {"per": np.arange(r.k) + (100 if r.examples == "unseen" else 0), "other": "x"}

    def summarise(res, tables, r, log):
        seen.append((r.examples, r.models, res["per"].tolist(), [x["model"] for x in tables["t"]]))
        return {}

    report = common.Report("f", None, compute, lambda res, r: {"t": [{"model": m, "v": 1} for m in r.models]},
                           summarise, None, "x.png", examples=common.EXAMPLES, per_model=("per",))  # fmt: skip
    parts, tables, full = common.report_parts(report, run)
    assert [p.key for p in parts] == ["seen/generalising", "seen/others", "unseen/generalising", "unseen/others"]  # fmt: skip
    for p in parts:
        report.summarise(p.res, p.tables, p.run, None)
    assert seen == [("seen", (10, 12), [0, 2], [10, 12]), ("seen", (11, 13), [1, 3], [11, 13]),
                    ("unseen", (10, 12), [100, 102], [10, 12]), ("unseen", (11, 13), [101, 103], [11, 13])]  # fmt: skip
    assert parts[0].res["other"] == "x" and full["unseen"]["per"].tolist() == [100, 101, 102, 103]
    groups = [(r["examples"], r["model"], r["model_group"]) for r in tables["t"]]
    assert groups[:4] == [("seen", 10, "generalising"), ("seen", 11, "others"),
                          ("seen", 12, "generalising"), ("seen", 13, "others")]  # fmt: skip
    assert len(groups) == 8 and groups[4][0] == "unseen"
    # results without unseen_min_acc: one group of every model
    no_acc = run._replace(results=[{"model": m} for m in run.models])
    assert [(g, i.tolist()) for g, i in common.model_groups(no_acc)] == [("all", [0, 1, 2, 3])]


def test_seen_questions_belong_to_every_models_seen_set():
    from types import SimpleNamespace

    from jaxmech.data.tasks import get_task
    from jaxmech.data.tasks import scenes as sc

    run = _hand_run([0.5, 0.5])
    n_pair = np.asarray([15, 9])
    run = run._replace(settings=run.settings._replace(n_pair_labels=n_pair, layouts_per_pair=np.asarray([15, 20])))  # fmt: skip
    t = run.config.task
    evals = sc.build_eval_sets(t, sc.build_tables(t))
    run = run._replace(data=SimpleNamespace(evals=evals), task=get_task("scenes"), examples="seen")
    spec = common.question_specs(run)["examples"]
    s = evals.seen_pair
    keep = (np.asarray(s.pair_Nx2) <= 9).all(-1) & (np.asarray(s.rank_N) >= 20)
    assert 0 < keep.sum() < len(keep)
    np.testing.assert_array_equal(spec.cells_BxK, sc.eval_specs(t, s)["examples"].cells_BxK[keep])
    assert list(common.id_labels(run)) == list(range(1, 10))
    unseen = common.question_specs(run._replace(examples="unseen"))["examples"]
    assert len(unseen.relation_B) == len(s.rank_N)
