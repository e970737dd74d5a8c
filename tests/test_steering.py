"""Steering with spatial IDs (`analysis.steering`, `reports.steering`)
and the small statistics it and the diagnostics use."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_vlm_config

from jaxmech.analysis import steering as st
from jaxmech.data.tasks import scenes as sc
from jaxmech.families.toy_vlm import model as toy_vlm
from jaxmech.families.toy_vlm.view import toy_view
from jaxmech.families.vlm_view import examples
from jaxmech.models.edits import Edits
from jaxmech.reports import steering as report
from jaxmech.stats import correlation_ci, mann_whitney_u


@pytest.fixture(scope="module")
def model_and_set():
    config = tiny_vlm_config(lm_n_layers=2)
    params = toy_vlm.init_params(config, jax.random.PRNGKey(5))
    s = sc.build_eval_sets(config.task, sc.build_tables(config.task)).unseen_pair
    view = toy_view(config)
    return config, params, view, examples(view, sc.eval_specs(config.task, s)["examples"])


def test_steering_with_a_zero_vector_is_a_no_op(model_and_set):
    config, params, view, ex = model_and_set
    B, D = ex.answer_B.shape[0], config.model.d_model
    plain, _ = view.forward(params, ex.inputs)
    steered = st.steered_logits(view, params, ex.inputs, ex.spans, 1, jnp.zeros((B, D)))
    np.testing.assert_array_equal(steered, plain)  # eager: x + 0 is x
    # and alpha 0 leaves every margin, the ID's and the controls', at the plain one
    delta = jax.random.normal(jax.random.PRNGKey(0), (view.grid.cells, D))
    cells = jnp.asarray(ex.spec.cells_BxK[:, 0])
    run = lambda p, d, c, a, k: st.flip_margins(view, p, ex, 1, d, c, (c + 1) % 9, a, k)  # noqa: E731
    out = jax.jit(run)(params, delta, cells, jnp.asarray([0.0, 1.0]), jax.random.PRNGKey(1))
    for kind in st.KINDS:
        np.testing.assert_allclose(out[kind][0], out["plain"], atol=1e-5)
        assert np.abs(np.asarray(out[kind][1] - out["plain"])).max() > 1e-4  # alpha 1 moves
    assert float(jnp.abs(out["rel_norm"][0]).max()) == 0.0


def test_the_vector_lands_on_the_object_word_only(model_and_set):
    config, params, view, ex = model_and_set
    B, D = ex.answer_B.shape[0], config.model.d_model
    v = jax.random.normal(jax.random.PRNGKey(2), (B, D))
    added = st.at_word(v, ex.spans.x_B, ex.spans.length)
    assert added.shape == (B, 9 + sc.Q_LEN, D)
    np.testing.assert_array_equal(added[:, 9 + sc.X_SLOT], v)
    assert float(jnp.abs(added).sum()) == pytest.approx(float(jnp.abs(v).sum()), rel=1e-6)
    # at the site, the edited residual is the plain one plus v at X's word
    _, aux = view.forward(params, ex.inputs, capture=True)
    edits = Edits(add={"lm/resid_pre.1": added})
    _, aux_steered = view.forward(params, ex.inputs, edits, capture=True)
    np.testing.assert_allclose(
        aux_steered["lm/resid_pre.1"], aux["lm/resid_pre.1"] + added, atol=1e-6
    )


def test_the_controls_match_norms_and_the_orthogonal_one_avoids_the_id_span():
    rng = np.random.default_rng(0)
    D, L = 12, 9
    delta = jnp.asarray(rng.normal(size=(L, 3)) @ rng.normal(size=(3, D)))  # rank 3
    P = st.id_span_projector(delta, energy=0.999)
    np.testing.assert_allclose(P @ P, P, atol=1e-5)
    np.testing.assert_allclose(P, P.T, atol=1e-6)
    np.testing.assert_allclose(delta @ P, delta, atol=1e-4)  # the ID lies in the span
    assert float(jnp.trace(P)) == pytest.approx(3.0, abs=1e-4)
    like = jnp.asarray(rng.normal(size=(50, D)))
    for proj in (None, P):
        z = st.matched_noise(jax.random.PRNGKey(0), like, proj)
        np.testing.assert_allclose(
            jnp.linalg.norm(z, axis=-1), jnp.linalg.norm(like, axis=-1), rtol=1e-5
        )
    orth = st.matched_noise(jax.random.PRNGKey(0), like, P)
    assert float(jnp.abs(orth @ delta.T).max()) < 1e-3 * float(jnp.abs(like @ delta.T).max())


def test_adversarial_targets_cross_to_the_far_edge_beyond_y():
    # 4 x 4 grid; cells row-major: (row, col) -> 4 row + col
    cells = np.array([[5, 7, -1], [14, 3, -1], [6, 4, -1], [1, 13, -1]])
    relation = np.array([0, 1, 0, 1])
    got = st.adversarial_targets(cells, relation, 4, 4)
    # X (1,1) left of Y (1,3): to (1,3); X (3,2) below Y (0,3): to row 0, col 2;
    # X (1,2) right of Y (1,0): to (1,0); X (0,1) above Y (3,1): to row 3, col 1
    assert got.tolist() == [7, 2, 4, 13]


def test_flip_rates_count_flips_among_answers_right_before():
    plain = np.array([[[1.0, 1.0, -1.0, 2.0]]])  # [K=1, Y'=1, B=4]
    res = {
        "relation": np.array([0, 0, 0, 1]),
        "flips": {
            "plain": plain,
            "id": np.array([[[[-1.0, 1.0, -2.0, -1.0]]]]),  # [K, Y', A=1, B]
            "noise": np.array([[[[1.0, 1.0, -2.0, 1.0]]]]),
            "orthogonal": np.array([[[[1.0, -1.0, 1.0, 1.0]]]]),
            "rel_norm": np.array([[[[0.5, 1.5, 9.0, 2.0]]]]),
        },
    }
    fr = st.flip_rates(res)
    assert fr[("n", "horizontal")].tolist() == [[2]] and fr[("n", "vertical")].tolist() == [[1]]
    assert fr[("id", "horizontal")][0, 0, 0] == 0.5 and fr[("id", "vertical")][0, 0, 0] == 1.0
    assert fr[("noise", "horizontal")][0, 0, 0] == 0.0
    assert fr[("orthogonal", "horizontal")][0, 0, 0] == 0.5
    assert fr[("rel_norm", "horizontal")][0, 0, 0] == 1.0  # the wrong example is left out


def test_the_authors_protocol_arithmetic_on_hand_made_numbers():
    """5 x the token's norm along the unit ID difference; a flip is any sign change over
    all examples (a wrong answer turned right counts); the top-3-site mean reads the
    controls at the ID's best sites."""
    delta = jnp.asarray([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])  # [L=3, D=2]
    v = st.authors_vectors(
        delta, jnp.asarray([0, 2]), jnp.asarray([1, 0]), jnp.asarray([2.0, 1.0]), 5.0
    )
    np.testing.assert_allclose(
        v, [[6.0, 8.0], [0.0, -5.0]], atol=1e-6
    )  # 10 x (0.6, 0.8); 5 x (0, -1)
    res = {
        "relation": np.array([0, 0, 0, 1]),
        "authors": {  # [K=1, Y'=4, B=4]
            "plain": np.tile([[1.0, -1.0, 2.0, 1.0]], (1, 4, 1)),
            "id": np.array([[[-1.0, 1.0, 2.0, 1.0], [-1.0, -1.0, 2.0, 1.0], [1.0, -1.0, 2.0, 1.0], [-1.0, 1.0, -2.0, -1.0]]]),
            "noise": np.array([[[1.0, -1.0, 2.0, 1.0], [1.0, 1.0, 2.0, 1.0], [-1.0, 1.0, -2.0, 1.0], [1.0, -1.0, 2.0, 1.0]]]),
            "orthogonal": np.tile([[1.0, -1.0, 2.0, 1.0]], (1, 4, 1)),
        },
    }  # fmt: skip
    ar = st.authors_flip_rates(res)
    np.testing.assert_allclose(ar[("id", "horizontal")], [[2 / 3, 1 / 3, 0.0, 1.0]])
    np.testing.assert_allclose(ar[("noise", "horizontal")], [[0.0, 1 / 3, 1.0, 0.0]])
    top = ar[("top", "horizontal")]  # the best 3 ID sites: 3, 0, 1
    np.testing.assert_allclose(
        [top["id"][0], top["noise"][0], top["orthogonal"][0]], [2 / 3, 1 / 9, 0.0]
    )
    assert ar[("id", "vertical")][0].tolist() == [0.0, 0.0, 0.0, 1.0]


