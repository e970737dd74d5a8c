"""The scenes task (`data.tasks.scenes`): config, vocabulary, sampler invariants, evaluation
sets and their counterfactual twins."""

import dataclasses
import functools

import batch_twins as bt
import jax
import numpy as np
import pytest

from jaxmech.config import Config, ConfigError
from jaxmech.data.tasks import get_task
from jaxmech.data.tasks import scenes as sc
from jaxmech.train import build_data, stack_settings

CFG = Config().replace(task_kind="scenes")
ODD = Config().replace(task_kind="scenes", grid_h=3, grid_w=5, third_frac=0.3)
B = 1024
MID = sc.TOKEN["mid"]


# ---------------------------------------------------------------------------
# an oracle: answers from the cells alone


def _cell_of(labels_BxL, label_B):
    """[B] the cell holding label_B (-1 where absent)."""
    hit = labels_BxL == label_B[:, None]
    return np.where(hit.any(1), hit.argmax(1), -1)


def _parse(batch, task):
    """(relation_B, first cell, second cell (-1: mid), single_B) read from a batch."""
    q = np.asarray(batch.question_BxQ)
    labels = np.asarray(batch.labels_BxL)
    single = q[:, 6] == MID
    first = _cell_of(labels, q[:, 1] - sc.label_token(0))
    second = np.where(single, -1, _cell_of(labels, q[:, 6] - sc.label_token(0)))
    return (q[:, 2] - sc.TOKEN["left"]) // 2, first, second, single


def _expected(batch, task):
    """Answers computed from the cell coordinates (NaN-free: asserts what it needs)."""
    rel, a, b, single = _parse(batch, task)
    assert (a >= 0).all() and ((b >= 0) | single).all(), "a named object is missing"
    W, H = task.grid_w, task.grid_h
    ca, ra, cb, rb = a % W, a // W, b % W, b // W
    pair_first = np.where(rel == 0, ca < cb, ra < rb)
    single_first = np.where(rel == 0, 2 * ca + 1 < W, 2 * ra + 1 < H)
    first = np.where(single, single_first, pair_first)
    return sc.TOKEN["left"] + 2 * rel + 1 - first


def _check_questions(batch, task):
    """Every question is well formed, defined for its objects and answered correctly."""
    q = np.asarray(batch.question_BxQ)
    rel, a, b, single = _parse(batch, task)
    W, H = task.grid_w, task.grid_h
    np.testing.assert_array_equal(np.asarray(batch.relation_B), rel)
    fixed = {0: "is", 3: "or", 5: "of", 7: "?"}
    for col, word in fixed.items():
        assert (q[:, col] == sc.TOKEN[word]).all()
    np.testing.assert_array_equal(q[:, 4], q[:, 2] + 1)
    assert np.isin(q[:, 2], [sc.TOKEN["left"], sc.TOKEN["above"]]).all()
    pair = ~single
    # defined: columns differ for left/right, rows for above/below, no middle for singles
    differ = np.where(rel == 0, a % W != b % W, a // W != b // W)
    assert differ[pair].all()
    coord, size = np.where(rel == 0, a % W, a // W), np.where(rel == 0, W, H)
    assert (2 * coord + 1 != size)[single].all()
    np.testing.assert_array_equal(np.asarray(batch.answer_B), _expected(batch, task))


def _check_scene(batch, task):
    """Attribute images agree: objects have colours and facings, background has none;
    labels are distinct within an image."""
    labels, colours, facings = (np.asarray(x) for x in batch[:3])
    obj = labels > 0
    assert ((colours > 0) == obj).all() and ((facings > 0) == obj).all()
    assert (colours <= task.n_colours).all() and (facings <= 2).all()
    ordered = np.sort(labels, axis=1)
    assert not ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] > 0)).any()


# ---------------------------------------------------------------------------
# config and vocabulary


