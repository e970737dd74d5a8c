"""Arbitrary spatial steering (paper 003, Fig. 6) and the depth diagnosis (Fig. 7),
for any VLM family.

At one LM site `lm/resid_pre.{y}`, X's word (its last sub-token, `Spans.x_B`) is moved
towards a target cell t by

    scale * (Delta(t) - Delta(minus))

where `Delta` is the model's universal spatial ID (`analysis.spatial_ids`) at the
site `id_site`. jaxmech's protocol: minus = X's own cell, scale 1, the ID of the
steered site (X's ID replaced by t's: t = X's cell adds nothing). The authors'
(`arbitrary_steering/batch_lr.py`, `depth_diagnosis/depth_diagnosis.py`): minus = t's
mirror (across the width for left / right, across the height for the depth
diagnosis), scale 5, their ID of layer L added to the output of block L (jaxmech's
site L + 1); Y's word is not touched.

What is read: the log-probabilities (over the whole vocabulary) of two answer words at
the answer position, unsteered, steered, and steered by norm-matched Gaussian noise
(per question and target the step's norm; drawn from the question's own index, so a
chunked table draws what an unchunked one draws). A target's side (`target_sides`)
says which word it implies: +1 the first (left / above), -1 the second, 0 none.

A family enters only through its VLM view (`families.vlm_view`).

Axis names (`jaxmech.shapes`): K models, B questions, T targets, W answer words, Y'
sites steered, Y every site, L cells, D d_model, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis import spatial_ids as si
from jaxmech.analysis import steering as st
from jaxmech.chunks import run_chunks
from jaxmech.data.spec import Grid
from jaxmech.families.vlm_view import Examples, VLMView, over_models

AUTHORS_SCALE = 5.0  # batch_steering.sh / depth_diagnosis.sh: MULT_FACTOR=5
AUTHORS_LAYERS = (12, 13, 14)  # batch_lr.py `range(12, 15)`, depth_diagnosis.sh LAYERS
AUTHORS_DEPTH = 32  # LLaVA-1.5-7B's LM blocks, the only model of their scripts
AXES = ("width", "height")  # left / right move along the width, above / below the height


def cell_coords(grid: Grid, cells, axis: str) -> np.ndarray:
    """The column (axis "width") or row ("height") of each cell (row-major ids)."""
    if axis not in AXES:
        raise ValueError(f"axis = {axis!r}: expected one of {', '.join(AXES)}")
    cells = np.asarray(cells)
    return cells % grid.w if axis == "width" else cells // grid.w


def mirror_cells(grid: Grid, cells, axis: str) -> np.ndarray:
    """Each cell's mirror across the width (column c -> W - 1 - c) or the height (row r ->
    H - 1 - r): what the authors subtract from a target's ID."""
    cells = np.asarray(cells)
    row, col = cells // grid.w, cells % grid.w
    if axis == "width":
        return row * grid.w + (grid.w - 1 - col)
    cell_coords(grid, cells, axis)  # the axis checked
    return (grid.h - 1 - row) * grid.w + col


def target_sides(grid: Grid, target_T, ref_TxB, axis: str) -> np.ndarray:
    """[T, B] the answer each target implies: +1 the relation's first word (the target
    lies left of / above `ref`: Y's cell in jaxmech's protocol, the target's mirror in
    the authors'), -1 the second, 0 neither (level with it)."""
    a = cell_coords(grid, np.asarray(target_T)[:, None], axis)
    b = cell_coords(grid, ref_TxB, axis)
    return np.sign(b - a).astype(np.int32)


def target_steps(delta_LxD, target_T, minus_TxB, scale: float):
    """[T, B, D] `scale * (Delta(target_t) - Delta(minus_tb))`."""
    return scale * (delta_LxD[jnp.asarray(target_T)][:, None] - delta_LxD[jnp.asarray(minus_TxB)])