def test_the_authors_steering_is_a_no_op_at_scale_zero_and_acts_at_five(model_and_set):
    """Scale 0 adds zeros to both words (a no-op); 5 x their norms changes the margins."""
    config, params, view, ex = model_and_set
    delta = jax.random.normal(jax.random.PRNGKey(0), (config.task.image_len, config.model.d_model))
    src = jnp.asarray(ex.spec.cells_BxK)[:, 0]
    tgt = (src + 1) % config.task.image_len
    run = jax.jit(
        lambda s: st.authors_margins(view, params, ex, 1, delta, src, tgt, s, jax.random.PRNGKey(1))
    )
    zero, five = run(0.0), run(5.0)
    np.testing.assert_allclose(zero["id"], zero["plain"], atol=1e-5)
    assert np.abs(np.asarray(five["id"] - five["plain"])).max() > 1e-3


def test_steering_refuses_a_one_block_lm(tmp_path):
    config = tiny_vlm_config()
    assert "lm_n_layers" in report.steering_refusal(config, "RUN")
    assert report.steering_refusal(tiny_vlm_config(lm_n_layers=2), "RUN") is None


def test_the_authors_steering_window_is_found_by_model_type_and_lm_size(tmp_path):
    """Under the authors' protocol without --layers, a checkpoint is steered at their
    window for the model (`adversarial_steering.sh`: qwen2-2b 6:16, llava-7b 8:20),
    identified by config.json's model_type and its LM's blocks and width whatever the
    folder's name (a LLaVA text config that leaves them out: Llama's 32 x 4096); a
    model not in their table keeps every site, said in the log."""
    import json
    import os

    here = os.path.join(os.path.dirname(__file__), "fixtures")
    qwen = json.load(open(os.path.join(here, "qwen2_vl", "qwen2_vl", "config.json")))
    qwen.update(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})  # fmt: skip
    qwen["vision_config"]["hidden_size"] = 1536  # Qwen2-VL-2B-Instruct's sizes
    llava = json.load(open(os.path.join(here, "llava", "llava", "config.json")))
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads"):  # fmt: skip
        llava["text_config"].pop(k)  # llava-1.5-7b-hf's config.json names none of them
    lines, sites = [], list(range(1, 28))
    for name, config, want in (("renamed", qwen, range(6, 17)), ("my_llava", llava, range(8, 21))):
        os.makedirs(tmp_path / name)
        json.dump(config, open(tmp_path / name / "config.json", "w"))
        identity = report.checkpoint_identity(str(tmp_path / name))
        assert report.authors_sites(sites, identity, lines.append) == list(want)
    assert "qwen2-2b (Qwen/Qwen2-VL-2B-Instruct): layers 6:16" in lines[0]
    assert "llava-7b" in lines[1]
    tiny = report.checkpoint_identity(os.path.join(here, "qwen2_vl", "qwen2_vl"))
    assert tiny == ("qwen2_vl", 2, 32)
    assert report.authors_sites([1], tiny, lines.append) == [1]
    assert "none for model_type 'qwen2_vl' with 2 LM blocks of width 32" in lines[2]
    from jaxmech.reports.checkpoints import open_checkpoint  # the report's own lookup

    for protocol, layers, said in (
        ("authors", None, 1),
        ("authors", (1,), 0),
        ("jaxmech", None, 0),
    ):
        run = open_checkpoint(os.path.join(here, "qwen2_vl", "qwen2_vl"), grid=(2, 2), size=112,
                              layers=layers, protocol=protocol, log=lambda *_: None)  # fmt: skip
        lines = []
        assert report.steering_sites(run, lines.append) == [1] and len(lines) == said


