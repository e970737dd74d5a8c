"""Paper 003's attribute swapping (Fig. 4B, `mirror_attr_swapping/attribute_swapping.py`)
on toy VLMs or a checkpoint: the control of the mirror swap.

Each left / right question is run beside its recoloured twin (the same layout, the
same answer, other colours), and at every LM layer x token group the residual stream
of the question's run is replaced by the twin's (`analysis.patching.patch_table`, the
mirror-swap patching's machinery with one twin). Colour carries no side: a patch that
moves the spatial belief here says the mirror swap's shift (`reports.patching`) is not
all about position.

Twins and groups (`--protocol`):

  jaxmech   drawn: every object recoloured to another colour (`data.spec.recolour`);
            a photograph: the authors' rainbow recolour (`data.inputs.image_twins`); jaxmech's
            token groups (`analysis.patching.GROUPS`).
  authors   their rainbow recolour of every picture, drawn ones too (hue mixed at 0.75
            with a random rainbow gradient, seeded by the question seed), their prompt
            where the family has one (`questions.report_view`, as the patching report),
            their "text" group (`questions.authors_groups`). Their three draws per
            picture come from NumPy's unseeded global state, so only a run given them
            (`image_twins.recolour_twin(draws=)`) gives their numbers: equal per
            question on their LLaVA fixture (`tests/test_authors_attribute.py`). Their
            layer L is block L's output, this report's layer L + 1 (their last, 31 of
            LLaVA-1.5's 32, is the last block's output, refused here as by patching).

Read per question, layer and group, under either protocol (both come from one table):

  change    log p(answer) patched - unpatched (nats; 0: the patch leaves the belief)
  flipped   whether the patch changed the answer (the sign of log p(answer) - log
            p(other word)): a control should flip none
  authors   their Fig. 4B number: per read word (left, right) (unpatched - patched) /
            (unpatched - twin), NaN and inf read as 0 (`attribute_swapping.py`
            301-308; the twin's own gap is near 0, so the ratio is large and noisy)

with per-question 95% intervals for a checkpoint, over models for a results folder.

Writes into `RUN/attribute_swapping/` (OUT/attribute_swapping for a checkpoint):
  results.csv   model, layer, group, change (mean, interval, n), flipped (same), and
                the authors' shift of each read word with its interval
  summary.json  per layer and group: change, flipped and the authors' shift per read
                word with 95% intervals; the twin's own change (the recoloured
                picture unpatched)
  attribute_swapping.png  change and flipped against layer, a curve per group
  attribute_swapping_paper.png  Fig. 4B as the paper draws it: x layer, y belief shift,
                a curve per token group (their three under their protocol), a row per
                read word
"""

from __future__ import annotations

import numpy as np

from jaxmech.analysis.patching import (
    GROUPS,
    patch_table,
    table_call_for,
    table_compile_at,
    token_groups,
)
from jaxmech.data.inputs import image_twins, pictures
from jaxmech.families.vlm_view import Examples
from jaxmech.memory import remembered
from jaxmech.reports.common import (
    EXAMPLES,
    LoadedRun,
    Report,
    cell_interval,
    chunk_progress,
    declared,
    fmt_interval,
    joined,
    log_estimate,
    protocol_of,
    question_batches,
    rows_per_call,
    table_store,
)
from jaxmech.reports.questions import (
    GROUP_WORDS,
    PAPER_GROUPS,
    authors_groups,
    patched_relation,
    report_view,
)

TWIN = "recolour"


def rainbow_examples(view, ex: Examples, seed: int) -> tuple[Examples, object]:
    """(the drawn questions `ex` rendered from their pictures, the rainbow-recoloured
    pictures' inputs): both through `view.render_images` with the same questions, so
    their spans agree; the authors' wording (`pictures.AUTHORS_TEMPLATES`)."""
    rng = np.random.default_rng([seed, 4])
    drawn, questions, words = pictures.asked(view.grid, ex.spec, view.size,
                                             templates=pictures.AUTHORS_TEMPLATES)  # fmt: skip
    rainbow = [image_twins.recolour_twin(None, p, rng)[0] for p in drawn]
    inputs, spans = view.render_images(drawn, questions, words)
    twin, twin_spans = view.render_images(rainbow, questions, words)
    if not np.array_equal(np.asarray(spans.question_BxS), np.asarray(twin_spans.question_BxS)):
        raise ValueError(f"{view.name}: the recoloured pictures' tokens differ from the "
                         "questions' own (a patch needs one layout)")  # fmt: skip
    return ex._replace(inputs=inputs, spans=spans), twin


