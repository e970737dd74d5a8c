"""The reports package: shared helpers, the import rule, and one tiny report end to end."""

import ast
import csv
import json
import os
import pathlib

import jax
import numpy as np
import pytest
from conftest import TINY

from jaxmech import results
from jaxmech.config import Config
from jaxmech.evaluate import METRICS
from jaxmech.reports import common

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


def test_mechanism_report_writes_what_it_prints(tiny_run):
    from jaxmech.reports.mechanism import analyse_run

    lines = []
    res = analyse_run(tiny_run, ("none", "ep", "ep+bp"), log=lines.append)
    out = os.path.join(tiny_run, "mechanism")
    rows = _read(os.path.join(out, "ablations.csv"))
    assert list(rows[0]) == ["model", "ablation", *METRICS]
    assert [(r["model"], r["ablation"]) for r in rows][:3] == [("0", "none"), ("0", "ep"), ("0", "ep+bp")]  # fmt: skip
    summary = json.load(open(os.path.join(out, "summary.json")))
    for a in ("none", "ep", "ep+bp"):
        for m in METRICS:
            vals = [float(r[m]) for r in rows if r["ablation"] == a]
            assert summary["ablations"][a][m]["mean"] == pytest.approx(np.mean(vals))
        printed = [ln for ln in lines if ln.split()[:1] == [a]]
        mean = summary["ablations"][a]["single_acc"]["mean"]
        assert printed and printed[0].split()[1] == f"{mean:.3f}"
    heads = _read(os.path.join(out, "heads.csv"))
    assert len(heads) == 2 * TINY["d_model"] // TINY["d_head"]
    assert len(_read(os.path.join(out, "shares.csv"))) == len(heads) * 9
    assert all(os.path.isfile(p) for p in lines[-1].split()[1:])  # the figures
    assert res["unseen"].tolist() == [0.5, 0.5]


def test_reports_refuse_runs_they_do_not_apply_to(tiny_run):
    from jaxmech.reports.relations import analyse_relations_run
    from jaxmech.reports.rope import analyse_rope_run

    with pytest.raises(ValueError, match="vision_pos = 'learned'.*needs vision_pos = 'rope'"):
        analyse_rope_run(tiny_run)
    with pytest.raises(ValueError, match="task_kind = '1d'.*'2d' and 'three'"):
        analyse_relations_run(tiny_run)
    with pytest.raises(ValueError, match="does not exist"):
        analyse_rope_run(tiny_run + "_missing")