def test_the_authors_steering_asks_questions_without_boxes():
    """The authors' corner steering reads no box: under their protocol every question of
    a photograph batch is steered (the CV-Bench sample's: 3 with both boxes, 2 without),
    `boxed` marking the ones the box-based tables may read; jaxmech's keeps the boxed
    ones only."""
    import os

    from jaxmech.reports.checkpoints import open_checkpoint

    here = os.path.join(os.path.dirname(__file__), "fixtures")
    for protocol, kept in (("authors", 5), ("jaxmech", 3)):
        run = open_checkpoint(os.path.join(here, "qwen2_vl", "qwen2_vl"), grid=(2, 2),
                              size=112, batch=4, layers=(1,), protocol=protocol,
                              questions_from="cvbench",
                              data=os.path.join(here, "datasets", "cvbench"),
                              log=lambda *_: None)  # fmt: skip
        got = [report.steered_questions(run, b, protocol)
               for b in run.subject.question_batches(run, (0, 1))]  # fmt: skip
        assert sum(len(ex.answer_B) for ex, *_ in got) == kept
        assert sum(boxed.sum() for *_, boxed in got) == 3
        for ex, source, target, boxed in got:
            assert len(source) == len(target) == len(boxed) == len(ex.answer_B)
            assert (source[~boxed] == 0).all() and (target[~boxed] == 0).all()
    # drawn scenes under the authors' protocol: every cell known, as jaxmech steers them
    run = open_checkpoint(os.path.join(here, "qwen2_vl", "qwen2_vl"), grid=(2, 2), size=112,
                          questions=4, batch=4, layers=(1,), protocol="authors",
                          log=lambda *_: None)  # fmt: skip
    (batch,) = run.subject.question_batches(run, (0, 1))
    ex, source, target, boxed = report.steered_questions(run, batch, "authors")
    ex_j, source_j, target_j = report.steering_examples(run, batch)
    assert boxed.all() and len(ex.answer_B) == len(ex_j.answer_B) == 8
    np.testing.assert_array_equal(source, source_j)
    np.testing.assert_array_equal(target, target_j)