def twin_of(run: LoadedRun, batch) -> tuple[Examples, object]:
    """(the questions, their recoloured twin's inputs) of one batch (module docstring):
    the authors' rainbow on a drawn batch under their protocol, else the batch's own."""
    drawn = getattr(run.subject, "photos", None) is None
    if protocol_of(run) == "authors" and drawn:
        seed = (getattr(run.subject, "key", None) or {}).get("seed", 0)
        return rainbow_examples(batch.view, batch.examples, seed)
    return batch.examples, batch.twins[TWIN].inputs


def layers_of(run: LoadedRun, n_blocks: int) -> tuple:
    """The LM blocks patched: `--layers` or every one; ValueError naming `--layers`
    where one is the last block's output (only the final norm reads it)."""
    layers = tuple(run.subject.layers or range(n_blocks))
    if max(layers) >= n_blocks or min(layers) < 0:
        raise ValueError(f"--layers = {list(layers)}: expected layers in 0..{n_blocks - 1} "
                         "(layer L: the residual before block L)")  # fmt: skip
    return layers


def batch_logp(run: LoadedRun, batch, log) -> dict:
    """One batch's table: {"logp": patch_logp's dict of the twin, "answer": [B]}."""
    ex, twin = twin_of(run, batch)
    view, n = batch.view, len(np.asarray(ex.answer_B))
    layers = layers_of(run, view.n_lm_blocks(run.params))
    groups, shared = token_groups(ex.spans), np.asarray(ex.spans.image_BxI).min(1)
    if protocol_of(run) == "authors":
        groups = authors_groups(groups, ex.spans)
    twins = {TWIN: twin}
    secs = log_estimate(run, view, ex.inputs, n * (2 + len(layers) * len(groups)),
                        f"{len(layers)} layers x {len(groups)} groups x {n} questions, one twin "
                        "(a patched run counted whole: an over-count)", log)  # fmt: skip
    call = table_call_for(view, run.params, twins, groups, layers, shared)
    # the plan's sizing compile is kept: where its rows are the chunk's, the table's own
    at = remembered(table_compile_at(call, run.params, ex.inputs, twins, groups, ex.answer_B,
                                     ex.other_B))  # fmt: skip
    rows, plan = rows_per_call(run, at, n, log, secs)
    store = table_store(run, "attribute_swapping", layers=list(layers),
                        protocol=protocol_of(run), **batch.key)  # fmt: skip
    logp = patch_table(view, run.params, ex.inputs, twins, groups, ex.answer_B, ex.other_B,
                       batch=rows, progress=chunk_progress(log, rows), call=call, store=store,
                       plan=plan, compiled=at.program)  # fmt: skip
    return {"logp": logp[TWIN], "answer": np.asarray(ex.answer_B)}


def compute(run: LoadedRun, log=print) -> dict:
    """The recolour twin's patch table over the subject's batches of the patched
    relation (`questions.patched_relation`), joined: {"logp": {orig, twin, patched, and
    each's _other}, "answer": [B], "words", "layers", "protocol"}."""
    view = report_view(run, "patching")  # the patching scripts' prompt (attribute_swapping.py's)
    rel, words = patched_relation(run, view)
    out = [batch_logp(run, b, log) for b in question_batches(run, (rel,), (TWIN,), view)]
    res = joined(out, ("logp", "answer"))
    layers = layers_of(run, view.n_lm_blocks(run.params))
    return res | {"words": words, "layers": layers, "protocol": protocol_of(run)}


def readouts(res: dict) -> dict:
    """{"change": [K, Y, G, B] patched - unpatched log p(answer), "flipped": same (1.0
    where the patch changed the answer), "twin_change": [K, B] the twin's own,
    "authors": {word: [K, Y, G, B]} (module docstring)}."""
    d = res["logp"]
    orig, other = np.asarray(d["orig"]), np.asarray(d["orig_other"])
    patched, p_other = np.asarray(d["patched"]), np.asarray(d["patched_other"])
    before = (orig > other)[:, None, None]
    out = {
        "change": patched - orig[:, None, None],
        "flipped": (before != (patched > p_other)).astype(float),
        "twin_change": np.asarray(d["twin"]) - orig,
    }
    first = np.asarray(res["answer"]) == next(iter(res["words"].values()))  # answer: word 0
    out["authors"] = {}
    for w, name in enumerate(list(res["words"])[:2]):
        pick = lambda own, oth: np.where(first == (w == 0), own, oth)  # noqa: E731
        o, t = pick(orig, other), pick(np.asarray(d["twin"]), np.asarray(d["twin_other"]))
        p = pick(patched, p_other)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = (o[:, None, None] - p) / (o - t)[:, None, None]
        out["authors"][name] = np.where(np.isfinite(s), s, 0.0)
    return out


def with_readouts(res: dict) -> dict:
    return res | {"read": readouts(res)}