def test_config_grid_and_errors():
    t = Config().replace(task_kind="scenes", grid_h=3, grid_w=5).task
    assert t.image_len == 15 and t.n_layouts == 105
    with pytest.raises(ConfigError, match="grid_w"):
        Config().replace(task_kind="scenes", grid_w=1)
    with pytest.raises(ConfigError, match="grid_h"):
        Config().replace(task_kind="1d", grid_h=5)
    for field, bad in (("present_frac", 1.5), ("absent_frac", -0.1)):
        with pytest.raises(ConfigError, match=field):
            Config().replace(task_kind="scenes", **{field: bad})
    with pytest.raises(ConfigError, match="task_kind"):
        sc.build_tables(Config().replace(task_kind="2d").task)
    few = Config().replace(task_kind="scenes", n_labels=6, n_val_labels=4, n_pair_labels=2)
    sc.build_tables(few.task)  # no distractor: two pair labels are enough
    with pytest.raises(ConfigError, match="third_frac"):
        sc.build_tables(few.replace(third_frac=0.5).task)
    tables = sc.build_tables(CFG.task)
    with pytest.raises(NotImplementedError, match="streaming"):
        sc.sample_batch(tables, jax.random.PRNGKey(0), CFG.settings(), CFG.task, 8, finite=True)


def test_vocabulary():
    words = ("?", "is", "left", "right", "above", "below", "yes", "no", "or", "of", "mid")
    assert sc.SCENE_WORDS == words
    assert sc.vocab_size(CFG.task) == 31
    assert sc.label_token(1) == 11 and sc.label_token(20) == 30


# ---------------------------------------------------------------------------
# training batches


@functools.partial(jax.jit, static_argnums=(3, 4))
def _sample_many(tables, keys, settings, task, batch_size):
    """Batches [K, n_keys, B, ...]: models (traced settings) x keys."""
    per_model = lambda s: jax.vmap(  # noqa: E731
        lambda k: sc.sample_batch(tables, k, s, task, batch_size)
    )(keys)
    return jax.vmap(per_model)(settings)


def _static(task):
    """Sweepable fields at other values: the sampler must read them from settings only."""
    return dataclasses.replace(task, n_pair_labels=2, layouts_per_pair=1, single_frac=0.9)


SETTINGS = [
    dict(n_pair_labels=15, layouts_per_pair=15, single_frac=0.5),
    dict(n_pair_labels=4, layouts_per_pair=3, single_frac=0.25),
    dict(n_pair_labels=2, layouts_per_pair=1, single_frac=0.0),
]


# Each task compiles its own sampler (~7 s on 2 cores). The 3 x 5 grid with distractors
# exercises all the 4 x 4 default does and more (rows != columns, a middle row and
# column that single questions avoid, third objects), so the default runs with -m slow.
@pytest.mark.parametrize(
    "cfg", [pytest.param(CFG, marks=pytest.mark.slow), ODD], ids=["4x4", "3x5_third"]
)
def test_training_batches(cfg):
    task = cfg.task
    tables = sc.build_tables(task)
    settings = stack_settings([cfg.replace(**s).settings() for s in SETTINGS])
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    out = jax.tree_util.tree_map(np.asarray, _sample_many(tables, keys, settings, _static(task), B))
    rank_of = np.argsort(tables.pair_perm, axis=-1)
    for k, s in enumerate(SETTINGS):
        batch = sc.SceneBatch(*(x[k].reshape(-1, *x.shape[3:]) for x in out))
        _check_scene(batch, task)
        _check_questions(batch, task)
        rel, a, b, single = _parse(batch, task)
        labels = batch.labels_BxL
        n_obj = (labels > 0).sum(1)
        # single_frac: exactly the first round(single_frac B) rows of every batch
        n_single = round(s["single_frac"] * B)
        assert (single.reshape(3, B)[:, :n_single]).all()
        assert not (single.reshape(3, B)[:, n_single:]).any()
        assert (n_obj[single] == 1).all()
        pair = ~single
        if not pair.any():
            continue
        # no validation label in a two-object image; the named pair within n_pair_labels
        assert (labels[pair] <= task.max_pair_labels).all()
        x, y = labels[pair, a[pair]], labels[pair, b[pair]]
        assert (x <= s["n_pair_labels"]).all() and (y <= s["n_pair_labels"]).all()
        # the pair sits at one of its training layouts (X is the row-major first cell)
        first_cell, second_cell = np.minimum(a, b)[pair], np.maximum(a, b)[pair]
        lx, ly = labels[pair, first_cell], labels[pair, second_cell]
        layout_index = {tuple(c): i for i, c in enumerate(tables.layouts.tolist())}
        lay = np.asarray([layout_index[(p, q)] for p, q in zip(first_cell, second_cell)])
        assert (rank_of[lx, ly, lay] < s["layouts_per_pair"]).all()
        # fair coins: naming order (answer not the naming order), relation, distractor
        named_first = (a < b)[pair]
        assert abs(named_first.mean() - 0.5) < 0.05
        assert abs((batch.answer_B[pair] % 2 == 0).mean() - 0.5) < 0.05
        both = tables.rel_ok[lay].all(1)  # (n_pair 2, one layout: maybe no diagonal one)
        if both.sum() > 500:
            assert abs(rel[pair][both].mean() - 0.5) < 0.06
        assert abs((n_obj[pair] == 3).mean() - task.third_frac) < 0.05
        assert ((n_obj[pair] == 2) | (n_obj[pair] == 3)).all()
        # single-object rows sit at the label's training cells
        if single.any():
            lab = labels[single, a[single]]
            assert (tables.train_pos[lab] == a[single][:, None]).any(1).all()