def question_noise(key, t: int, rows_B, like_BxD):
    """[B, D] Gaussian directions with the norms of `like_BxD`'s rows, question b's drawn
    from (key, target t, its index rows_B[b]): the same whatever the chunking."""
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, t), r))(rows_B)
    z = jax.vmap(lambda k: jax.random.normal(k, like_BxD.shape[-1:], like_BxD.dtype))(keys)
    norm = jnp.linalg.norm(like_BxD, axis=-1, keepdims=True)
    return z * norm / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-30)


def word_logprobs(logits_BxV, words_W):
    """[B, W] the log-probabilities of the words (token ids [W]) over the vocabulary."""
    return jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1)[:, jnp.asarray(words_W)]


def steered_logprobs(view: VLMView, params, inputs, spans, site: int, steps_TxBxD, words_W,
                     key, rows_B, first: int, clean) -> dict:  # fmt: skip
    """{"id": [T, B, W], "noise": [T, B, W]}: the words' log-probabilities with each
    target's step added at X's word at `lm/resid_pre.{site}`, and with norm-matched
    noise there instead. `clean`: the questions' `steering.unsteered` forward; `first`
    (static): a position at or before every X word, from which a view with
    `forward_from` resumes the run."""

    def at(t_step):
        t, step = t_step
        run = lambda v: st.add_forward(  # noqa: E731
            view, params, inputs, site, st.at_word(v, spans.x_B, spans.length), [first], clean[1]
        )
        noise = question_noise(key, t, rows_B, step)
        return word_logprobs(run(step), words_W), word_logprobs(run(noise), words_W)

    T = steps_TxBxD.shape[0]
    lp_id, lp_noise = jax.lax.map(at, (jnp.arange(T), steps_TxBxD))
    return {"id": lp_id, "noise": lp_noise}


def table_fn(view: VLMView, sites, id_sites, words_W, first: int, scale: float):
    """chunk(params_K, delta_KxYxLxD, keys_K, inputs, spans, target_T, minus_TxB, rows_B)
    -> {"plain": [K, W, B], "id": [K, Y', T, W, B], "noise": same}: one chunk of
    questions steered at every site of `sites` (ID of `id_sites`, same order) to every
    target (`steered_logprobs`), the questions' axis last (`chunks.run_chunks`)."""

    def chunk(params_K, delta_K, keys_K, inputs, spans, target_T, minus_TxB, rows_B):
        def one(m):
            p, delta, key = m
            clean = st.unsteered(view, p, Examples(None, inputs, spans, spans.answer_B, None))
            steer = lambda y, steps: steered_logprobs(  # noqa: E731
                view, p, inputs, spans, y, steps, words_W, key, rows_B, first, clean
            )
            out = [
                steer(y, target_steps(delta[i], target_T, minus_TxB, scale))
                for y, i in zip(sites, id_sites)
            ]
            stacked = {k: jnp.moveaxis(jnp.stack([o[k] for o in out]), 2, -1) for k in out[0]}
            return stacked | {"plain": word_logprobs(clean[0], words_W).T}

        return over_models(one, (params_K, delta_K, keys_K))

    return jax.jit(chunk)


def universal_ids(view: VLMView, params_K, labels, probe_batch=None, call=None,
                  factorial: bool = False):  # fmt: skip
    """[K, Y, L, D] each model's universal spatial ID at every site, from probe scenes of
    `labels` (`spatial_ids.probe`; `factorial`: the other object at every other cell,
    the authors' extraction); `call(fn, args)` runs the program (default jitted)."""
    call = call or (lambda fn, args: jax.device_get(jax.jit(fn)(*args)))
    pr = si.probe(view, labels, factorial=factorial)

    def one(p, inputs):
        states = si.word_states(view, p, inputs, pr.spans.x_B, probe_batch)
        return si.spatial_ids(states, pr.label_N, pr.cell_N, view.grid.cells)

    return call(lambda P, x: over_models(lambda p: one(p, x), P), (params_K, pr.inputs))


