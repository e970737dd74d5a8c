"""The 2D task: config, vocabulary, sampler invariants, evaluation sets, decomposition."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.analysis.ablate import ablation_table
from jaxmech.analysis.decompose import decompose, part_terms
from jaxmech.config import Config, ConfigError, Settings
from jaxmech.data.tasks import relations2d as r2
from jaxmech.data.tasks import task_vocab
from jaxmech.data.tasks.grouped import seen_mask
from jaxmech.data.tasks.vocab import Vocab
from jaxmech.families.dual_encoder.evaluate import METRICS, evaluate
from jaxmech.families.dual_encoder.model import init_params
from jaxmech.train import build_data, stack_settings, train_models

CFG = Config().replace(task_kind="2d")
B = 2048

TINY = Config().replace(
    task_kind="2d",
    grid_h=3,
    grid_w=3,
    n_labels=8,
    n_val_labels=3,
    n_pair_labels=5,
    layouts_per_pair=4,
    d_model=32,
    d_head=8,
    d_embed=32,
    batch_size=32,
    steps=20,
    eval_every=10,
)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _sample(tables, key, settings, task, batch_size):
    return r2.sample_batch(tables, key, settings, task, batch_size)


def _static(task):
    """Sweepable fields at defaults: the sampler must read them from settings only."""
    return dataclasses.replace(task, n_pair_labels=15, layouts_per_pair=15, single_frac=0.5)


def _draw(cfg, n_batches=2, seed=0):
    tables = r2.build_tables(cfg.task)
    keys = jax.random.split(jax.random.PRNGKey(seed), n_batches)
    out = [_sample(tables, k, cfg.settings(), _static(cfg.task), B) for k in keys]
    return tables, np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


def _decoded(n):
    v = Vocab(n, task_vocab(CFG.task).words)
    return [v.decode(row) for row in r2.caption_tokens(n)]


def _rc(cell, w=4):
    return cell // w, cell % w


def _holds(caption: str, where: dict, w=4) -> bool:
    """Whether a decoded caption is true of objects at `where` {label: cell}."""
    s = caption.split()
    if len(s) == 7:  # a is on the left/right of b
        (ra, ca), (rb, cb) = _rc(where[int(s[0])], w), _rc(where[int(s[6])], w)
        return ca < cb if s[4] == "left" else ca > cb
    if len(s) == 4:  # a is above/below b
        (ra, ca), (rb, cb) = _rc(where[int(s[0])], w), _rc(where[int(s[3])], w)
        return ra < rb if s[2] == "above" else ra > rb
    (lab,) = [int(s[0])]
    r, c = _rc(where[lab], w)
    if len(s) == 5:
        return (2 * c < w) == (s[4] == "left")
    if len(s) == 3:
        return (2 * r < 4) == (s[2] == "above")
    return len(s) == 1


def _objects(img):
    cells = np.flatnonzero(img)
    return {int(img[c]): int(c) for c in cells}, cells


# ---------------------------------------------------------------------------
# config and vocabulary


def test_config_kind_fields():
    t = CFG.task
    assert t.image_len == 16 and t.n_layouts == 120
    assert Config().replace(task_kind="2d", grid_h=2, grid_w=5).task.image_len == 10
    with pytest.raises(ConfigError, match="grid_h"):
        Config().replace(grid_h=3)  # grid fields belong to kind 2d
    with pytest.raises(ConfigError, match="grid_w"):
        Config().replace(task_kind="2d", grid_w=1)
    with pytest.raises(ConfigError, match="task_kind"):
        Config().replace(task_kind="3d")
    with pytest.raises(ConfigError, match="epochs"):
        Config().replace(task_kind="2d", epochs=5)
    with pytest.raises(ConfigError, match="layouts_per_pair"):
        Config().replace(task_kind="2d", layouts_per_pair=121)
    # round trip; a JSON written before the kind fields existed reads as 1D
    assert json.loads(CFG.to_json())["task"]["task_kind"] == "2d"
    old = json.loads(Config().to_json())
    for name in ("task_kind",):
        del old["task"][name]
    assert Config.from_json(json.dumps(old)) == Config()
    for c in (CFG, TINY, Config()):
        assert Config.from_json(c.to_json()) == c


def test_vocab_and_caption_table():
    v1, v2 = task_vocab(Config().task), task_vocab(CFG.task)
    assert v1 == Vocab(20) and v1.text_vocab_size == 29  # 1D unchanged
    assert v2.text_vocab_size == 31 and v2.eot == 30 and v2.word("above") == 27
    n = 20
    caps = r2.caption_tokens(n)
    assert caps.shape == (r2.n_captions(n), 9)
    assert len(set(map(tuple, caps))) == len(caps)  # equal ids <=> equal captions
    assert ((caps == v2.eot).sum(1) == 1).all()
    dec = _decoded(n)
    for x, y in ((1, 2), (7, 20)):
        assert dec[r2.pair_first(n, 0, x, y)] == f"{x} is on the left of {y}"
        assert dec[r2.pair_second(n, 0, x, y)] == f"{x} is on the right of {y}"
        assert dec[r2.pair_first(n, 1, x, y)] == f"{x} is above {y}"
        assert dec[r2.pair_second(n, 1, x, y)] == f"{x} is below {y}"
    for lab in (1, 20):
        assert dec[r2.single_side(n, 0, lab, 0)] == f"{lab} is on the left"
        assert dec[r2.single_side(n, 1, lab, 1)] == f"{lab} is below"
        assert dec[r2.single_label(n, lab)] == f"{lab}"


# ---------------------------------------------------------------------------
# sampler


@pytest.mark.parametrize(
    "overrides",
    [{}, {"n_pair_labels": 5, "layouts_per_pair": 3, "caption_mode": "left_right"}],
    ids=["default", "npair5_lpp3_left_right"],
)
def test_training_batches_respect_the_task(overrides):
    cfg = CFG.replace(**overrides)
    t = cfg.task
    n_pair, lpp = t.n_pair_labels, t.layouts_per_pair
    tables, images, caps = _draw(cfg)
    dec = _decoded(20)
    images, caps = images.reshape(-1, 16), caps.reshape(-1)
    count = (images != 0).sum(1)
    n_single = round(0.5 * B)
    assert (count.reshape(-1, B)[:, :n_single] == 1).all()
    assert (count.reshape(-1, B)[:, n_single:] == 2).all()
    rank_of = np.argsort(tables.pair_perm, axis=-1)
    lay_index = {tuple(lay): i for i, lay in enumerate(tables.layouts.tolist())}
    rels = {"h": 0, "v": 0}
    single_rel = {"h": 0, "v": 0}
    seen_single_labels = set()
    for img, c in zip(images, caps):
        where, cells = _objects(img)
        s = dec[c]
        assert _holds(s, where), (img.reshape(4, 4), s)
        # the swapped caption is false
        if len(cells) == 1:
            (lab,) = where
            assert where[lab] not in tables.holdout_pos[lab]  # held-out cells never train
            seen_single_labels.add(lab)
            single_rel["h" if len(s.split()) == 5 else "v"] += 1
            continue
        x, y = int(img[cells[0]]), int(img[cells[1]])  # X at the row-major first cell
        assert x != y and max(x, y) <= n_pair  # pair labels only, never validation labels
        assert rank_of[x, y, lay_index[(cells[0], cells[1])]] < lpp  # a training layout
        rels["h" if "left" in s or "right" in s else "v"] += 1
    assert seen_single_labels == set(range(1, 21))
    for counts in (rels, single_rel):
        frac = counts["h"] / (counts["h"] + counts["v"])
        assert 0.45 < frac < 0.55, counts  # each relation about half the samples


def test_vmap_over_settings_equals_per_setting_calls():
    tables = r2.build_tables(CFG.task)
    per = [
        CFG.replace(n_pair_labels=npl, layouts_per_pair=lpp, single_frac=sf).settings()
        for npl, lpp, sf in [(15, 15, 0.5), (5, 3, 0.25), (9, 120, 0.75)]
    ]
    stacked = Settings(*(jnp.asarray([getattr(p, f) for p in per]) for f in Settings._fields))
    key = jax.random.PRNGKey(3)
    task = _static(CFG.task)
    vm = jax.jit(jax.vmap(lambda s: r2.sample_batch(tables, key, s, task, 256)))(stacked)
    for i, s in enumerate(per):
        one = _sample(tables, key, s, task, 256)
        np.testing.assert_array_equal(vm[0][i], one[0])
        np.testing.assert_array_equal(vm[1][i], one[1])
    assert not np.array_equal(vm[0][0], vm[0][1])


# ---------------------------------------------------------------------------
# evaluation sets


@pytest.fixture(scope="module")
def sets():
    tables = r2.build_tables(CFG.task)
    return tables, r2.build_eval_sets(CFG.task, tables)


def test_eval_captions_match_geometry(sets):
    _, ev = sets
    dec = _decoded(20)
    for name in ("single", "seen", "unseen"):
        images = getattr(ev, f"{name}_images")[getattr(ev, f"{name}_index")]
        true, swap = getattr(ev, f"{name}_true"), getattr(ev, f"{name}_swap")
        group = getattr(ev, f"{name}_group")
        assert set(np.unique(group)) == {0, 1}
        step = 1 if name == "single" else 37
        for i in range(0, len(images), step):
            where, _ = _objects(images[i])
            assert _holds(dec[true[i, 0]], where) and not _holds(dec[swap[i, 0]], where)
            rel = 0 if ("left" in dec[true[i, 0]] or "right" in dec[true[i, 0]]) else 1
            assert rel == group[i]
    # unseen: validation labels only, 20 pairs x (96 h + 96 v) rows
    assert len(ev.unseen_index) == 20 * 192 and ev.unseen_images.shape == (20 * 120, 16)
    assert set(np.unique(ev.unseen_images[ev.unseen_images > 0])) == set(range(16, 21))
    assert (np.bincount(ev.unseen_group) == 20 * 96).all()
    # label-set probe: one label replaced by a label absent from the image
    for i in range(0, len(ev.unseen_index), 13):
        present = set(_objects(ev.unseen_images[ev.unseen_index[i]])[0])
        words = dec[ev.labelset_false[i]].split()
        labels = {int(w) for w in words if w.isdigit()}
        assert len(labels - present) == 1 and len(labels & present) == 1
        assert ev.labelset_true[i] == ev.unseen_true[i, 0]


def test_single_eval_at_held_out_cells(sets):
    tables, ev = sets
    for img in ev.single_images[ev.single_index]:
        (lab, cell), *_ = _objects(img)[0].items()
        assert cell in tables.holdout_pos[lab]
    assert len(ev.single_index) == 20 * 2 * 2  # labels x held-out cells x relations


@pytest.mark.parametrize("n_pair,lpp", [(15, 15), (5, 3)])
def test_seen_pair_set_disjoint_from_training(sets, n_pair, lpp):
    tables, ev = sets
    cfg = CFG.replace(n_pair_labels=n_pair, layouts_per_pair=lpp)
    mask = np.asarray(seen_mask(ev, cfg.settings()))
    # every held-out (pair, layout) under each of its valid relations
    # exactly the training pairs' held-out layouts, each under its valid relations
    want = sum(
        tables.rel_ok[tables.pair_perm[x, y, lpp:]].sum()
        for x in range(1, n_pair + 1)
        for y in range(1, n_pair + 1)
        if x != y
    )
    assert mask.sum() == want
    held = {ev.seen_images[i].tobytes() for i in ev.seen_index[mask]}
    _, images, _ = _draw(cfg)
    sampled = {r.tobytes() for r in images.reshape(-1, 16).astype(np.int32)}
    assert held and not (held & sampled)
    single_eval = {r.tobytes() for r in ev.single_images}
    assert not (single_eval & sampled)
    labels = ev.seen_labels[mask]
    assert labels.max() <= n_pair and (ev.seen_ranks[mask] >= lpp).all()


# ---------------------------------------------------------------------------
# model: decomposition, training, evaluation


def test_decomposition_terms_sum_to_logits_on_grid_images():
    data = build_data(TINY)
    params = jax.jit(init_params, static_argnums=0)(TINY, jax.random.PRNGKey(0))
    params = jax.tree_util.tree_map(lambda x: x * 3.0, params)  # larger than at init
    images = jnp.asarray(data.evals.unseen_images[:6])
    assert images.shape == (6, 9)
    t = decompose(params, images)
    total = sum(t[k] for k in part_terms(t))
    np.testing.assert_allclose(total, t["logits"], rtol=1e-4, atol=1e-5)
    assert t["EP"].shape == (6, 4, 10, 10)  # CLS + 9 cells


@pytest.mark.slow  # trains a tiny model end to end (~1.5 min); `pytest -m slow`
def test_tiny_2d_training_and_grouped_metrics():
    s = stack_settings([TINY.replace(seed=i).settings() for i in range(2)])
    data = build_data(TINY)
    state, curves = train_models(TINY, s, data=data)
    for m in METRICS + ("unseen_h_acc", "unseen_v_acc", "single_h_acc", "labelset_v_acc"):
        assert np.isfinite(curves[m]).all(), m
    assert (curves["loss"][:, -1] < curves["loss"][:, 0]).all()
    # overall = mean over rows; h and v each half of the unseen rows
    u = curves["unseen_acc"][:, -1]
    np.testing.assert_allclose(
        u, 0.5 * (curves["unseen_h_acc"][:, -1] + curves["unseen_v_acc"][:, -1]), atol=1e-6
    )
    # ablation "none" is evaluate; the table carries the per-relation metrics
    params = jax.tree_util.tree_map(jnp.asarray, state.params)
    table = ablation_table(params, jax.tree_util.tree_map(jnp.asarray, s), data, ("none", "ep"))
    one = evaluate(
        jax.tree_util.tree_map(lambda x: x[0], params),
        data.evals,
        data.tables.captions,
        jax.tree_util.tree_map(lambda x: x[0], s),
    )
    for m in ("unseen_h_acc", "seen_v_acc", "labelset_acc"):
        np.testing.assert_allclose(table[m][0, 0], one[m], atol=1e-6)
