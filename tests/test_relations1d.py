"""The 1D left/right task: tables, the jittable sampler and the evaluation sets."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.config import Config, Settings
from jaxmech.data.tasks.grouped import GroupedEvalSets, metric_names, seen_mask
from jaxmech.data.tasks.relations1d import (
    LineEvalSets,
    build_eval_sets,
    build_tables,
    caption_tokens,
    n_captions,
    pair_left,
    pair_right,
    sample_batch,
    single_label,
    single_side,
)
from jaxmech.data.tasks.vocab import CAPTION_LEN, Vocab

N_BATCHES, BIG_B = 4, 2048


@functools.partial(jax.jit, static_argnums=(3, 4))
def _sample(tables, key, settings, task, batch_size):
    return sample_batch(tables, key, settings, task, batch_size)


def _static_task(task):
    """The task with its sweepable fields at their defaults: the sampler must read them
    from `settings` only, so all settings share one compiled sampler."""
    return dataclasses.replace(task, n_pair_labels=15, layouts_per_pair=15, single_frac=0.5)


def _draw(cfg, settings, n_batches=N_BATCHES, batch_size=BIG_B, seed=0):
    tables = build_tables(cfg.task)
    keys = jax.random.split(jax.random.PRNGKey(seed), n_batches)
    task = _static_task(cfg.task)
    out = [_sample(tables, k, settings, task, batch_size) for k in keys]
    images = np.stack([np.asarray(i) for i, _ in out])
    caps = np.stack([np.asarray(c) for _, c in out])
    return tables, images, caps


def _objects(images):
    """Per image: number of objects, and (label, position) of the left / right object."""
    nz = images != 0
    count = nz.sum(-1)
    L = images.shape[-1]
    left_pos = np.argmax(nz, axis=-1)
    right_pos = L - 1 - np.argmax(nz[..., ::-1], axis=-1)
    left = np.take_along_axis(images, left_pos[..., None], -1)[..., 0]
    right = np.take_along_axis(images, right_pos[..., None], -1)[..., 0]
    return count, left, left_pos, right, right_pos


def _layout_rank(tables, x, y, px, py):
    """Rank of layout (px, py) in pair (x, y)'s training order, computed from pair_perm."""
    L = int(tables.layouts.max()) + 1
    lay_index = -np.ones((L, L), np.int64)
    lay_index[tables.layouts[:, 0], tables.layouts[:, 1]] = np.arange(len(tables.layouts))
    lay = lay_index[px, py]
    assert (lay >= 0).all()
    hits = tables.pair_perm[x, y] == lay[:, None]
    assert (hits.sum(-1) == 1).all()
    return np.argmax(hits, axis=-1)


def _decoded(n_labels):
    v = Vocab(n_labels)
    return [v.decode(row) for row in caption_tokens(n_labels)]


def _side(pos, L):
    return np.where(2 * pos < L, "left", "right")


# ---------------------------------------------------------------------------
# vocabulary and caption ids


def test_vocab_sizes_and_ids():
    v = Vocab(20)
    assert v.image_vocab_size == 22 and v.cls == 21 and v.background == 0
    # 20 labels + 6 words + BOS + EOT + PAD
    assert v.text_vocab_size == 29 and v.pad == 0
    ids = [v.word(w) for w in ("is", "on", "the", "left", "right", "of")] + [v.bos, v.eot]
    assert len(set(ids)) == 8 and min(ids) == 21 and max(ids) == 28
    toks = v.encode([3, "is", "on", "the", "left", "of", 17])
    assert len(toks) == CAPTION_LEN == 9
    assert toks[0] == v.bos and toks[-1] == v.eot and toks[1] == 3 and toks[7] == 17
    assert v.decode(toks) == "3 is on the left of 17"
    short = v.encode([5])
    assert short[:3] == [v.bos, 5, v.eot] and short[3:] == [v.pad] * 6
    with pytest.raises(ValueError):
        v.encode([1, "is", "on", "the", "left", "of", 2, "is"])


