"""jaxmech's `--protocol=authors` ID fine-tune (`jaxmech.finetune_authors`,
`reports.authors_finetune`) against the authors' own `spatial_finetuning/train.py`, run
unmodified by `tests/fixtures/authors/make_authors_finetune.py` on two families' fixture
checkpoints (LLaVA `llava_336`, their `llava-7b`; Qwen2-VL `qwen2vl_28`, their
`qwen2-2b`), 3 optimizer steps (`--epochs=3 --lr=1e-3`; one batch of 4 questions an
epoch), without the ID loss (their baseline script) and with it (their spatial-loss
script, weight 1, layer 11).

Tolerances: both run float32 (their bfloat16 / float16 loads redirected to float32):
losses to 1e-5 relative, gradients to 1e-4 of each tensor's largest, the trained
weights' change to 1e-3 of its largest (Adam's first steps divide by the gradient's own
size, so a float32 rounding of a near-zero gradient moves its element by up to lr).
"""

import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
AUTHORS = os.path.join(HERE, "fixtures", "authors")
TRAIN = os.path.join(AUTHORS, "finetune_train")
FAMILIES = {  # kind -> (checkpoint, universal IDs)
    "llava": ("llava_336", "spatial_ids.npz"),
    "qwen2": ("qwen2vl_28", "spatial_ids_qwen2.npz"),
}


def reference(kind: str) -> dict:
    return dict(np.load(os.path.join(AUTHORS, f"finetune_{kind}.npz")))


def their_items(ref):
    from jaxmech.data.datasets import authors_grid

    return authors_grid.items(TRAIN, ref["listing"].tolist())  # their listing order


@pytest.mark.parametrize("kind", FAMILIES)
def test_selection_equals_theirs(kind):
    """Their `vision_mlp_lastk` selection over the stored tensors (30% budget, last 6
    blocks, projector names) chooses their tensors, of their total and budget: LLaVA
    the ViT MLP weights and the whole projector (biases too), Qwen2-VL the ViT MLP
    weights only (its `merger` is not a projector name)."""
    from jaxmech import finetune_authors as fa

    ref = reference(kind)
    sel = fa.select(fa.stored_sizes(os.path.join(AUTHORS, FAMILIES[kind][0])))
    assert sorted(sel.names) == sorted(ref["stored"].tolist())
    assert (sel.total, sel.budget, sel.used) == tuple(ref["budget"].tolist())


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_trainable_is_their_selection(kind):
    """The family's `trainable` spec (what jaxmech's own checkpoint fine-tune trains)
    names the leaves their selection maps to."""
    import jax
    import jax.numpy as jnp

    import jaxmech
    from jaxmech import finetune_authors as fa
    from jaxmech.train import path_mask

    ref = reference(kind)
    model = jaxmech.load(os.path.join(AUTHORS, FAMILIES[kind][0]), dtype=jnp.float32)
    leaves = fa.leaf_map(model.family, model.config, ref["stored"].tolist())
    theirs = fa.leaf_mask(model.params, [p for p, _ in leaves.values()])
    ours = path_mask(model.params, model.family.trainable(model.params))
    assert jax.tree_util.tree_leaves(ours) == jax.tree_util.tree_leaves(theirs)


def test_selection_budget_is_greedy_by_size():
    """A binding budget takes the largest candidates first and skips one that overflows;
    a non-MLP, a bias of a ViT block and a block before the last k are never chosen."""
    from jaxmech import finetune_authors as fa

    sizes = {"vision.layers.0.mlp.fc1.weight": 50, "vision.layers.1.mlp.fc1.weight": 40,
             "vision.layers.2.mlp.fc1.weight": 30, "vision.layers.2.mlp.fc1.bias": 5,
             "vision.layers.2.attn.q.weight": 30, "multi_modal_projector.w.weight": 20,
             "lm.layers.0.mlp.up_proj.weight": 325}  # fmt: skip
    sel = fa.select(sizes, budget_frac=0.1, last_k=2)  # budget int(0.1 * 500) = 50
    assert sel.names == ["vision.layers.1.mlp.fc1.weight"] and sel.budget == 50
    sel = fa.select(sizes, budget_frac=0.2, last_k=2)  # 100: 40 + 30 + 20
    assert sel.names == ["vision.layers.1.mlp.fc1.weight", "vision.layers.2.mlp.fc1.weight",
                         "multi_modal_projector.w.weight"]  # fmt: skip
    with pytest.raises(ValueError, match="budget_frac"):
        fa.select(sizes, budget_frac=0.0)