def test_presence_and_absent_label_questions():
    """present_frac / absent_frac: single-object questions that name a label, shown or
    not; a question about a label not in the image is answered `no`, presence `yes`
    when it is; every other row is answered as before."""
    cfg = ODD.replace(present_frac=0.3, absent_frac=0.5, single_frac=1.0)
    task = cfg.task
    tables = sc.build_tables(task)
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    out = _sample_many(tables, keys, stack_settings([cfg.settings()]), task, B)
    batch = sc.SceneBatch(*(np.asarray(x).reshape(-1, *x.shape[3:]) for x in out))
    q, labels, ans = batch.question_BxQ, batch.labels_BxL, batch.answer_B
    rel = np.asarray(batch.relation_B)
    named = q[:, 1] - sc.label_token(0)
    shown = (labels == named[:, None]).any(1)
    assert ((labels > 0).sum(1) == 1).all() and (q[:, 6] == MID).all()
    presence = rel == sc.PRESENCE
    assert abs(presence.mean() - 0.3) < 0.04
    assert (q[presence, 2] == sc.TOKEN["yes"]).all() and (q[presence, 4] == sc.TOKEN["no"]).all()
    np.testing.assert_array_equal(
        ans[presence], np.where(shown, sc.TOKEN["yes"], sc.TOKEN["no"])[presence]
    )
    assert abs(shown[presence].mean() - 0.5) < 0.06
    side = ~presence
    assert abs((~shown[side]).mean() - 0.5) < 0.05
    assert (ans[side & ~shown] == sc.TOKEN["no"]).all()
    kept = side & shown
    sub = sc.SceneBatch(*(np.asarray(x)[kept] for x in batch))
    np.testing.assert_array_equal(sub.answer_B, _expected(sub, task))
    # the defaults ask neither: no yes / no answers at all
    plain = _sample_many(tables, keys, stack_settings([ODD.settings()]), ODD.task, B)
    assert not np.isin(np.asarray(plain.answer_B), [sc.TOKEN["yes"], sc.TOKEN["no"]]).any()


# ---------------------------------------------------------------------------
# evaluation sets


@pytest.fixture(scope="module", params=[CFG, ODD], ids=["4x4", "3x5_third"])
def built(request):
    task = request.param.task
    tables = sc.build_tables(task)
    return task, tables, sc.build_eval_sets(task, tables)


def _sets(evals):
    return {name: getattr(evals, name) for name in sc.SceneEvalSets._fields}


def test_eval_sets_are_valid(built):
    task, tables, evals = built
    m = task.max_pair_labels
    for name, s in _sets(evals).items():
        assert 0 < len(s.rank_N) <= task.eval_size, name
        for twin in (s.examples, *(getattr(s, t) for t in sc.TWINS)):
            _check_scene(twin, task)
            _check_questions(twin, task)  # twins' own answers follow their geometry
        labels = s.examples.labels_BxL
        rel, a, b, single = _parse(s.examples, task)
        assert single.all() == (name == "single") and single.any() == (name == "single")
        if name == "single":  # each label alone at one of its held-out cells
            lab = labels[np.arange(len(a)), a]
            assert (tables.holdout_pos[lab] == a[:, None]).any(1).all()
            continue
        x, y = labels[np.arange(len(a)), a], labels[np.arange(len(b)), b]
        third = np.where(labels > 0, labels, 0).sum(1) - x - y
        if name == "unseen_pair":
            assert ((x > m) & (y > m)).all(), "unseen pairs use validation labels only"
        else:
            assert ((x <= m) & (y <= m)).all()
        assert (third <= m).all(), "distractors are non-validation labels"
        assert abs((third > 0).mean() - task.third_frac) < 0.1
        # both relations and both naming orders
        assert 0.3 < rel.mean() < 0.7 and 0.3 < (a < b).mean() < 0.7