def test_caption_table_matches_id_helpers():
    n = 20
    caps = caption_tokens(n)
    dec = _decoded(n)
    v = Vocab(n)
    assert caps.shape == (n_captions(n), CAPTION_LEN) == (2 * n * n + 3 * n, 9)
    assert (caps[:, 0] == v.bos).all()
    assert ((caps == v.eot).sum(1) == 1).all()
    assert len(set(map(tuple, caps))) == len(caps)  # every id is a distinct caption
    for x in (1, 7, 20):
        for y in (2, 16, 20):
            assert dec[pair_left(n, x, y)] == f"{x} is on the left of {y}"
            assert dec[pair_right(n, x, y)] == f"{x} is on the right of {y}"
    for lab in (1, 9, 20):
        assert dec[single_side(n, lab, 0)] == f"{lab} is on the left"
        assert dec[single_side(n, lab, 1)] == f"{lab} is on the right"
        assert dec[single_label(n, lab)] == f"{lab}"


# ---------------------------------------------------------------------------
# tables


def test_tables_structure():
    task = Config().task
    t = build_tables(task)
    assert t.layouts.shape == (45, 2)
    assert (t.layouts[:, 0] < t.layouts[:, 1]).all()
    assert len(set(map(tuple, t.layouts))) == 45
    assert t.layouts.min() == 0 and t.layouts.max() == 9
    # every pair's layout order is a permutation of all layouts
    assert (np.sort(t.pair_perm, -1) == np.arange(45)).all()
    # each label: holdout and training positions partition the image
    assert t.holdout_pos.shape == (21, 2) and t.train_pos.shape == (21, 8)
    both = np.sort(np.concatenate([t.holdout_pos, t.train_pos], 1), 1)
    assert (both == np.arange(10)).all()
    # held-out positions differ between labels (chosen by the seed, not fixed)
    assert len(set(map(tuple, t.holdout_pos[1:]))) > 1


def test_tables_depend_only_on_data_seed():
    task = Config().task
    a, b = build_tables(task), build_tables(task)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    # the model/training config does not change the tables
    c = build_tables(Config().replace(seed=3, n_pair_labels=5, layouts_per_pair=2).task)
    for x, y in zip(a, c):
        np.testing.assert_array_equal(x, y)
    d = build_tables(Config().replace(data_seed=1).task)
    assert not np.array_equal(a.pair_perm, d.pair_perm)
    assert not np.array_equal(a.holdout_pos, d.holdout_pos)
    ea, ed = build_eval_sets(task, a), build_eval_sets(Config().replace(data_seed=1).task, d)
    assert not np.array_equal(ea.single_images, ed.single_images)


# ---------------------------------------------------------------------------
# sampler invariants