def test_their_folder_split_and_batches():
    """Their file names parse (names with spaces and underscores too); their split holds
    out their pair from their listing; each epoch is their one batch of the training
    pair's 4 questions, grouped or not; a bad name is refused naming the file."""
    from jaxmech.data.datasets import authors_grid as G

    assert G.parse_name("teddy bear_1-2_hot_dog_3-0.png") == ("teddy bear", 1, 2, "hot_dog", 3, 0)
    with pytest.raises(ValueError, match="camel_frog.png"):
        G.parse_name("camel_frog.png")
    ref = reference("qwen2")
    its = their_items(ref)
    train, held, pairs = G.split_pairs(its)
    assert pairs == [tuple(ref["holdout"].tolist())] and len(held) == 4
    for grouped in (True, False):
        (batch,) = G.batches(its, train, 15, grouped)
        assert sorted(batch) == train
    # B at (2, 0), (0, 3), (3, 2) from A at (0, 0): left; above; left and above
    assert sorted(its[i].answer for i in train) == ["above", "above", "left", "left"]


def test_batches_follow_their_sampler_rules():
    """Grouped: chunks of `batch_size` per (obj1, cell, obj2) group, a chunk of one
    dropped; plain: the last short batch kept; a seeded order permutes, same batches."""
    from jaxmech.data.datasets import authors_grid as G

    names = [f"a_0-0_b_{x}-0.png" for x in (1, 2, 3)] + ["a_1-1_b_2-2.png"]
    its = G.items("d", names)  # 3 left/right + 2 (left/right, above/below)
    train = list(range(len(its)))
    assert G.batches(its, train, 2, grouped=True) == [[0, 1], [3, 4]]  # [2] dropped
    assert G.batches(its, train, 2, grouped=False) == [[0, 1], [2, 3], [4]]
    shuffled = G.batches(its, train, 2, grouped=True, seed=[0, 1])
    assert sorted(map(len, shuffled)) == [2, 2] and [3, 4] in map(sorted, shuffled)
    assert all(set(b) <= {0, 1, 2} or sorted(b) == [3, 4] for b in shuffled)


def test_schedule_equals_their_learning_rates():
    """transformers' linear schedule with int(3%) warm-up: their 3 steps' rates, and a
    longer run's warm-up then decay to 0."""
    from jaxmech import finetune_authors as fa

    at = fa.schedule(1e-3, 3)
    np.testing.assert_allclose([float(at(t)) for t in range(3)], reference("llava")["lm/lr_S"],
                               rtol=1e-6)  # fmt: skip
    at = fa.schedule(1.0, 100)  # 3 warm-up steps
    np.testing.assert_allclose([float(at(t)) for t in (0, 1, 3, 50, 100)],
                               [0.0, 1 / 3, 1.0, 50 / 97, 0.0], rtol=1e-6)  # fmt: skip


def test_id_loss_is_their_arithmetic():
    """Centred over the rows where obj2's token was found, cosine over those whose cell
    has an ID; 0 with fewer than 2 found."""
    import jax.numpy as jnp

    from jaxmech import finetune_authors as fa

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 4)).astype(np.float32)
    t = rng.normal(size=(3, 4)).astype(np.float32)
    pos, has = np.array([2, -1, 4]), np.array([True, True, False])
    batch = fa.Batch(None, None, jnp.asarray(pos), jnp.asarray(t), jnp.asarray(has))
    s = x[[0, 2], [2, 4]]
    c = s - s.mean(0)  # both found rows centre; only row 0 has a cell ID
    want = 1 - c[0] @ t[0] / np.linalg.norm(c[0]) / np.linalg.norm(t[0])
    np.testing.assert_allclose(float(fa.id_loss(jnp.asarray(x), batch)), want, rtol=1e-5)
    one = batch._replace(id_pos_B=jnp.asarray([2, -1, -1]))
    assert float(fa.id_loss(jnp.asarray(x), one)) == 0.0
    ids = np.array([[5, 7, 5, 1], [1, 2, 3, 4]])
    assert fa.last_position(ids, [5, 9]).tolist() == [2, -1]  # their last occurrence