def test_the_authors_protocol_generates_replies_on_qwen_and_internvl():
    """The authors' steering reads generated replies (`report.generates`) on a
    Qwen2-VL and an InternVL checkpoint as on LLaVA: their views offer `generate`;
    jaxmech's protocol keeps the top next token."""
    from jaxmech.reports.checkpoints import open_checkpoint

    here = os.path.join(os.path.dirname(__file__), "fixtures")
    for folder, size in (("qwen2_vl/qwen2_vl", 112), ("internvl/internvl", None)):
        for protocol in ("authors", "jaxmech"):
            run = open_checkpoint(os.path.join(here, folder), grid=(2, 2), size=size,
                                  questions=2, layers=(1,), protocol=protocol,
                                  log=lambda *_: None)  # fmt: skip
            assert report.generates(run) == (protocol == "authors"), (folder, protocol)


@pytest.mark.slow
def test_the_authors_steering_report_judges_qwen_replies(tmp_path):
    """`--protocol=authors --max_new_tokens=2` on the Qwen2-VL fixture (drawn scenes)
    runs the reply path: the answer read is a greedy reply, each question's control
    verdict is their verdict (`judge_reply`) on the view's own greedy reply to it, and
    a flip is a verdict change. Slow: the whole report (~2 min on 2 busy cores)."""
    from jaxmech.data.spec import first_word
    from jaxmech.models.generate import judge_reply, sequences
    from jaxmech.reports.checkpoints import open_checkpoint
    from jaxmech.reports.driver import analyse_subject

    folder = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
    run = open_checkpoint(folder, grid=(2, 2), size=112, questions=4, batch=4, layers=(1,),
                          protocol="authors", log=lambda *_: None)  # fmt: skip
    res = analyse_subject(report.report(max_new_tokens=2), run, str(tmp_path),
                          log=lambda *_: None)["res"]  # fmt: skip
    assert res["answer_read"].startswith("a greedy reply of 2 tokens")
    verdicts = np.asarray(res["authors"]["verdict"])[0]  # [1 + sites, B]
    np.testing.assert_array_equal(res["authors"]["reply_flip"][0], verdicts[1:] != verdicts[:1])
    (batch,) = run.subject.question_batches(run, (0, 1))
    ex = report.steered_questions(run, batch, "authors")[0]
    params = jax.tree_util.tree_map(lambda x: x[0], run.params)
    g = batch.view.generate(params, ex.inputs, max_new_tokens=2)
    tok = report.checkpoint_tokenizer(run)
    words = {0: ("left", "right"), 1: ("above", "below")}
    first = np.asarray(first_word(batch.view.grid, ex.spec))
    want = [judge_reply(tok, q, *(words[int(r)] if f else words[int(r)][::-1]))
            for q, r, f in zip(sequences(ex, g), ex.spec.relation_B, first)]  # fmt: skip
    assert verdicts[0].tolist() == want