def _check_batch(cfg, tables, images, caps, n_pair, lpp, single_frac):
    """All sampler invariants for images [N, B, L] and caption ids [N, B]."""
    task = cfg.task
    n, L = task.n_labels, task.image_len
    B = images.shape[1]
    dec = _decoded(n)
    count, left, lpos, right, rpos = _objects(images)
    assert set(np.unique(count)) <= {1, 2}
    assert images.min() >= 0 and images.max() <= n

    # the first round(single_frac * B) samples of each batch are the single objects
    n_single = int(round(single_frac * B))
    assert (count == 1).sum(-1).tolist() == [n_single] * len(images)
    single = count == 1
    assert single[:, :n_single].all() and not single[:, n_single:].any()

    # --- singles: every label appears alone, never at a held-out position
    lab, pos = left[single], lpos[single]
    assert set(np.unique(lab)) == set(range(1, n + 1))
    assert not (tables.holdout_pos[lab] == pos[:, None]).any()
    assert (tables.train_pos[lab] == pos[:, None]).any(-1).all()
    cap_s = caps[single]
    side = _side(pos, L)
    for c, la, sd in zip(cap_s, lab, side):
        want_side = task.single_captions == "side" or (
            task.single_captions == "side_pair" and la <= n_pair
        )
        want = f"{la} is on the {sd}" if want_side else f"{la}"
        assert dec[c] == want

    # --- pairs: distinct training labels at a training layout
    pair = count == 2
    x, y, px, py = left[pair], right[pair], lpos[pair], rpos[pair]
    assert (x != y).all()
    assert x.max() <= n_pair and y.max() <= n_pair and min(x.min(), y.min()) >= 1
    val_labels = np.arange(n - task.n_val_labels + 1, n + 1)
    assert not np.isin(images[pair], val_labels).any()
    rank = _layout_rank(tables, x, y, px, py)
    assert rank.max() < lpp
    # the sampler does use all training layouts and all pair labels
    assert set(np.unique(rank)) == set(range(lpp))
    assert set(np.unique(np.concatenate([x, y]))) == set(range(1, n_pair + 1))

    forms = {"left": 0, "right": 0}
    for c, a, b in zip(caps[pair], x, y):
        s = dec[c]
        if s == f"{a} is on the left of {b}":
            forms["left"] += 1
        elif s == f"{b} is on the right of {a}":
            forms["right"] += 1
        else:
            raise AssertionError(f"caption {s!r} for {a} left of {b}")
    return forms


@pytest.mark.parametrize(
    "overrides",
    [{}, {"n_pair_labels": 5, "layouts_per_pair": 3}],
    ids=["default", "npair5_lpp3"],
)
def test_training_batches_respect_the_task(overrides):
    cfg = Config().replace(**overrides)
    settings = cfg.settings()
    tables, images, caps = _draw(cfg, settings)
    forms = _check_batch(
        cfg,
        tables,
        images,
        caps,
        cfg.task.n_pair_labels,
        cfg.task.layouts_per_pair,
        cfg.task.single_frac,
    )
    assert forms["right"] == 0 and forms["left"] > 0


def test_other_settings_and_single_frac():
    cfg = Config()
    settings = Settings(
        seed=0,
        n_pair_labels=4,
        layouts_per_pair=2,
        single_frac=0.3,
        lr=1e-3,
        weight_decay=0.1,
        epochs=0,
    )
    tables, images, caps = _draw(cfg, settings, n_batches=2)
    _check_batch(cfg, tables, images, caps, 4, 2, 0.3)


@pytest.mark.parametrize("single_captions", ["side_pair", "label"])
def test_left_right_and_single_caption_variants(single_captions):
    # Both variants share one compiled sampler each: caption_mode and single_captions
    # are static, n_pair_labels (which side_pair follows) is a setting.
    cfg = Config().replace(
        caption_mode="left_right",
        single_captions=single_captions,
        n_pair_labels=5,
        layouts_per_pair=4,
    )
    tables, images, caps = _draw(cfg, cfg.settings(), n_batches=1)
    forms = _check_batch(cfg, tables, images, caps, 5, 4, 0.5)
    # pairs: both forms, about half each (a fair coin per sample)
    assert 0.4 < forms["right"] / (forms["left"] + forms["right"]) < 0.6
    # singles
    count, *_ = _objects(images)
    dec = _decoded(20)
    single_caps = {dec[c] for c in caps[count == 1]}
    n_words = {len(s.split()) for s in single_caps}
    if single_captions == "label":
        assert single_caps == {str(lab) for lab in range(1, 21)}
    else:
        assert n_words == {1, 5}
        assert {s for s in single_caps if len(s.split()) == 5} == {
            f"{lab} is on the {side}" for lab in range(1, 6) for side in ("left", "right")
        }
        assert {s for s in single_caps if len(s.split()) == 1} == {str(lab) for lab in range(6, 21)}


