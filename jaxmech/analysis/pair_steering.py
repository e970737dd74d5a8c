"""Both objects steered at once (paper 003's Fig. 6A, `arbitrary_steering/single_lr.py`),
at a sweep of LM sites, for any VLM family.

Intervention i names two cells (a_i, b_i): X's word is moved towards a_i and Y's
towards b_i at `lm/resid_pre.{y}`:

    X += scale * (Delta(a_i) - Delta(minus_x)),   Y += scale * (Delta(b_i) - Delta(minus_y))

jaxmech's protocol: minus = each word's own cell, scale 1, the ID of the steered site
(each ID replaced by its target's). The authors': minus_x = b_i, minus_y = a_i (the two
IDs traded: `run_patch_resid_post`'s +- (ID(a) - ID(b))), scale 5, one ID (their layer
13) added at the output of every block of a sweep (their 5..19). Read as
`analysis.arbitrary_steering` reads one target: the answer words' log p unsteered,
steered, and steered by norm-matched Gaussian noise (each word's own norm), drawn from
the question's index so a chunked table draws what one call draws.

Axis names (`jaxmech.shapes`): K models, B questions, I interventions, W answer words,
Y' sites steered, L cells, D d_model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis import steering as st
from jaxmech.analysis.arbitrary_steering import question_noise, word_logprobs
from jaxmech.chunks import run_chunks
from jaxmech.families.vlm_view import Examples, over_models


def pair_steps(delta_LxD, a_I, b_I, minus_IxBx2, scale: float):
    """([I, B, D] X's step, [I, B, D] Y's step) (module docstring)."""
    d = jnp.asarray(delta_LxD)
    m = jnp.asarray(minus_IxBx2)
    x = d[jnp.asarray(a_I)][:, None] - d[m[..., 0]]
    y = d[jnp.asarray(b_I)][:, None] - d[m[..., 1]]
    return scale * x, scale * y


def _steered(view, p, inputs, spans, site, steps, words_W, key, rows_B, first, clean):
    """{"id", "noise": [I, B, W]} with each intervention's two steps (and norm-matched
    noise in their place) added at X's and Y's words at `lm/resid_pre.{site}`."""
    n_i = steps[0].shape[0]

    def at(i_xy):
        i, x, y = i_xy

        def run(vx, vy):
            add = st.at_word(vx, spans.x_B, spans.length) + st.at_word(vy, spans.y_B, spans.length)
            return word_logprobs(st.add_forward(view, p, inputs, site, add, [first], clean[1]),
                                 words_W)  # fmt: skip

        noise = (question_noise(key, i, rows_B, x), question_noise(key, i + n_i, rows_B, y))
        return run(x, y), run(*noise)

    lp_id, lp_noise = jax.lax.map(at, (jnp.arange(n_i), *steps))
    return {"id": lp_id, "noise": lp_noise}


def table_fn(view, sites, id_sites, words_W, first: int, scale: float):
    """chunk(params_K, delta_KxYxLxD, keys_K, inputs, spans, a_I, b_I, minus_IxBx2,
    rows_B) -> {"plain": [K, W, B], "id": [K, Y', I, W, B], "noise": same}: the table of
    one chunk of questions, the questions' axis last (`chunks.run_chunks`)."""

    def chunk(params_K, delta_K, keys_K, inputs, spans, a_I, b_I, minus, rows_B):
        def one(m):
            p, delta, key = m
            clean = st.unsteered(view, p, Examples(None, inputs, spans, spans.answer_B, None))
            out = [
                _steered(view, p, inputs, spans, y, pair_steps(delta[i], a_I, b_I, minus, scale),
                         words_W, key, rows_B, first, clean)
                for y, i in zip(sites, id_sites)
            ]  # fmt: skip
            stacked = {k: jnp.moveaxis(jnp.stack([o[k] for o in out]), 2, -1) for k in out[0]}
            return stacked | {"plain": word_logprobs(clean[0], words_W).T}

        return over_models(one, (params_K, delta_K, keys_K))

    return jax.jit(chunk)


def chunk_args(ex: Examples, minus_IxBx2, rows) -> tuple:
    """(inputs, spans, minus [I, b, 2], rows [b]) of questions `rows` of `ex`."""
    from jaxmech.analysis.arbitrary_steering import chunk_args as one

    inputs, spans, _, r = one(ex, np.zeros((1, len(np.asarray(ex.answer_B)))), rows)
    return inputs, spans, jnp.asarray(np.asarray(minus_IxBx2)[:, rows]), r


def pair_table(view, params_K, delta_K, ex: Examples, a_I, b_I, minus_IxBx2, fn, seed: int = 0,
               batch=None, progress=None, store=None, plan=None, compiled=None) -> dict:  # fmt: skip
    """`table_fn`'s results (`fn`) over every question of `ex` (host NumPy, questions
    last), `batch` at a time, finished chunks kept in / resumed from `store`;
    `compiled(b)`: `fn` already compiled for b questions, or None (the plan's)."""
    n = len(np.asarray(ex.answer_B))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree_util.tree_leaves(params_K)[0]))
    a, b = jnp.asarray(a_I), jnp.asarray(b_I)

    def chunk(rows):
        inputs, spans, minus, r = chunk_args(ex, minus_IxBx2, rows)
        done = None if compiled is None else compiled(len(rows))
        call = fn if done is None else done
        return jax.device_get(call(params_K, delta_K, keys, inputs, spans, a, b, minus, r))

    return run_chunks(chunk, n, batch or n, progress, store, plan)


def compile_at(fn, params_K, delta_K, ex: Examples, a_I, b_I, minus_IxBx2):
    """`b -> fn` compiled for chunks of b questions (for `memory.plan_rows`)."""
    keys = jax.random.split(jax.random.PRNGKey(0), len(jax.tree_util.tree_leaves(params_K)[0]))

    def at(b: int):
        rows = np.arange(b) % len(np.asarray(ex.answer_B))
        inputs, spans, minus, r = chunk_args(ex, minus_IxBx2, rows)
        return fn.lower(params_K, delta_K, keys, inputs, spans, jnp.asarray(a_I),
                        jnp.asarray(b_I), minus, r).compile()  # fmt: skip

    return at