def test_occurrence_norms_stack_every_read_occurrence():
    """`occurrence_norms`: the norm of the word's states stacked over every read row
    whose token is the word's (their `.norm(p=2)` of [occurrences, D]); one occurrence:
    its state's norm."""
    rng = np.random.default_rng(0)
    resid = rng.normal(size=(2, 6, 3)).astype(np.float32)
    tokens = np.array([[4, 7, 4, 9, 4, 4], [1, 2, 3, 5, 6, 8]])
    read = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], bool)
    got = report.occurrence_norms(resid, tokens, read, np.array([0, 2]))
    want0 = np.sqrt(sum(np.sum(resid[0, t] ** 2) for t in (0, 2, 4)))  # row 5 not read
    np.testing.assert_allclose(got, [want0, np.linalg.norm(resid[1, 2])], rtol=1e-6)


def test_the_authors_norm_counts_the_word_in_the_reply():
    """`reply_norms` (the authors' steering norm, `adversarial_steering.py` 126-133) on
    the Qwen2-VL fixture: a reply without X's token gives each word's prompt state's
    norm (`unsteered`'s); X's token fed back in the reply adds its state there
    (norm^2 grows by that row's |h|^2); the reply's last token (never fed back) and the
    tokens after a row's end add nothing."""
    from jaxmech.data.spec import Grid, pair_questions
    from jaxmech.families import load_checkpoint
    from jaxmech.families.qwen2_vl.view import checkpoint_view
    from jaxmech.families.vlm_view import rows_at
    from jaxmech.models.generate import Generation

    folder = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
    _, config, params = load_checkpoint(folder)
    view = checkpoint_view(folder, config, Grid(2, 2), 112, wording="authors")
    specs = pair_questions(view.grid, 2, 6, view.n_colours, seed=1)["examples"]  # known words
    ex = examples(view, specs)
    B, sites = len(ex.answer_B), (1,)
    tokens = np.asarray(ex.inputs.tokens_BxS)
    x_tok = tokens[np.arange(B), np.asarray(ex.spans.x_B)]
    assert ((tokens == x_tok[:, None]).sum(1) == 1).all()  # X's token once in each prompt
    clean = jax.jit(lambda p: st.unsteered(view, p, ex)[1]["lm/resid_pre.1"])(params)
    prompt = [np.linalg.norm(rows_at(clean, w), axis=-1) for w in (ex.spans.x_B, ex.spans.y_B)]
    other = np.full((B, 3), 0, np.int32)  # token 0: not an object word here
    assert not np.isin(0, np.concatenate([x_tok, tokens[np.arange(B), ex.spans.y_B]]))
    states = report.reply_states(view, sites)  # compiled once for the three calls below
    plain = report.reply_norms(states, params, ex, Generation(other, np.full(B, 3), None))
    for got, want in zip(plain[1], prompt):
        np.testing.assert_allclose(got, want, rtol=1e-4)
    with_x = np.stack([x_tok, other[:, 0], x_tok], 1)  # X fed back once: the last never is
    got = report.reply_norms(states, params, ex, Generation(with_x, np.full(B, 3), None))
    h = states(params, ex.inputs, with_x[:, :2])[1]  # the state of X fed back
    extra = np.sum(np.asarray(h)[:, -2] ** 2, -1)
    np.testing.assert_allclose(got[1][0] ** 2, prompt[0] ** 2 + extra, rtol=1e-4)
    np.testing.assert_allclose(got[1][1], prompt[1], rtol=1e-4)
    ended = report.reply_norms(states, params, ex, Generation(with_x, np.full(B, 1), None))
    np.testing.assert_allclose(ended[1][0], prompt[0], rtol=1e-4)  # stopped at its first