def test_sampling_is_a_pure_function_of_the_key():
    cfg = Config()
    tables = build_tables(cfg.task)
    s = cfg.settings()
    k0, k1 = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    a = _sample(tables, k0, s, cfg.task, BIG_B)
    b = _sample(tables, k0, s, cfg.task, BIG_B)
    c = _sample(tables, k1, s, cfg.task, BIG_B)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_vmap_over_settings_equals_per_setting_calls():
    cfg = Config()
    tables = build_tables(cfg.task)
    per = [
        cfg.replace(n_pair_labels=npl, layouts_per_pair=lpp, single_frac=sf).settings()
        for npl, lpp, sf in [(15, 15, 0.5), (5, 3, 0.5), (9, 45, 0.25)]
    ]
    stacked = Settings(
        *(jnp.asarray([getattr(p, f) for p in per]) for f in Settings._fields),
    )
    key = jax.random.PRNGKey(7)
    B = BIG_B
    vm = jax.jit(
        jax.vmap(lambda s: sample_batch(tables, key, s, cfg.task, B)),
    )(stacked)
    for i, s in enumerate(per):
        single = _sample(tables, key, s, cfg.task, B)
        np.testing.assert_array_equal(vm[0][i], single[0])
        np.testing.assert_array_equal(vm[1][i], single[1])
    # the settings really differ in their batches
    assert vm[0][1].max() <= 20
    assert not np.array_equal(vm[0][0], vm[0][1])


# ---------------------------------------------------------------------------
# evaluation sets


@pytest.fixture(scope="module")
def default_sets():
    cfg = Config()
    tables = build_tables(cfg.task)
    return cfg, tables, build_eval_sets(cfg.task, tables)


def test_unseen_pair_set(default_sets):
    cfg, tables, ev = default_sets
    dec = _decoded(20)
    assert ev.unseen_images.shape == (900, 10)
    count, x, px, y, py = _objects(ev.unseen_images)
    assert (count == 2).all()
    assert set(np.unique(ev.unseen_images[ev.unseen_images > 0])) == set(range(16, 21))
    assert len({(a, b) for a, b in zip(x, y)}) == 20
    assert len(set(map(tuple, ev.unseen_images))) == 900  # 20 pairs x 45 layouts
    assert ev.unseen_true.shape == ev.unseen_swap.shape == (900, 1)
    for i in range(0, 900, 7):
        assert dec[ev.unseen_true[i, 0]] == f"{x[i]} is on the left of {y[i]}"
        assert dec[ev.unseen_swap[i, 0]] == f"{y[i]} is on the left of {x[i]}"
    assert (ev.unseen_true != ev.unseen_swap).all()


def test_labelset_probe(default_sets):
    cfg, tables, ev = default_sets
    dec = _decoded(20)
    _, x, _, y, _ = _objects(ev.unseen_images)
    np.testing.assert_array_equal(ev.labelset_true, ev.unseen_true[:, 0])
    replaced = {"x": 0, "y": 0}
    replacements = set()
    for i in range(900):
        a, _, _, _, _, _, b = dec[ev.labelset_false[i]].split()
        a, b = int(a), int(b)
        # one of the two labels replaced by a label absent from the image
        assert (a == x[i]) != (b == y[i])
        new = b if a == x[i] else a
        assert new not in (x[i], y[i]) and 1 <= new <= 20
        replaced["x" if b == y[i] else "y"] += 1
        replacements.add(new)
    assert min(replaced.values()) > 300
    assert len(replacements) == 20


def test_single_object_eval_positions_are_the_held_out_ones(default_sets):
    cfg, tables, ev = default_sets
    dec = _decoded(20)
    count, lab, pos, *_ = _objects(ev.single_images)
    assert (count == 1).all() and len(lab) == 20 * 2
    for label in range(1, 21):
        assert sorted(pos[lab == label]) == sorted(tables.holdout_pos[label])
    for i in range(len(lab)):
        side = "left" if 2 * pos[i] < 10 else "right"
        other = "right" if side == "left" else "left"
        assert dec[ev.single_true[i, 0]] == f"{lab[i]} is on the {side}"
        assert dec[ev.single_swap[i, 0]] == f"{lab[i]} is on the {other}"