@pytest.mark.parametrize("kind", FAMILIES)
def test_batch_tokens_and_labels_equal_theirs(kind):
    """jaxmech's rendering of their batch (the view's chat prompt, rows left-padded, the
    answer turn appended) gives their collator's token rows and labels, including on a
    padded row the prompt's last pad-count tokens, which their prefix-length mask leaves
    as labels (rows compared as sets: their sampler's order within a batch is
    unseeded)."""
    import jax.numpy as jnp

    import jaxmech
    from jaxmech import finetune_authors as fa
    from jaxmech.data.datasets import authors_grid as G

    ref = reference(kind)
    model = jaxmech.load(os.path.join(AUTHORS, FAMILIES[kind][0]), dtype=jnp.float32)
    its = their_items(ref)
    (b,) = G.batches(its, G.split_pairs(its)[0], 15, grouped=True)
    batch = fa.render_batch(model.view(wording="authors"), model.processor, model.family,
                            [its[i] for i in b])  # fmt: skip
    rows = lambda a: sorted(map(tuple, np.asarray(a).tolist()))  # noqa: E731
    assert rows(batch.inputs.tokens_BxS) == rows(ref["id/input_ids_0"])
    assert rows(batch.labels_BxS) == rows(ref["id/labels_0"])
    valid = np.asarray(batch.inputs.valid_BxS)
    assert not valid.all()  # a padded row: the label quirk is exercised