def chunk_args(ex: Examples, minus_TxB, rows) -> tuple:
    """(inputs, spans, minus [T, b], rows [b]) of questions `rows` of `ex`."""
    pick = lambda x: None if x is None else jnp.asarray(np.asarray(x)[rows])  # noqa: E731
    spans = ex.spans._replace(**{f: pick(getattr(ex.spans, f)) for f in (
        "image_BxI", "x_B", "y_B", "question_BxS", "answer_B", "first_B")})  # fmt: skip
    inputs = jax.tree_util.tree_map(pick, ex.inputs)
    return inputs, spans, jnp.asarray(np.asarray(minus_TxB)[:, rows]), jnp.asarray(rows)


def steer_table(view: VLMView, params_K, delta_K, ex: Examples, words_W, sites, id_sites,
                target_T, minus_TxB, scale: float, seed: int = 0, batch=None,
                progress=None, store=None, plan=None, fn=None, compiled=None) -> dict:  # fmt: skip
    """`table_fn`'s results over every question of `ex` (host NumPy, questions last),
    `batch` at a time (default all), finished chunks kept in / resumed from `store`
    (`chunks.run_chunks`). `fn`: the table's jitted function (built here when None);
    `compiled(b)`: `fn` already compiled for b questions, or None (the plan's)."""
    n = len(np.asarray(ex.answer_B))
    first = int(np.min(np.asarray(ex.spans.x_B)))
    fn = fn or table_fn(view, sites, id_sites, words_W, first, scale)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree_util.tree_leaves(params_K)[0]))
    target = jnp.asarray(target_T)

    def chunk(rows):
        inputs, spans, minus, r = chunk_args(ex, minus_TxB, rows)
        done = None if compiled is None else compiled(len(rows))
        call = fn if done is None else done
        return jax.device_get(call(params_K, delta_K, keys, inputs, spans, target, minus, r))

    return run_chunks(chunk, n, batch or n, progress, store, plan)


def compile_at(fn, params_K, delta_K, ex: Examples, target_T, minus_TxB):
    """`b -> fn` compiled for chunks of b questions (for `memory.plan_rows`)."""
    keys = jax.random.split(jax.random.PRNGKey(0), len(jax.tree_util.tree_leaves(params_K)[0]))

    def at(b: int):
        rows = np.arange(b) % len(np.asarray(ex.answer_B))
        args = chunk_args(ex, minus_TxB, rows)
        return fn.lower(params_K, delta_K, keys, args[0], args[1], jnp.asarray(target_T),
                        *args[2:]).compile()  # fmt: skip

    return at


def follows(lp: dict, sides_TxB, first_word_follows: bool = True) -> dict:
    """{kind: [K, Y', T, B]} whether each steered answer (the sign of logp(first word) -
    logp(second)) is the one its target implies (`target_sides`; NaN where it implies
    none), for "id", "noise" and "plain" (the unsteered answer, broadcast). With
    `first_word_follows` False the implied answer is the other word (the depth
    diagnosis: a target above reads "behind", the second of front / behind)."""
    sides = np.asarray(sides_TxB, float) * (1.0 if first_word_follows else -1.0)
    out = {}
    for kind in ("id", "noise"):
        m = np.asarray(lp[kind])[..., 0, :] - np.asarray(lp[kind])[..., 1, :]  # [K, Y', T, B]
        out[kind] = np.where(sides == 0, np.nan, (np.sign(m) == sides).astype(float))
    plain = np.asarray(lp["plain"])[:, 0] - np.asarray(lp["plain"])[:, 1]  # [K, B]
    same = (np.sign(plain)[:, None, None] == sides).astype(float)  # [K, 1, T, B]
    out["plain"] = np.broadcast_to(np.where(sides == 0, np.nan, same), out["id"].shape)
    return out


def shifts(lp: dict) -> dict:
    """{kind: [K, Y', T, W, B]} each word's change of log-probability, steered minus
    unsteered (the authors store unsteered minus steered: the same, negated)."""
    plain = np.asarray(lp["plain"])[:, None, None]
    return {k: np.asarray(lp[k]) - plain for k in ("id", "noise")}