@pytest.mark.parametrize("n_pair, lpp", [(15, 15), (4, 3), (15, 1), (2, 60)])
def test_masks_select_held_out_and_training_layouts(built, n_pair, lpp):
    task, tables, evals = built
    settings = CFG.replace(n_pair_labels=n_pair, layouts_per_pair=lpp).settings()
    masks = {k: np.asarray(v) for k, v in sc.eval_masks(evals, settings).items()}
    layout_index = {tuple(c): i for i, c in enumerate(tables.layouts.tolist())}
    for name, trained in (("seen_pair", False), ("train_pair", True)):
        s = getattr(evals, name)
        _, a, b, _ = _parse(s.examples, task)
        labels = s.examples.labels_BxL
        rows = np.arange(len(a))
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        lx, ly = labels[rows, lo], labels[rows, hi]
        lay = np.asarray([layout_index[(p, q)] for p, q in zip(lo, hi)])
        in_training = (tables.pair_perm[lx, ly, :lpp] == lay[:, None]).any(1)
        pair_trained = (lx <= n_pair) & (ly <= n_pair)
        np.testing.assert_array_equal(masks[name], pair_trained & (in_training == trained))
    assert masks["unseen_pair"].all() and masks["single"].all()
    if (n_pair, lpp) == (15, 15):  # the rank weighting keeps most rows at the defaults
        assert masks["seen_pair"].mean() > 0.9 and masks["train_pair"].mean() > 0.4


def test_twins(built):
    task, _, evals = built
    for name, s in _sets(evals).items():
        ex = s.examples
        h = ex.relation_B == 0
        np.testing.assert_array_equal(s.mirror.answer_B[h], 5 - ex.answer_B[h])  # left <-> right
        np.testing.assert_array_equal(s.mirror.answer_B[~h], ex.answer_B[~h])
        for twin in sc.TWINS:  # same questions
            np.testing.assert_array_equal(getattr(s, twin).question_BxQ, ex.question_BxQ)
        # the stored twins (spec transforms, rendered) equal the batch reference's
        for got, want in [
            (s.mirror, bt.mirror(ex, task)),
            (s.mirror_pos, bt.mirror_pos(ex, task)),
            (s.flip_facing, bt.flip_facing(ex)),
            (s.mirror, bt.flip_facing(bt.mirror_pos(ex, task))),
            (ex, bt.mirror(bt.mirror(ex, task), task)),
        ]:
            for u, v in zip(got, want):
                np.testing.assert_array_equal(u, v)
        # the mirror moves objects (some column changes) and flips every facing
        assert (s.mirror.labels_BxL != ex.labels_BxL).any()
        obj = ex.labels_BxL > 0
        assert (s.flip_facing.facings_BxL[obj] != ex.facings_BxL[obj]).all()
        np.testing.assert_array_equal(s.mirror_pos.answer_B, s.mirror.answer_B)
        np.testing.assert_array_equal(s.flip_facing.answer_B, ex.answer_B)
        # recolour: same layout, labels, facings and answers; every object another colour
        rc = s.recolour
        for field in ("labels_BxL", "facings_BxL", "answer_B", "relation_B"):
            np.testing.assert_array_equal(getattr(rc, field), getattr(ex, field), name)
        assert (rc.colours_BxL[obj] != ex.colours_BxL[obj]).all()
        assert (rc.colours_BxL[~obj] == 0).all()


def test_eval_sets_deterministic_in_data_seed(built):
    task, tables, evals = built
    again = sc.build_eval_sets(task, sc.build_tables(task))
    for u, v in zip(jax.tree_util.tree_leaves(evals), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(u, v)
    other = dataclasses.replace(task, data_seed=task.data_seed + 1)
    moved = sc.build_eval_sets(other, sc.build_tables(other))
    assert not np.array_equal(
        moved.seen_pair.examples.labels_BxL, evals.seen_pair.examples.labels_BxL
    )


def test_build_data_for_scenes():
    cfg = CFG.replace(third_frac=0.2, eval_size=64)
    assert get_task("scenes").name == "scenes"
    data = build_data(cfg)
    assert isinstance(data.tables, sc.SceneTables)
    assert isinstance(data.evals, sc.SceneEvalSets)
    assert len(data.evals.seen_pair.rank_N) == 64 and len(data.evals.single.rank_N) == 64
    text = sc.describe(data.evals.seen_pair.examples, cfg.task)
    assert text.count("\n") == cfg.task.grid_h and "?" in text
