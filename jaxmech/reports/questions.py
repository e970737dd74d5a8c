"""What the paper 003 / 004 reports share: a subject's questions rendered by its VLM
view, the LM sites steered, and how a table is chunked, all asked of the subject
(`subjects`), never of its kind."""

from __future__ import annotations

import jax
import numpy as np

from jaxmech.analysis.patching import GROUPS
from jaxmech.analysis.steering import adversarial_targets
from jaxmech.data.spec import PRESENCE, take
from jaxmech.data.tasks import get_task
from jaxmech.families.vlm_view import Examples, VLMView, examples, model_outline

# PHOTO_RELATIONS re-exported: a report may import this module, not `batches`
from jaxmech.reports.batches import PHOTO_RELATIONS, readable_relations  # noqa: F401
from jaxmech.reports.subjects import LoadedRun


def view_of(run: LoadedRun) -> VLMView:
    """The VLM view of what `run` studies (its subject's)."""
    return run.subject.view(run)


def question_specs(run: LoadedRun) -> dict:
    """{"examples": spec, twin: spec}: the subject's questions as scene specs (a
    trained run's of `run.examples`, `subjects.EXAMPLES`; a checkpoint's drawn set)."""
    return run.subject.question_specs(run)


def question_batches(run: LoadedRun, relations, twins=(), view: VLMView | None = None) -> list:
    """The subject's questions of relation ids `relations` with the named twins, in
    batches of one shape (`reports.batches`): drawn scenes are one batch, a dataset's
    photographs one per processed image size; rendered by `view` (None: the subject's,
    `view_of`; a report's own: `report_view`)."""
    return run.subject.question_batches(run, relations, twins, view)


def report_view(run: LoadedRun, report: str) -> VLMView:
    """The view `report` renders its questions with: under the authors' protocol, the
    family's wording for that report where their script words its prompt its own way
    (`CheckpointFamily.authors_wordings`, e.g. LLaVA's patching); else the subject's."""
    wordings = dict(getattr(run.family, "authors_wordings", ()))
    own = view_of(run)
    if protocol_of(run) != "authors" or report not in wordings:
        return own
    config = run.family.read_config(run.path)
    return run.family.view(run.path, config, own.grid, own.size, wording=wordings[report])


def photo_relations(run: LoadedRun) -> tuple[tuple, dict]:
    """(ids of the photograph relations (`batches.PHOTO_RELATIONS`: on / under, front /
    behind) the subject's dataset has and its view can read, {name: why} of those it
    has but cannot read: a tokenizer whose two answer words begin alike); ((), {}) for
    drawn scenes, which have none."""
    photos = getattr(run.subject, "photos", None)
    if photos is None:
        return (), {}
    return readable_relations(view_of(run), photos)


def id_labels(run: LoadedRun) -> range:
    """The labels a universal spatial ID is averaged over (the subject's)."""
    return run.subject.id_labels(run)


def protocol_of(run: LoadedRun) -> str:
    """Whose protocol a report follows on `run`: a checkpoint's `--protocol` ("authors":
    the paper authors' scripts, BUILD_NOTES' difference table; "jaxmech"); a results
    folder's is jaxmech's."""
    return run.subject.protocol


def rows_per_call(run: LoadedRun, compile_at, n: int, log=print, seconds: float | None = None):
    """(rows per compiled call of a table over `n` questions, its `memory.Plan` or
    None): the subject's (`subjects` docstring). `seconds`: the table's estimated
    compute (`log_estimate`), which on CPU caps the rows per call
    (`memory.CPU_CHUNK_SECONDS`)."""
    return run.subject.rows_per_call(run, compile_at, n, log, seconds)


def probe_rows(run: LoadedRun, log=print) -> int | None:
    """Probe scenes per chunk of the forwards inside one compiled report (None: every
    scene at once)."""
    return run.subject.probe_rows(run, log)


def table_store(run: LoadedRun, table: str, **what):
    """The `chunks.ChunkStore` of table `table` with options `what`, or None (a
    trained run's tables are one call)."""
    return run.subject.store(table, **what)


def relation_questions(run: LoadedRun) -> Examples:
    """The questions of `run.examples` (`question_specs`) of both spatial relations
    (presence questions left out), rendered by the run's family; `spec.cells_BxK`
    [N, 3]: X, Y, distractor (-1: none)."""
    spec = question_specs(run)["examples"]
    return examples(view_of(run), take(spec, np.asarray(spec.relation_B) < PRESENCE))


def steering_examples(run: LoadedRun, batch=None):
    """(Examples, source cells, target cells) of `relation_questions` (or of a
    `QuestionBatch`'s questions whose X and Y cells are known: a photograph's from its
    boxes' centres): X steered from its cell to the far edge beyond Y
    (`analysis.steering.adversarial_targets`)."""
    if batch is None:
        ex, grid = relation_questions(run), view_of(run).grid
    else:
        ex, grid = batch.examples, batch.view.grid
        named = np.asarray(ex.spec.labels_BxK)[:, :2] > 0  # Y label 0: the image's middle
        known = ((np.asarray(ex.spec.cells_BxK)[:, :2] >= 0) | ~named).all(1)
        ex = take_examples(ex, np.flatnonzero(known))
    cells = np.asarray(ex.spec.cells_BxK)
    target = adversarial_targets(cells, np.asarray(ex.spec.relation_B), grid.h, grid.w,
                                 first_answer(view_of(run), ex))  # fmt: skip
    return ex, cells[:, 0], target