def result_rows(res: dict, run: LoadedRun) -> list[dict]:
    """results.csv (module docstring): per model, layer and group."""
    r, rows = res["read"], []
    n_groups = r["change"].shape[2]
    for k, model in enumerate(run.models):
        for y, layer in enumerate(res["layers"]):
            for g in range(n_groups):
                c = cell_interval(r["change"][k : k + 1, y, g])
                f = cell_interval(r["flipped"][k : k + 1, y, g], 0.0, 1.0)
                row = {"model": model, "layer": layer, "group": GROUPS[g], "change": c[0],
                       "change_low": c[1], "change_high": c[2], "n": c[3], "flipped": f[0],
                       "flipped_low": f[1], "flipped_high": f[2]}  # fmt: skip
                for word, v in r["authors"].items():
                    a = cell_interval(v[k : k + 1, y, g])
                    row |= {f"authors_{word}": a[0], f"authors_{word}_low": a[1],
                            f"authors_{word}_high": a[2]}  # fmt: skip
                rows.append(row)
    return rows


def summarise(res: dict, tables: dict, run: LoadedRun, log) -> dict:
    """Per layer and group: the change of log p(answer) and the share flipped."""
    r, out = res["read"], {}
    twin = cell_interval(r["twin_change"])
    log(f"\nattribute swapping ({res['protocol']}'s protocol): the recoloured twin alone "
        f"moves log p(answer) by {fmt_interval(twin)}; patched into the question:")  # fmt: skip
    for y, layer in enumerate(res["layers"]):
        for g in range(r["change"].shape[2]):
            c = cell_interval(r["change"][:, y, g])
            f = cell_interval(r["flipped"][:, y, g], 0.0, 1.0)
            theirs = {f"authors_{w}": cell_interval(v[:, y, g]) for w, v in r["authors"].items()}
            out[f"{layer}/{GROUPS[g]}"] = {"change": c, "flipped": f} | theirs
            log(f"layer {layer:>3} {GROUPS[g]:>8}: change {fmt_interval(c)}; flipped "
                f"{fmt_interval(f, signed=False)}")  # fmt: skip
    return {"protocol": res["protocol"], "twin_change": twin, "patches": out,
            "layers": list(res["layers"]), "excluded": list(run.excluded)}  # fmt: skip


def _curves(v_KxYxGxB, groups) -> dict:
    """{group words: [Y, 4] cells} of the groups drawn."""
    v = np.asarray(v_KxYxGxB)
    return {GROUP_WORDS[g]: [cell_interval(v[:, y, GROUPS.index(g)]) for y in range(v.shape[1])]
            for g in groups}  # fmt: skip


def plot(res: dict, tables: dict, run: LoadedRun, path: str) -> list[str]:
    """The table's figure (change and flipped per group) and Fig. 4B beside it."""
    from jaxmech import plots

    r, layers = res["read"], list(res["layers"])
    every = GROUPS[: r["change"].shape[2]]
    paper_groups = [g for g in every if res["protocol"] != "authors" or g in PAPER_GROUPS]
    over = "questions (bootstrap)" if run.k == 1 else f"{run.k} models"
    table = [[("change of log p(answer), patched - unpatched", _curves(r["change"], every)),
              ("share of answers flipped", _curves(r["flipped"], every))]]  # fmt: skip
    paper = [[(f'(B) Attribute Swapping: \u0394"{w}"', _curves(v, paper_groups))
              for w, v in r["authors"].items()]]  # fmt: skip
    title = f"attribute swapping (recolour twin); band: 95% CI over {over}"
    paper_title = ("Fig. 4B: (unpatched - patched) / (unpatched - twin) per read word; "
                   f"band: 95% CI over {over}")  # fmt: skip
    return [
        plots.save(plots.shift_curves_figure(table, layers, title), path),
        plots.save(plots.shift_curves_figure(paper, layers, paper_title),
                   path.replace(".png", "_paper.png")),
    ]  # fmt: skip


def check(run: LoadedRun, log=print) -> None:
    """Before any compute: `--layers` patchable, and a drawn batch under the authors'
    protocol needs a view that renders pictures (their rainbow twin)."""
    from jaxmech.families.vlm_view import model_outline
    from jaxmech.reports.common import view_of

    view = view_of(run)
    layers_of(run, view.n_lm_blocks(model_outline(run.params)))
    drawn = getattr(run.subject, "photos", None) is None
    if protocol_of(run) == "authors" and drawn and view.render_images is None:
        raise ValueError(f"--protocol=authors: {view.name}'s view cannot render the "
                         "rainbow-recoloured pictures")  # fmt: skip


REPORT = Report(
    folder="attribute_swapping",
    refusal=declared("patching"),  # where the patching report applies
    compute=lambda run: with_readouts(compute(run)),
    tables=lambda res, run: {"results": result_rows(res, run)},
    summarise=summarise,
    plot=plot,
    figure="attribute_swapping.png",
    check=check,
    examples=EXAMPLES,
    per_model=("logp", "read"),
    photos=True,
)
