"""jaxmech against the authors' ground-truth deviation (paper 003, Fig. 8A):
`ground_truth_deviation/coco_deviation.py` on `llava_336` and the COCO-Spatial sample,
then their `compute_spatial_distance` (`compute_coco_stats.py`, the arithmetic of
`fig_8a.ipynb`) and true IDs (`utils/coco.py`'s `get_subject_spatial_id`) at layer 12,
over their universal IDs and axes (`spatial_ids.npz`); run unmodified by
`tests/fixtures/authors/make_authors_reference.py` into `deviation.npz`. The same on
Qwen2-VL (`qwen2vl_28`, their `qwen2-2b`, layer 14: `fig_8b.ipynb` reads every model but
LLaVA's at 14) over its universal IDs (`spatial_ids_qwen2.npz`): `deviation_qwen2.npz`,
by `make_authors_occlusion.py`.

No model runs here (their stored word states are the inputs): each test < 1 s.
Tolerance: 1e-5 absolute (float32 arithmetic on the same numbers).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

HERE = os.path.dirname(__file__)
AUTHORS = os.path.join(HERE, "fixtures", "authors")
SAMPLE = os.path.join(HERE, "fixtures", "datasets", "whatsup")
COMMIT = "1c034d6ecbe1494c450d412f52fdf98e4a4c51c2"
GRID = SimpleNamespace(grid=SimpleNamespace(h=4, w=4))  # what `box_weights` reads of a view


def reference(suffix: str = "") -> tuple[dict, dict]:
    """(their deviation outputs, their spatial IDs): LLaVA's, or with `suffix` "_qwen2"
    Qwen2-VL's."""
    out = []
    for name in (f"deviation{suffix}.npz", f"spatial_ids{suffix}.npz"):
        ref = np.load(os.path.join(AUTHORS, name))
        assert str(ref["commit"]) == COMMIT
        out.append({k: ref[k] for k in ref.files})
    return out[0], out[1]


def jaxmech_true_ids() -> dict:
    """{image id: ([2, L] weights, [2] in their last column / row)}: jaxmech's boxes
    (`data.datasets.questions`, COCO-Spatial, every row) weighted as `--protocol=authors` does
    (`reports.batches.box_weights(authors=True)`)."""
    from jaxmech.data.datasets.questions import load_questions
    from jaxmech.reports.batches import box_weights, photo_sizes

    qs = load_questions("coco_spatial_all", SAMPLE).questions
    out = {}
    for q, (h, w) in zip(qs, photo_sizes(qs)):
        if q.boxes is None or None in q.boxes:
            continue  # their deviation needs both boxes (`make_authors_reference.boxed_rows`)
        image_id = int(os.path.basename(str(q.image)).split(".")[0])
        edge = [(b[0] + b[2] / 2) / w * 4 >= 3 or (b[1] + b[3] / 2) / h * 4 >= 3 for b in q.boxes]
        out[image_id] = (box_weights(GRID, q, (h, w), authors=True), np.array(edge))
    return out


def _compare_true_ids(edge: bool, suffix: str = "") -> int:
    ref, ids = reference(suffix)
    u = ids["universal_LxCxD"][list(ids["layers"]).index(int(ref["layer"]))]
    weights = jaxmech_true_ids()
    n = 0
    for case, theirs in zip(ref["case"], ref["true_id_Cx2xD"]):
        w, at_edge = weights[int(str(case).split("_")[-1])]
        for k in range(2):
            if at_edge[k] == edge:
                np.testing.assert_allclose(w[k] @ u, theirs[k], atol=1e-5, err_msg=str(case))
                n += 1
    return n


@pytest.mark.parametrize("suffix", ["", "_qwen2"])
def test_true_ids_equal_theirs_inside_the_grid(suffix):
    """X's and Y's true ID (the universal IDs weighted bilinearly at the box centre) as
    jaxmech's authors' protocol computes it equals theirs for every box whose centre is
    not in the last column or row (3 of the 6 boxes of the 3 questions with both), on
    LLaVA and Qwen2-VL."""
    assert _compare_true_ids(edge=False, suffix=suffix) == 3