def first_answer(view, ex: Examples) -> np.ndarray:
    """[B] bool: each question's answer is its relation's first word (left / above)."""
    words = np.asarray(view.answer_words)[np.asarray(ex.spec.relation_B)]
    return np.asarray(ex.answer_B) == words[:, 0]


def take_examples(ex: Examples, rows) -> Examples:
    """The questions at `rows` of `ex` (the spans' per-image-token fields kept)."""
    pick = lambda x: None if x is None else np.asarray(x)[rows]  # noqa: E731
    spans = ex.spans._replace(**{f: pick(getattr(ex.spans, f)) for f in (
        "image_BxI", "x_B", "y_B", "question_BxS", "answer_B", "first_B")})  # fmt: skip
    inputs = jax.tree_util.tree_map(pick, ex.inputs)
    return Examples(take(ex.spec, rows), inputs, spans, pick(ex.answer_B), pick(ex.other_B))


def steered_sites(run: LoadedRun) -> list[int]:
    """The LM sites the steering reports steer: every layer 1 <= y < n (before layer 1
    the object word has seen no image; after the last block only the final norm reads
    the residual), a checkpoint's within its `--layers`."""
    layers = run.subject.layers
    n = view_of(run).n_lm_blocks(model_outline(run.params))
    return [y for y in (layers if layers else range(n)) if 1 <= y < n]


def chunk_progress(log, batch: int):
    """`progress(done, n, resumed=0)` that logs the questions done, the time spent and
    an ETA after each chunk of `batch` (silent when the questions fit in one);
    `resumed` of them were read from a store, not computed."""
    import time

    t0 = time.perf_counter()

    def progress(done: int, n: int, resumed: int = 0) -> None:
        if n > batch:
            spent = time.perf_counter() - t0
            rate = spent / max(done - resumed, 1)
            was = f" ({resumed} resumed)" if resumed else ""
            log(f"  {done}/{n} questions{was}, {spent:.0f} s, ETA {rate * (n - done):.0f} s")

    return progress


def log_estimate(run: LoadedRun, view: VLMView, inputs, forwards: float, what: str,
                 log) -> float | None:  # fmt: skip
    """A checkpoint's table's estimated seconds, logged before it computes: `forwards`
    full forwards (or their equivalent) of one question `inputs` (leaves leading with B; row
    0 is traced, not compiled) at one forward's FLOPs (`sizing.program_cost`: a scanned
    block counted per block, where XLA's cost analysis counts its body once) over this
    machine's matmul rates (`sizing.product_seconds`), compile not included. Only where
    the subject asks for it (`estimates_time`: a checkpoint; a toy's tables take
    seconds: None)."""
    if not run.subject.estimates_time:
        return None
    from jaxmech.sizing import product_seconds, program_cost

    one = jax.tree_util.tree_map(lambda x: np.asarray(x)[:1], inputs)
    fn = jax.jit(lambda p, x: view.forward(p, x)[0])
    cost = program_cost(fn.trace(model_outline(run.params), one).jaxpr)
    flops = cost["flops"] + cost["flops_low"]
    secs, rates = product_seconds(cost)
    log(f"  estimate: {what} = {forwards:.0f} forwards of {flops / 1e9:.3g} GFLOP at this "
        f"machine's {rates} matmul rates: ~{_duration(forwards * secs)} (compile not "
        "included)")  # fmt: skip
    return forwards * secs


def _duration(secs: float) -> str:
    return f"{secs:.0f} s" if secs < 120 else f"{secs / 60:.1f} min"


# The mirror-swap tables' questions and token groups (patching, attribute swapping)


def patched_relation(run: LoadedRun, view) -> tuple[int, dict]:
    """(relation id, {word name: answer token, "both": None}) of the questions patched:
    the task's first relation (`Task.answer_relations`); a checkpoint's: left / right."""
    if run.task is None:
        first, second = (int(w) for w in np.asarray(view.answer_words)[0])
        return 0, {"left": first, "right": second, "both": None}
    rel = get_task(run.config.task.task_kind).answer_relations[0][1]
    first, second = (int(w) for w in np.asarray(view.answer_words)[rel])
    names = get_task(run.config.task.task_kind).words
    return rel, {names[first]: first, names[second]: second, "both": None}


def authors_groups(groups_GxBxS, spans) -> np.ndarray:
    """`token_groups` as the authors' patching scripts draw them: their "text" group
    (`mirror_swapping.py` 267-271, `range(575, len(tokens) + 575)`: the prompt's
    tokens shifted by the image's 576 - 1) also holds the image's last two tokens."""
    out = np.array(groups_GxBxS)
    last = np.asarray(spans.image_BxI).max(1)  # [B] the image's last token
    pos = np.arange(out.shape[-1])[None]
    out[GROUPS.index("text")] |= pos >= last[:, None] - 1
    return out


# Fig. 4's token groups: the authors' three and every group, in the paper's words
PAPER_GROUPS = ("image", "text", "objects")
GROUP_WORDS = {"image": "Swapped All Image", "text": "Swapped All Text",
               "objects": "Swapped Obj Tokens", "question": "Swapped Question",
               "last": "Swapped Last Token", "all": "Swapped All Tokens"}  # fmt: skip
