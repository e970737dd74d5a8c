"""The three-object task: config, sampler invariants, evaluation sets, training."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmech.analysis.decompose import decompose, part_terms
from jaxmech.config import Config, ConfigError, Settings
from jaxmech.data.tasks import relations1d as r1
from jaxmech.data.tasks import relations3 as r3
from jaxmech.data.tasks import task_vocab
from jaxmech.data.tasks.grouped import seen_mask
from jaxmech.data.tasks.vocab import Vocab
from jaxmech.families.dual_encoder.evaluate import METRICS
from jaxmech.families.dual_encoder.model import init_params
from jaxmech.train import build_data, stack_settings, train_models

CFG = Config().replace(task_kind="three")
B = 2048

TINY = Config().replace(
    task_kind="three",
    image_len=6,
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
    return r3.sample_batch(tables, key, settings, task, batch_size)


def _static(task):
    return dataclasses.replace(task, n_pair_labels=15, layouts_per_pair=15, single_frac=0.5)


def _draw(cfg, n_batches=2, seed=0):
    tables = r3.build_tables(cfg.task)
    keys = jax.random.split(jax.random.PRNGKey(seed), n_batches)
    out = [_sample(tables, k, cfg.settings(), _static(cfg.task), B) for k in keys]
    return tables, np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


DEC = [Vocab(20).decode(row) for row in r1.caption_tokens(20)]


def _holds(caption: str, img) -> bool:
    """Whether a decoded 1D caption is true of the image."""
    pos = {int(img[p]): int(p) for p in np.flatnonzero(img)}
    s = caption.split()
    if len(s) == 7:
        a, b = pos[int(s[0])], pos[int(s[6])]
        return a < b if s[4] == "left" else a > b
    if len(s) == 5:
        return (2 * pos[int(s[0])] < len(img)) == (s[4] == "left")
    return len(s) == 1 and int(s[0]) in pos


def test_config_and_vocab():
    assert task_vocab(CFG.task) == Vocab(20)  # 1D captions and vocabulary
    with pytest.raises(ConfigError, match="n_pair_labels"):
        Config().replace(task_kind="three", n_pair_labels=2)
    with pytest.raises(ConfigError, match="n_val_labels"):
        Config().replace(task_kind="three", n_val_labels=2)
    with pytest.raises(ConfigError, match="epochs"):
        Config().replace(task_kind="three", epochs=2)
    assert Config.from_json(CFG.to_json()) == CFG
    np.testing.assert_array_equal(
        r3.build_tables(CFG.task).pair_perm, r1.build_tables(Config().task).pair_perm
    )


@pytest.mark.parametrize(
    "overrides",
    [{}, {"n_pair_labels": 3, "layouts_per_pair": 2, "caption_mode": "left_right"}],
    ids=["default", "npair3_lpp2_left_right"],
)
def test_training_batches_respect_the_task(overrides):
    cfg = CFG.replace(**overrides)
    n_pair, lpp = cfg.task.n_pair_labels, cfg.task.layouts_per_pair
    tables, images, caps = _draw(cfg)
    count = (images != 0).sum(-1)
    n_single = round(0.5 * B)
    assert (count[:, :n_single] == 1).all() and (count[:, n_single:] == 3).all()
    images, caps = images.reshape(-1, 10), caps.reshape(-1)
    rank_of = np.argsort(tables.pair_perm, axis=-1)
    lay_index = {tuple(lay): i for i, lay in enumerate(tables.layouts.tolist())}
    z_places = np.zeros(3, int)
    for img, c in zip(images, caps):
        s = DEC[c]
        assert _holds(s, img), (img, s)
        if np.count_nonzero(img) == 1:
            (p,) = np.flatnonzero(img)
            assert p not in tables.holdout_pos[img[p]]  # held-out positions never train
            continue
        words = s.split()
        assert len(words) == 7
        a, b = int(words[0]), int(words[6])
        x, y = (a, b) if words[4] == "left" else (b, a)  # x is the left named object
        pos = {int(img[p]): int(p) for p in np.flatnonzero(img)}
        assert len(pos) == 3 and max(pos) <= n_pair  # three distinct pair labels
        assert rank_of[x, y, lay_index[(pos[x], pos[y])]] < lpp  # named pair: training layout
        (z,) = set(pos) - {x, y}
        z_places[0 if pos[z] < pos[x] else 1 if pos[z] < pos[y] else 2] += 1
    assert (z_places > 0).all()  # the distractor is left of, between and right of the pair


def test_vmap_over_settings_equals_per_setting_calls():
    tables = r3.build_tables(CFG.task)
    per = [
        CFG.replace(n_pair_labels=npl, layouts_per_pair=lpp, single_frac=sf).settings()
        for npl, lpp, sf in [(15, 15, 0.5), (3, 3, 0.25), (9, 45, 0.75)]
    ]
    stacked = Settings(*(jnp.asarray([getattr(p, f) for p in per]) for f in Settings._fields))
    key = jax.random.PRNGKey(5)
    task = _static(CFG.task)
    vm = jax.jit(jax.vmap(lambda s: r3.sample_batch(tables, key, s, task, 256)))(stacked)
    for i, s in enumerate(per):
        one = _sample(tables, key, s, task, 256)
        np.testing.assert_array_equal(vm[0][i], one[0])
        np.testing.assert_array_equal(vm[1][i], one[1])
    assert np.asarray(vm[0][1])[64:].max() <= 3  # n_pair 3: pair rows use labels 1..3


@pytest.fixture(scope="module")
def sets():
    tables = r3.build_tables(CFG.task)
    return tables, r3.build_eval_sets(CFG.task, tables)


def test_eval_sets(sets):
    tables, ev = sets
    for name, step in (("single", 1), ("seen", 7), ("unseen", 31)):
        images = getattr(ev, f"{name}_images")[getattr(ev, f"{name}_index")]
        true, swap = getattr(ev, f"{name}_true"), getattr(ev, f"{name}_swap")
        for i in range(0, len(images), step):
            assert _holds(DEC[true[i, 0]], images[i]) and not _holds(DEC[swap[i, 0]], images[i])
    # unseen triples: 5 * 4 * 3 ordered triples of validation labels x 45 layouts x 8 pixels
    # (each image three times: once per named pair; the distractor is the third object)
    assert len(ev.unseen_index) == 60 * 45 * 8 and len(ev.unseen_images) == 60 * 45 * 8 // 3
    assert np.bincount(ev.unseen_index).tolist() == [3] * len(ev.unseen_images)
    assert set(np.unique(ev.unseen_images[ev.unseen_images > 0])) == set(range(16, 21))
    assert ((ev.unseen_images > 0).sum(1) == 3).all()
    assert len(set(map(bytes, ev.unseen_images))) == len(ev.unseen_images)
    assert (np.bincount(ev.unseen_group) > 0).all()
    # group = where the distractor sits relative to the named pair
    for i in range(0, len(ev.unseen_index), 101):
        img = ev.unseen_images[ev.unseen_index[i]]
        w = DEC[ev.unseen_true[i, 0]].split()
        pos = {int(img[p]): int(p) for p in np.flatnonzero(img)}
        x, y = int(w[0]), int(w[6])
        (z,) = set(pos) - {x, y}
        assert ev.unseen_group[i] == (0 if pos[z] < pos[x] else 1 if pos[z] < pos[y] else 2)
        absent = {int(t) for t in DEC[ev.labelset_false[i]].split() if t.isdigit()} - set(pos)
        assert len(absent) == 1
    for img in ev.single_images:
        (p,) = np.flatnonzero(img)
        assert p in tables.holdout_pos[img[p]]


@pytest.mark.parametrize("n_pair,lpp", [(15, 15), (4, 3)])
def test_seen_set_images_are_never_training_images(sets, n_pair, lpp):
    tables, ev = sets
    cfg = CFG.replace(n_pair_labels=n_pair, layouts_per_pair=lpp)
    mask = np.asarray(seen_mask(ev, cfg.settings()))
    assert mask.sum() > 0 and ev.seen_labels[mask].max() <= n_pair
    # a training image has some two of its objects (left one first) at a training
    # layout of that pair; a seen-set image of this model has none
    rank_of = np.argsort(tables.pair_perm, axis=-1)
    lay_index = -np.ones((10, 10), int)
    lay_index[tables.layouts[:, 0], tables.layouts[:, 1]] = np.arange(45)
    for img in ev.seen_images[mask][::5]:
        p = np.flatnonzero(img)
        ranks = [
            rank_of[img[p[a]], img[p[b]], lay_index[p[a], p[b]]]
            for a, b in ((0, 1), (0, 2), (1, 2))
        ]
        assert min(ranks) >= lpp
    _, images, _ = _draw(cfg)
    sampled = {r.tobytes() for r in images.reshape(-1, 10).astype(np.int32)}
    held = {r.tobytes() for r in ev.seen_images[mask]}
    assert not (held & sampled)


@pytest.mark.slow  # trains a tiny model end to end (~1.5 min); `pytest -m slow`
def test_tiny_three_training_and_decomposition():
    data = build_data(TINY)
    s = stack_settings([TINY.replace(seed=i).settings() for i in range(2)])
    state, curves = train_models(TINY, s, data=data)
    for m in METRICS + ("unseen_zl_acc", "unseen_zm_acc", "unseen_zr_acc", "seen_zm_acc"):
        assert np.isfinite(curves[m]).all(), m
    assert (curves["loss"][:, -1] < curves["loss"][:, 0]).all()
    params = jax.jit(init_params, static_argnums=0)(TINY, jax.random.PRNGKey(0))
    t = decompose(params, jnp.asarray(data.evals.unseen_images[:5]))
    np.testing.assert_allclose(sum(t[k] for k in part_terms(t)), t["logits"], rtol=1e-4, atol=1e-5)


def test_loss_positives_are_the_captions_true_of_each_image():
    tables = r3.build_tables(CFG.task)
    images, caps = _sample(tables, jax.random.PRNGKey(2), CFG.settings(), CFG.task, 256)
    pos = np.asarray(r3.positives(images, caps, CFG.task))
    images, caps = np.asarray(images), np.asarray(caps)
    for i in range(0, 256, 5):
        for j in range(256):
            words = DEC[caps[j]].split()
            if len(words) == 7:  # pair captions: true of the image (named labels in order)
                present = {int(w) for w in (words[0], words[6])} <= set(images[i].tolist())
                want = present and _holds(DEC[caps[j]], images[i])
            else:  # single-object captions: identical captions only
                want = caps[i] == caps[j]
            assert pos[i, j] == want, (images[i], DEC[caps[j]])
    assert pos.diagonal().all()
    assert (pos.sum(1) > 1)[128:].mean() > 0.5  # other samples' captions often true


def test_clip_loss_with_identical_caption_positives_is_the_plain_loss():
    from jaxmech.families.dual_encoder.loss import clip_loss

    data = build_data(TINY)
    params = jax.jit(init_params, static_argnums=0)(TINY, jax.random.PRNGKey(1))
    # sharper logits (the static switches in params['static'] are flags, not scaled)
    params = {
        k: v if k == "static" else jax.tree_util.tree_map(lambda x: x * 5.0, v)
        for k, v in params.items()
    }
    images, caps = _sample(data.tables, jax.random.PRNGKey(0), TINY.settings(), TINY.task, 32)
    same = caps[:, None] == caps[None, :]
    clip_loss = jax.jit(clip_loss)  # eager, the forward's many small ops compile one by one
    plain = clip_loss(params, images, caps, data.tables.captions)
    np.testing.assert_allclose(
        clip_loss(params, images, caps, data.tables.captions, same), plain, rtol=1e-6
    )
    truth = r3.positives(images, caps, TINY.task)
    assert (np.asarray(truth) != np.asarray(same)).any()
    assert not np.isclose(clip_loss(params, images, caps, data.tables.captions, truth), plain)