@pytest.mark.parametrize("suffix", ["", "_qwen2"])
def test_true_ids_equal_theirs_at_the_last_column_and_row(suffix):
    """The same for the boxes whose centre is in the last column or row (the sample's
    139 person, 285 cup, 885 bench): their `utils/coco.py` builds the four weights in a
    dict literal, where the last column's x0 == x1 repeats a key and only its last
    weight, wx (1 - wy), is kept (`spatial_ids.authors_cell_weights`; summing them, as
    jaxmech's protocol would, gives 1 - wy and fails here)."""
    assert _compare_true_ids(edge=True, suffix=suffix) == 3


def _deviation(protocol: str, suffix: str = "") -> np.ndarray:
    """[C] the signed deviation of their stored states, true IDs and axes (layer 12) as
    jaxmech's `protocol` computes it (`analysis.diagnostics.COORDS`, centred on the
    text-only state as theirs; the authors' sign from the caption's answer word, as
    `answer_signs` reads it from the answer token)."""
    import jax.numpy as jnp

    from jaxmech.analysis.diagnostics import COORDS, signed_deviation

    ref, ids = reference(suffix)
    y = list(ids["layers"]).index(int(ref["layer"]))
    h, v = jnp.asarray(ids["x_axis_LxD"][y]), jnp.asarray(ids["y_axis_LxD"][y])
    state, text, true = ref["state_Cx2xD"], ref["text_Cx2xD"], ref["true_id_Cx2xD"]
    zero = np.zeros_like(true[:, 0])
    coords = COORDS[protocol]
    believed = [coords(state[:, k], text[:, k], h, v) for k in range(2)]
    truth = [coords(true[:, k], zero, h, v) for k in range(2)]
    word = [str(c).split("_")[2] for c in ref["case"]]  # their case: A_B_pos_neg_id
    relation = np.array([0 if w in ("left", "right") else 1 for w in word])
    sign = (
        None
        if protocol == "jaxmech"
        else np.array([1.0 if w in ("right", "below") else -1.0 for w in word])
    )
    return np.asarray(
        signed_deviation(believed[0], believed[1], truth[0], truth[1], relation, sign)
    )


@pytest.mark.parametrize("suffix", ["", "_qwen2"])
def test_signed_deviation_equals_theirs_per_question(suffix):
    """The authors' protocol's deviation (`plane_coords`: dot products with the
    Gram-Schmidt-orthonormalised axes; signed by the caption's answer word) on their
    stored states, true IDs and axes equals their deviation per question; jaxmech's own
    (least squares in cells, signed by the true displacement) does not (a check that
    the comparison can fail)."""
    ref, _ = reference(suffix)
    np.testing.assert_allclose(_deviation("authors", suffix), ref["distance"], atol=1e-5)
    assert np.abs(_deviation("jaxmech", suffix) - ref["distance"]).max() > 1e-3


def test_answer_signs_read_the_answer_word():
    """`answer_signs`: +1 where the answer token is its relation's second word (right,
    below), -1 where it is the first (left, above)."""
    from jaxmech.analysis.diagnostics import answer_signs

    view = SimpleNamespace(answer_words=np.array([[10, 11], [12, 13]]))
    spec = SimpleNamespace(relation_B=np.array([0, 0, 1, 1]))
    ex = SimpleNamespace(spec=spec, answer_B=np.array([10, 11, 12, 13]))
    np.testing.assert_array_equal(np.asarray(answer_signs(view, ex)), [-1, 1, -1, 1])