def _check_run(kind, run, model, view_records, params):
    """A run's per-step loss, rate, norm and gradients, and its trained weights, against
    theirs (`finetune` with keep_grads; `params` after the last step)."""
    import jax

    from jaxmech import finetune_authors as fa
    from jaxmech.train import param_paths

    ref = reference(kind)
    names = [n for n in ref["stored"].tolist()]
    torch_names = dict(zip(names, ref["chosen"].tolist()))
    leaves = fa.leaf_map(model.family, model.config, names)
    order = {p: k for k, p in enumerate(p for p in param_paths(model.params)
                                        if p in {q for q, _ in leaves.values()})}  # fmt: skip
    np.testing.assert_allclose([r["loss"] for r in view_records], ref[f"{run}/loss_S"], rtol=1e-5)
    np.testing.assert_allclose([r["lr"] for r in view_records], ref[f"{run}/lr_S"], rtol=1e-6)
    np.testing.assert_allclose([r["norm"] for r in view_records], ref[f"{run}/norm_S"], rtol=1e-4)
    before = dict(zip(param_paths(model.params), jax.tree_util.tree_leaves(model.params)))
    after = dict(zip(param_paths(params), jax.tree_util.tree_leaves(params)))
    for n, (path, transform) in leaves.items():
        t = torch_names[n]
        for s, rec in enumerate(view_records):
            ours = np.asarray(rec["grads"][order[path]])
            key = f"{run}/grad_{s}/{t}"
            if key not in ref:  # outside their loss's graph: no gradient, no update
                assert t in ref[f"{run}/no_grad_{s}"].tolist() and not ours.any()
                continue
            want = np.asarray(transform(ref[key]))
            np.testing.assert_allclose(ours, want, atol=1e-4 * np.abs(want).max(), rtol=0)
        change = np.asarray(after[path]) - np.asarray(before[path])
        want = np.asarray(transform(ref[f"{run}/trained/{t}"])) - np.asarray(before[path])
        np.testing.assert_allclose(change, want, atol=1e-3 * max(np.abs(want).max(), 1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAMILIES)
def test_finetune_equals_theirs(kind):
    """Both runs (their baseline: LM loss, plain batches; their spatial loss: + the ID
    loss at layer 11, grouped batches) of 3 steps from the checkpoint: per step the loss,
    learning rate, gradient norm before clipping and every selected tensor's gradient
    (in jaxmech's layout), and the trained weights, equal theirs; a tensor outside their
    loss's graph (LLaVA's last ViT block) has no gradient and keeps its weights. LLaVA's
    steps are clipped (norm ~10), Qwen2-VL's are not (~0.09). Slow: two compiles of a
    32- (28-) block LM, ~25 s a run on 2 cores."""
    import jax.numpy as jnp

    import jaxmech
    from jaxmech import finetune_authors as fa
    from jaxmech.reports.authors_finetune import Recipe, finetune

    ref = reference(kind)
    folder, ids_file = FAMILIES[kind]
    model = jaxmech.load(os.path.join(AUTHORS, folder), dtype=jnp.float32)
    ids = np.load(os.path.join(AUTHORS, ids_file))
    table = fa.id_table(ids["universal_LxCxD"], ids["cells_Cx2"], ids["layers"], 11)
    recipe = Recipe(epochs=3, lr=1e-3)
    its = their_items(ref)
    for run, weight in (("lm", 0.0), ("id", 1.0)):
        params, records = finetune(model, its, recipe, weight, table, keep_grads=True,
                                   log=lambda *a: None)  # fmt: skip
        _check_run(kind, run, model, records, params)


def test_bad_options_are_refused_by_name(tmp_path):
    """Before any model is read: a weight above 0 without universal IDs, a missing
    folder, a folder of badly named pictures, a bad recipe."""
    from jaxmech.reports.authors_finetune import Recipe, run_authors_finetune

    with pytest.raises(ValueError, match="universal"):
        run_authors_finetune(None, str(tmp_path), TRAIN, [0.0, 1.0], Recipe())
    with pytest.raises(ValueError, match="weights"):
        run_authors_finetune(None, str(tmp_path), TRAIN, [-1.0], Recipe())
    with pytest.raises(ValueError, match="nowhere"):
        run_authors_finetune(None, str(tmp_path), str(tmp_path / "nowhere"), [0.0], Recipe())
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "camel.png").write_bytes(b"")
    with pytest.raises(ValueError, match="camel.png"):
        run_authors_finetune(None, str(tmp_path), str(tmp_path / "pics"), [0.0], Recipe())
    for bad in ({"epochs": 0}, {"lr": 0.0}, {"budget_frac": 2.0}, {"holdout_frac": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Recipe(**bad)


@pytest.mark.slow
def test_report_writes_their_runs(tmp_path):
    """`run_authors_finetune` (what `experiments.id_loss --protocol=authors` runs) on
    Qwen2-VL, one epoch per weight 0 and 1: summary.json holds their selection, held-out
    pair and each weight's first step (their lm and id runs' first losses); the trained
    tensors are stored under the checkpoint's names. Slow: two compiles (~30 s)."""
    import json

    import jax.numpy as jnp

    import jaxmech
    from jaxmech.reports.authors_finetune import Recipe, run_authors_finetune

    ref = reference("qwen2")
    model = jaxmech.load(os.path.join(AUTHORS, FAMILIES["qwen2"][0]), dtype=jnp.float32)
    ids = os.path.join(AUTHORS, FAMILIES["qwen2"][1])
    run_authors_finetune(model, str(tmp_path), TRAIN, [0.0, 1.0], Recipe(lr=1e-3), ids,
                         log=lambda *a: None)  # fmt: skip
    folder = tmp_path / "authors_finetune"
    summary = json.loads((folder / "summary.json").read_text())
    assert sorted(summary["selection"]["names"]) == sorted(ref["stored"].tolist())
    assert summary["holdout"] == [ref["holdout"].tolist()]
    for w, run in (("0.0", "lm"), ("1.0", "id")):
        np.testing.assert_allclose(
            summary["runs"][w][0]["loss"], ref[f"{run}/loss_S"][0], rtol=1e-5
        )
        assert sorted(np.load(folder / f"trained_w{w}.npz").files) == sorted(ref["stored"].tolist())