@pytest.mark.parametrize("n_pair,lpp", [(15, 15), (5, 3), (15, 44)])
def test_seen_pair_set_is_disjoint_from_training(default_sets, n_pair, lpp):
    cfg, tables, ev = default_sets
    count, x, px, y, py = _objects(ev.seen_images)
    assert (count == 2).all() and ev.seen_images.shape == (15 * 14 * 45, 10)
    np.testing.assert_array_equal(ev.seen_labels, np.stack([x, y], 1))
    rank = _layout_rank(tables, x, y, px, py)
    np.testing.assert_array_equal(ev.seen_ranks, rank[:, None])

    settings = Config().replace(n_pair_labels=n_pair, layouts_per_pair=lpp).settings()
    mask = np.asarray(seen_mask(ev, settings))
    # exactly the training pairs' held-out layouts
    assert mask.sum() == n_pair * (n_pair - 1) * (45 - lpp)
    assert (x[mask] <= n_pair).all() and (y[mask] <= n_pair).all()
    assert (rank[mask] >= lpp).all()
    trainable = (x <= n_pair) & (y <= n_pair) & (rank < lpp)
    assert not (mask & trainable).any()


def test_seen_pair_set_never_sampled(default_sets):
    cfg, tables, ev = default_sets
    c = Config().replace(n_pair_labels=5, layouts_per_pair=3)
    _, images, _ = _draw(c, c.settings(), n_batches=2)
    sampled = {r.tobytes() for r in images.reshape(-1, 10).astype(np.int32)}
    mask = np.asarray(seen_mask(ev, c.settings()))
    held = {r.tobytes() for r in ev.seen_images[mask].astype(np.int32)}
    pair_labels = (ev.seen_labels <= 5).all(1)
    train_pairs = {r.tobytes() for r in ev.seen_images[~mask & pair_labels]}
    assert held and not (held & sampled)
    # and the sampler does reach (almost) every training pair image: 20 pairs x 3 layouts
    assert len(train_pairs & sampled) == len(train_pairs) == 60
    single_eval = {r.tobytes() for r in ev.single_images}
    assert not (single_eval & sampled)


def test_left_right_eval_forms():
    cfg = Config().replace(caption_mode="left_right")
    tables = build_tables(cfg.task)
    ev = build_eval_sets(cfg.task, tables)
    dec = _decoded(20)
    assert ev.unseen_true.shape == (900, 2) and ev.seen_true.shape[1] == 2
    _, x, _, y, _ = _objects(ev.unseen_images)
    for i in range(0, 900, 11):
        assert dec[ev.unseen_true[i, 1]] == f"{y[i]} is on the right of {x[i]}"
        assert dec[ev.unseen_swap[i, 1]] == f"{x[i]} is on the right of {y[i]}"
    assert (ev.seen_true != ev.seen_swap).all()


def test_line_eval_sets_are_grouped_sets_with_one_row_per_image(default_sets):
    cfg, tables, ev = default_sets
    assert isinstance(ev, GroupedEvalSets) and type(ev) is LineEvalSets
    assert LineEvalSets.GROUPS == ("all",) and metric_names(LineEvalSets) == ()
    for name in ("single", "seen", "unseen"):
        images = getattr(ev, f"{name}_images")
        np.testing.assert_array_equal(getattr(ev, f"{name}_index"), np.arange(len(images)))
        np.testing.assert_array_equal(getattr(ev, f"{name}_group"), np.zeros(len(images)))
        assert getattr(ev, f"{name}_true").shape == (len(images), 1)
    for field, value in ev._asdict().items():
        assert value.dtype == np.int32, field