@pytest.mark.parametrize("folder, suffix", [("llava_336", ""), ("qwen2vl_28", "_qwen2")])
def test_the_photo_batches_true_ids_are_theirs(folder, suffix):
    """The true IDs the diagnostics report reads under `--protocol=authors`
    (`batches.photo_batches`' cell weights, on `llava_336`'s authors view) equal theirs
    for both boxes of every question: their box centres are placed on the whole
    photograph (`utils/coco.py` reads COCO's width and height), not on the centre crop
    LLaVA's processor shows (jaxmech's protocol, `batches.framed`), which moves every
    box of these 640 px wide photographs. The same on Qwen2-VL's authors view (layer
    14). No weights are read (the view only)."""
    from jaxmech.data.datasets.questions import load_questions
    from jaxmech.data.spec import Grid
    from jaxmech.families.registry import read_checkpoint_config
    from jaxmech.reports.batches import photo_batches

    ref, ids = reference(suffix)
    u = ids["universal_LxCxD"][list(ids["layers"]).index(int(ref["layer"]))]
    family, config = read_checkpoint_config(os.path.join(AUTHORS, folder))
    view = family.view(os.path.join(AUTHORS, folder), config, Grid(4, 4), None,
                       wording="authors")  # fmt: skip
    qset = load_questions("coco_spatial_all", SAMPLE)
    batch = photo_batches(view, qset, (0, 1), (), "authors")[0]
    image_ids = [int(os.path.basename(str(qset.questions[i].image)).split(".")[0])
                 for i in batch.index]  # fmt: skip
    theirs = {int(str(c).split("_")[-1]): t for c, t in zip(ref["case"], ref["true_id_Cx2xD"])}
    assert set(theirs) <= set(image_ids)
    for image_id, t in theirs.items():
        w = batch.cell_weights[image_ids.index(image_id)]
        np.testing.assert_allclose(w @ u, t, atol=1e-5, err_msg=str(image_id))


def test_the_authors_protocol_reads_one_universal_id_for_both_words():
    """Their diagnostics read one universal ID (the first-named word's, from one left /
    right question: `spatial_id_derivation/batch_extraction.sh`) for X's and Y's words
    and both relations: under `protocol="authors"` a single probe `[[p]]` serves every
    example (no second probe is read), as the report passes it, and gives what
    `[[p, q], [p, q]]` gives (Y's own probe q unread). On the toy VLM (~7 s)."""
    import jax
    from conftest import tiny_vlm_config

    from jaxmech.analysis import diagnostics as dg
    from jaxmech.analysis import spatial_ids as si
    from jaxmech.data.spec import probe_specs
    from jaxmech.families.toy_vlm import model as toy_vlm
    from jaxmech.families.toy_vlm.view import toy_view
    from jaxmech.families.vlm_view import examples

    config = tiny_vlm_config(lm_n_layers=2)
    view, labels = toy_view(config), range(1, config.task.n_labels + 1)
    params = toy_vlm.init_params(config, jax.random.PRNGKey(1))
    # questions of both relations: one placement of each label at each cell
    asked = [probe_specs(view.grid, labels, view.n_labels, view.n_colours, 1, 2, True, r)[0]
             for r in (0, 1)]  # fmt: skip
    ex = examples(view, jax.tree_util.tree_map(lambda *x: np.concatenate(x), *asked))
    assert set(np.asarray(ex.spec.relation_B).tolist()) == {0, 1}
    # two placements of the other object (the report's are factorial: the same reading)
    p, q = (si.probe(view, labels, 2, named_first=f, relation=0) for f in (True, False))
    occ = jax.tree_util.tree_map(lambda x: x[None], ex.inputs)

    def run(pairs):
        out = dg.diagnose(view, params, ex, pairs, occ, protocol="authors")
        return out["deviation"], out["believed"], out["true"]

    # [[p]] has no second probe: reading Y's own (jaxmech's protocol) raises there
    one, two = jax.jit(lambda: (run([[p]]), run([[p, q], [p, q]])))()
    for a, b in zip(one, two):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert np.isfinite(np.asarray(one[0])).all()