def test_the_authors_rate_pools_both_relations_as_theirs():
    """Their `fig2.ipynb` counts every row of the file in one rate: the pooled rate is
    each example's own relation's flip over every counted example, and the top sites
    are chosen on it."""
    nan = np.nan
    f_h = np.array([[[1, 0, nan, nan], [0, 0, nan, nan]]])  # [K=1, Y'=2, B=4]
    f_v = np.array([[[nan, nan, 1, nan], [nan, nan, 1, 1]]])  # example 3 counted at site 1
    ar = {("n", "horizontal"): np.array([[2, 2]]), ("n", "vertical"): np.array([[1, 2]])}
    for kind in st.KINDS:
        ar[("flips", kind, "horizontal")], ar[("flips", kind, "vertical")] = f_h, f_v
    out = report.pooled_authors(ar, np.array([0, 0, 1, 1]))
    np.testing.assert_allclose(out[("id", "both")], [[2 / 3, 2 / 4]])
    np.testing.assert_array_equal(out[("n", "both")], [[3, 4]])
    np.testing.assert_allclose(out[("top", "both")]["id"], [(2 / 3 + 2 / 4) / 2])


def test_correlation_ci():
    rng = np.random.default_rng(0)
    x = rng.normal(size=30)
    y = 0.5 * x + rng.normal(size=30)
    r, lo, hi, n = correlation_ci(x, y)
    assert n == 30 and r == pytest.approx(np.corrcoef(x, y)[0, 1]) and lo < r < hi
    assert correlation_ci(x, np.exp(2 * x), rank=True)[0] == pytest.approx(1.0)  # monotone
    assert correlation_ci(x, np.exp(2 * x))[0] < 0.99  # Pearson is not rank-based
    assert np.isnan(correlation_ci(x, np.ones(30))[0])  # a constant side
    assert np.isnan(correlation_ci([1, 2, 3], [1, 3, 2])[1])  # too few pairs for an interval


def test_mann_whitney_u():
    u, p = mann_whitney_u([1, 2, 3], [4, 5, 6])
    assert u == 0.0 and p == pytest.approx(0.0809, abs=5e-4)  # normal approx., continuity
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=40), rng.normal(size=35) + 0.3
    a[3] = b[5]  # a tie
    brute = sum(float(x > y) + 0.5 * float(x == y) for x in a for y in b)
    assert mann_whitney_u(a, b)[0] == pytest.approx(brute)
    assert mann_whitney_u(rng.normal(size=200), rng.normal(size=200) + 1.0)[1] < 1e-6


def _hand_made_authors_rates(flips_YxB) -> dict:
    """`pooled_authors`'s "both" entries for one model from its per-site flips [Y', B]
    (NaN: not counted), the same for every kind but the noise (its flips halved)."""
    f = np.asarray(flips_YxB, float)[None]
    n = np.isfinite(f).sum(-1)
    rate = np.where(n > 0, np.nansum(f, -1) / np.maximum(n, 1), np.nan)
    ar = {("id", "both"): rate}
    for kind in st.KINDS:
        ar[("flips", kind, "both")] = f * (0.5 if kind == "noise" else 1.0)
    ar[("top", "both")] = st.top_sites_mean(rate, {k: rate for k in st.KINDS if k != "id"})
    return ar


def test_the_paper_figure_bars_flip_rates_against_the_controls(tmp_path, saved_figures):
    """Fig. 2 beside the table: per model a bar per kind (ID, noise, orthogonal) of the
    mean over its 3 best sites, "% belief swapped"; the per-question top-site flips
    average to Fig. 2's number; a model with nothing counted says n = 0."""
    from conftest import texts

    from jaxmech import plots

    flips = [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, np.nan]]  # [Y' = 4, B]
    ar = _hand_made_authors_rates(np.where(np.isnan(flips[3]), np.nan, flips))
    top = report.top_site_flips(ar)
    assert np.nanmean(top["id"][0]) == pytest.approx(ar[("top", "both")]["id"][0])
    report.plot_paper(ar, str(tmp_path / "steering_paper.png"), ["tiny-qwen"])
    assert (tmp_path / "steering_paper.png").exists()
    fig = saved_figures[-1]
    (ax,) = fig.axes
    words = texts(fig)
    assert "5x steered - Spatial ID Steering by Model - % Belief Swapped" in ax.get_title()
    assert ax.get_xlabel().startswith("% belief swapped") and "tiny-qwen" in words
    assert all(plots.KIND_WORDS[k] in words for k in st.KINDS)
    widths = sorted(p.get_width() for p in ax.patches)
    assert widths[-1] == pytest.approx(np.nanmean(top["id"][0]))
    empty = _hand_made_authors_rates(np.full((4, 3), np.nan))
    report.plot_paper(empty, str(tmp_path / "empty.png"), ["tiny-qwen"])
    fig = saved_figures[-1]
    assert "n = 0" in texts(fig) and not fig.axes[0].patches  # no bar drawn as a zero


def _point(acc: float, flip: float, n: int = 20) -> dict:
    cell = lambda m: (m, m - 0.1, m + 0.1, n)  # noqa: E731
    return {"accuracy": cell(acc), "id_flip_rate": cell(flip),
            "noise_flip_rate": cell(flip / 3), "orthogonal_flip_rate": cell(flip / 4)}  # fmt: skip


def test_accuracy_vs_steerability_across_checkpoints(tmp_path, saved_figures):
    """Fig. 9 from a hand-made across-checkpoints record: a point per model
    (steerability on x, accuracy on y, the paper's axes), the correlation across
    models with its Fisher-z interval from 4 models, "not defined" (no number) below;
    a checkpoint with n = 0 is no point and is named so."""
    from conftest import texts

    accs, flips = [0.9, 0.8, 0.6, 0.5, 0.7], [0.7, 0.5, 0.3, 0.2, 0.1]
    summaries = {
        f"m{i}": {"steerability": _point(a, f)} for i, (a, f) in enumerate(zip(accs, flips))
    }
    rec = report.across_steerability(summaries, str(tmp_path))["accuracy_vs_steerability"]
    r, lo, hi, n = correlation_ci(flips, accs)
    assert rec["checkpoints"] == list(summaries) and rec["pearson"]["n"] == n == 5
    assert rec["pearson"]["r"] == pytest.approx(r) and rec["pearson"]["ci_low"] == pytest.approx(lo)
    assert rec["accuracy"][0] == summaries["m0"]["steerability"]["accuracy"]
    assert os.path.exists(rec["figure"]) and rec["figure"].endswith(report.ACROSS_FIGURE)
    (ax,) = saved_figures[-1].axes
    assert ax.get_xlabel().startswith("Steerability: ID flip rate")
    assert ax.get_ylabel().startswith("Accuracy") and "Accuracy vs. Steerability" in ax.get_title()
    assert f"[{lo:+.2f}, {hi:+.2f}]" in ax.get_title()
    points = [c.lines[0].get_xdata()[0] for c in ax.containers]  # errorbars: a point each
    assert sorted(points) == pytest.approx(sorted(flips))
    three = dict(list(summaries.items())[:3])
    rec = report.across_steerability(three, str(tmp_path))["accuracy_vs_steerability"]
    assert (
        rec["pearson"]["ci_low"] is None and "CI not defined (n = 3 < 4" in rec["pearson"]["words"]
    )
    two = {"a": summaries["m0"], "b": summaries["m1"], "c": {"steerability": _point(0.5, 0.5, 0)}}
    rec = report.across_steerability(two, str(tmp_path))["accuracy_vs_steerability"]
    assert rec["pearson"]["r"] is None and "not defined (n = 2 models)" in rec["pearson"]["words"]
    words = texts(saved_figures[-1])
    assert "n = 0, not drawn: c" in words and "r not defined" in words


def test_the_steering_report_adds_fig_9_across_checkpoints():
    """`--checkpoint=A,B` hands the steering summaries to `across_steerability`."""
    assert report.REPORT.across is report.across_steerability


def test_two_checkpoints_write_fig_9_beside_the_medians(tmp_path):
    """`checkpoints_main` over two checkpoints (the fixture under two names; each
    report stubbed by its summary) adds `Report.across`'s record to
    `across_checkpoints.json`: their accuracy and flip rates, r not defined (2 models),
    and the figure."""
    import json
    import types

    from jaxmech.reports.driver import checkpoints_main

    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl", "qwen2_vl")
    for name in ("a", "b"):
        os.symlink(fixture, tmp_path / name)
    points = {"a": _point(0.9, 0.6), "b": _point(0.6, 0.2)}

    class Flags(types.SimpleNamespace):
        def __contains__(self, name):
            return hasattr(self, name)

    F = Flags(checkpoint=f"{tmp_path / 'a'},{tmp_path / 'b'}", out=str(tmp_path / "out"),
              grid="2x2", size=112, questions=1, question_seed=0, layers=None, batch=1,
              dtype="float32", memory=None, protocol="jaxmech", questions_from="drawn",
              data=None, per_block=False, place="auto")  # fmt: skip
    on_checkpoint = lambda run, out: {"summary": {"steerability": points[os.path.basename(out)]}}  # noqa: E731
    checkpoints_main(F, on_checkpoint, False, report.REPORT.across)
    record = json.load(open(tmp_path / "out" / "across_checkpoints.json"))
    fig9 = record["accuracy_vs_steerability"]
    assert fig9["checkpoints"] == ["a", "b"] and fig9["pearson"]["r"] is None
    assert [c[0] for c in fig9["accuracy"]] == [0.9, 0.6]
    assert record["steerability"]["accuracy"]["median"] == pytest.approx(0.75)
    assert os.path.exists(tmp_path / "out" / report.ACROSS_FIGURE)
