"""Mirror-swap activation patching (paper 003), for any VLM family.

Run an example and its counterfactual twin (the width mirror; the recolour twin as the
control) with the same question; at one LM layer, replace the example's residual
stream at one group of token positions by the twin's, finish the forward, and ask how
far the answer moved towards the twin's. With log-probabilities of the example's own
answer word a (the authors' code):

    shift = (lp_orig(a) - lp_patched(a)) / (lp_orig(a) - lp_twin(a))

0: the patch changed nothing; 1: the patched run believes what the twin run believes.
The paper's formula is the same with probabilities. For the recolour control the
denominator is the mirror's (a recolour leaves the answer, so its own denominator is
~0): the control's shift says how much of the mirror's effect a patch of equal size
but no spatial content produces.

A family enters only through its VLM view (`families.vlm_view`): its forward, its
spans and its LM's blocks. Sites: `lm/resid_pre.{layer}` for every LM block (the
residual entering it). Token groups (`GROUPS`, from the spans): the image tokens, the
question tokens, the two object words (the last sub-token of each), the answer
position, every token after the image (the question, the chat template and the answer
position: the authors' "text" group, `mirror_swapping.py`), and every token.

Axis names (`jaxmech.shapes`): B examples, S LM tokens, G token groups, Y patch
layers, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.chunks import run_chunks
from jaxmech.families.vlm_view import Spans, VLMView, model_outline
from jaxmech.models.edits import Edits
from jaxmech.models.order import low_precision, tie
from jaxmech.models.scan import in_place

GROUPS = ("image", "question", "objects", "last", "text", "all")


def token_groups(spans: Spans) -> np.ndarray:
    """[G, B, S] bool: which LM positions each group (`GROUPS`) patches, per example."""
    B, S = np.asarray(spans.question_BxS).shape
    pos = np.arange(S)[None, :]
    at = lambda p_B: pos == np.asarray(p_B)[:, None]  # noqa: E731
    image = (pos[..., None] == np.asarray(spans.image_BxI)[:, None, :]).any(-1)
    objects = at(spans.x_B) | at(spans.y_B)
    text = pos > np.asarray(spans.image_BxI).max(1)[:, None]  # the authors' "text" group
    every = np.ones((B, S), bool)
    return np.stack(
        [image, np.asarray(spans.question_BxS), objects, at(spans.answer_B), text, every]
    )


def belief_shift(orig, patched, twin, eps: float = 1e-6):
    """(orig - patched) / (orig - twin), NaN where |orig - twin| < eps (no effect to
    explain). Works on log-probabilities or probabilities, any matching shapes."""
    denom = orig - twin
    ok = jnp.abs(denom) >= eps
    return jnp.where(ok, (orig - patched) / jnp.where(ok, denom, 1.0), jnp.nan)


def _answer_logp(logits_xBxV, answer_B):
    """[..., B] log p(answer_B) under the full softmax: its logit minus the logsumexp
    (the [..., B, V] log-softmax is never written out)."""
    idx = jnp.broadcast_to(answer_B[:, None], logits_xBxV.shape[:-1] + (1,))
    own = jnp.take_along_axis(logits_xBxV, idx, axis=-1)[..., 0]
    return own - jax.nn.logsumexp(logits_xBxV, axis=-1)


def patch_logp(
    view: VLMView,
    params,
    inputs,
    twin_inputs,
    groups_GxBxS,
    answer_B,
    other_B,
    layers=None,
    shared_B=None,
    plan=None,
    orig=None,
) -> dict:
    """Log-probabilities of each example's own answer word, plain and patched.

    Args:
      view: the family's VLM view; params: one model's params (vmap over stacked ones).
      inputs, twin_inputs: the examples and their twins rendered by `view.render` (the
        same questions, so the same spans), e.g. the mirror twins.
      groups_GxBxS: bool token groups (`token_groups` of the examples' spans).
      answer_B, other_B: each example's answer word and the other word of its relation
        (`families.vlm_view.answer_ids`).
      layers: the LM blocks y whose `lm/resid_pre.{y}` is patched (default: every one).
      shared_B: [B] the first position where an example's and its twin's inputs may
        differ (the rows before it are the same in both runs: e.g. the first image
        token when only the picture differs); None: 0. Only speed depends on it.
      plan: the rows each group's patch resumes from (`resume_plan`); default: from
        the groups when they are concrete. Given, the groups may be traced (one
        compiled call then serves every chunk of a larger set planned together).
      orig: the examples' own plain run `(logits, aux)` capturing `table_sites`, when
        it is shared by several twins' patches (default: run here).

    Returns:
      {"orig": [B], "twin": [B], "patched": [Y, G, B]} log p(answer_B) under the full
      softmax: the example, the twin, and the example with `lm/resid_pre.{y}` at group
      g's positions taken from the twin's run; "orig_other", "twin_other" [B],
      "patched_other" [Y, G, B]: the log p of the other word (to tell which examples
      each run answers right, and the authors' change of both words).

    The clean and twin runs are run once and serve every patch. A patched run is handed
    the whole residual stream at its layer (the twin's at the group's positions, the
    example's elsewhere), so everything before that layer, the ViT included, is dead
    code that XLA drops. Where the view offers `forward_from` (a key / value cache) and
    the groups are concrete, a patch also runs only the rows after those it shares
    with a plain run (`resume_plan`), the others' keys and values read from that run.
    """
    answer, other = jnp.asarray(answer_B), jnp.asarray(other_B)
    layers = range(view.n_lm_blocks(params)) if layers is None else layers
    plan = resume_plan(view, groups_GxBxS, shared_B) if plan is None else plan
    groups_GxBxS = jnp.asarray(groups_GxBxS)
    sites = table_sites(view, layers, plan)
    twin_logits, twin_aux = view.forward(params, twin_inputs, capture=sites)
    orig_logits, orig_aux = orig or view.forward(params, inputs, capture=sites)
    orig, twin_lp = _answer_logp(orig_logits, answer), _answer_logp(twin_logits, answer)

    per_layer = _patched_logits(view, params, inputs, layers, groups_GxBxS, plan,
                                orig_aux, twin_aux, in_turn=low_precision(params))  # fmt: skip
    return {
        "orig": orig,
        "twin": twin_lp,
        "patched": jnp.stack([_answer_logp(logits, answer) for logits in per_layer]),
        "patched_other": jnp.stack([_answer_logp(logits, other) for logits in per_layer]),
        "orig_other": _answer_logp(orig_logits, other),
        "twin_other": _answer_logp(twin_logits, other),
    }


def _patched_logits(view: VLMView, params, inputs, layers, groups_GxBxS, plan, orig_aux,
                    twin_aux, in_turn: bool) -> list:  # fmt: skip
    """Per layer y, [G, B, V] the logits with `lm/resid_pre.{y}` at each group's positions
    taken from the twin's run (`twin_aux`), the example's elsewhere (`orig_aux`):
    whole forwards vmapped over the groups, or resumed ones per group (`plan`).
    `in_turn` (low-precision weights): the resumed runs one after another
    (`models.order.tie`), each converting its blocks' weights as it runs, not every
    run's conversions at once."""

    def mixed(name, mask_BxS, s0=0):
        x = jnp.where(mask_BxS[:, :, None], twin_aux[name], orig_aux[name])
        return x[:, s0:]

    traced_ok = in_place(params)  # rows too: scanned by a switch
    if plan is not None and view.resume_any_layer and len(layers) > 1 and traced_ok:
        return _resumed_per_group(view, params, inputs, layers, groups_GxBxS, plan,
                                  orig_aux, twin_aux, in_turn)  # fmt: skip
    out, last = [], None
    for y in layers:
        name = f"lm/resid_pre.{y}"
        if plan is None:

            def patched(mask_BxS, name=name):
                edits = Edits(replace={name: (True, mixed(name, mask_BxS))})
                return view.forward(params, inputs, edits)[0]

            out.append(jax.vmap(patched)(jnp.asarray(groups_GxBxS)))
            continue
        runs = []
        for g, (s0, from_twin) in enumerate(plan):
            x = mixed(name, groups_GxBxS[g], s0)
            x = tie(x, last) if in_turn and last is not None else x
            runs.append(last := view.forward_from(params, inputs, y, s0, x,
                                                  twin_aux if from_twin else orig_aux))  # fmt: skip
        out.append(jnp.stack(runs))
    return out


def _resumed_per_group(view: VLMView, params, inputs, layers, groups_GxBxS, plan, orig_aux,
                       twin_aux, in_turn: bool) -> list:  # fmt: skip
    """`_patched_logits`' resumed runs with the layer traced (`view.resume_any_layer`):
    per group one `lax.map` over the layers, so the table compiles one resumed LM per
    group (its rows `plan` fix its shapes), not one per group and layer."""
    per_group, last = [], None
    for g, (s0, from_twin) in enumerate(plan):
        mask = groups_GxBxS[g][:, :, None]
        xs = jnp.stack([jnp.where(mask, twin_aux[f"lm/resid_pre.{y}"],
                                  orig_aux[f"lm/resid_pre.{y}"])[:, s0:] for y in layers])  # fmt: skip
        xs = tie(xs, last) if in_turn and last is not None else xs
        aux = twin_aux if from_twin else orig_aux

        def one(yx, s0=s0, aux=aux):
            return view.forward_from(params, inputs, yx[0], s0, yx[1], aux)

        last = jax.lax.map(one, (jnp.asarray(layers, jnp.int32), xs))
        per_group.append(last)
    return list(jnp.stack(per_group, 1))  # per layer [G, B, V]


def table_sites(view: VLMView, layers, plan) -> list[str]:
    """The sites a patch reads from the plain runs: the residual entering each patched
    layer, and the key / value cache where the patches resume (`plan`)."""
    return [f"lm/resid_pre.{y}" for y in layers] + (
        list(view.cache_sites) if plan is not None else []
    )


def resume_plan(view: VLMView, groups_GxBxS, shared_B=None):
    """[G] (start, from_twin) per group: the rows a patched run shares with a plain run
    and need not recompute, or None when the view has no `forward_from` or the groups
    are traced. In a causal LM a patched run equals the example's run before the
    group's first position, and the twin's before the first unpatched position at or
    after `shared_B` (rows before `shared_B` are the same in both runs; rows from there
    to that position are all the twin's). The larger start wins (min over the batch,
    at most S - 1)."""
    if view.forward_from is None:
        return None
    try:
        g = np.asarray(groups_GxBxS, bool)
    except jax.errors.TracerArrayConversionError:
        return None
    G, B, S = g.shape
    shared = np.zeros(B, int) if shared_B is None else np.asarray(shared_B)
    pos = np.arange(S)
    plan = []
    for mask in g:
        first = np.where(mask.any(1), mask.argmax(1), S).min()
        unpatched = ~mask & (pos[None] >= shared[:, None])
        twin_end = np.where(unpatched.any(1), unpatched.argmax(1), S).min()
        start, from_twin = max((int(first), False), (int(twin_end), True))
        plan.append((min(start, S - 1), from_twin))
    return plan


def table_call(view: VLMView, plan, layers, twin_names):
    """The jitted call of one chunk of a patching table: `patch_logp` of stacked models
    [K, ...] against each named twin, the groups [B, G, S] (rows first, to be sliced)
    traced and the resumed rows `plan` static, so every chunk runs one program."""

    @jax.jit
    def chunk(params_K, inputs, twins, groups_BxGxS, answer_B, other_B):
        g = jnp.swapaxes(groups_BxGxS, 0, 1)

        def one_model(p):
            # the example's own run once, shared by every twin's patches (not a lax.map
            # over the twins: in a loop body XLA's CPU backend keeps each block's
            # float32 weight copies apart, 0.13 GB a block at Qwen2-VL-2B's size in bf16)
            orig = view.forward(p, inputs, capture=table_sites(view, layers, plan))
            return {t: patch_logp(view, p, inputs, twins[t], g, answer_B, other_B, layers,
                                  plan=plan, orig=orig) for t in twin_names}  # fmt: skip

        if jax.tree_util.tree_leaves(params_K)[0].shape[0] == 1:  # one model (a checkpoint):
            # unbatched, as a vmap over a size-1 axis makes XLA's contractions slower
            first = jax.tree_util.tree_map(lambda x: x[0], params_K)
            return jax.tree_util.tree_map(lambda x: x[None], one_model(first))
        return jax.vmap(one_model)(params_K)

    return chunk


def chunk_args(inputs, twins: dict, groups_GxBxS, answer_B, other_B, rows) -> tuple:
    """`table_call`'s arguments but the params for the examples at `rows` (host NumPy)."""
    every = (inputs, twins, np.swapaxes(np.asarray(groups_GxBxS), 0, 1), answer_B, other_B)
    return jax.tree_util.tree_map(lambda v: np.asarray(v)[rows], every)


def patch_table(view: VLMView, params_K, inputs, twins: dict, groups_GxBxS, answer_B,
                other_B, layers=None, shared_B=None, batch=None, progress=None,
                call=None, store=None, plan=None, compiled=None) -> dict:  # fmt: skip
    """{twin: `patch_logp` of K stacked models} over every example, `batch` at a time
    (default all) through one compiled call (`table_call`, with its resumed rows
    planned over every example; `call`: one built before, e.g. to time it without its
    compile). The last chunk is padded and cut. `progress(done, n, resumed)` after each
    chunk; `store` (`chunks.ChunkStore`): finished chunks kept and resumed; `plan`
    (`memory.Plan`): each chunk's peak measured, the rows shrunk when it went over
    (`chunks.run_chunks`); `compiled(b)`: `call` already compiled for b rows, or None
    (`memory.remembered(...).program`: the plan's sizing compile reused). Host NumPy
    out, the examples' axis last."""
    call = call or table_call_for(view, params_K, twins, groups_GxBxS, layers, shared_B)
    n = len(np.asarray(answer_B))

    def chunk(rows):
        args = chunk_args(inputs, twins, groups_GxBxS, answer_B, other_B, rows)
        done = None if compiled is None else compiled(len(rows))
        return jax.device_get((call if done is None else done)(params_K, *args))

    return run_chunks(chunk, n, batch or n, progress, store, plan)


def table_call_for(view: VLMView, params_K, twins: dict, groups_GxBxS, layers=None,
                   shared_B=None):  # fmt: skip
    """`table_call` for these groups (resumed rows planned over every example), every
    LM block where `layers` is None."""
    # an outline, not `x[0]`: an eager slice copies every weight (4.1 GB at Qwen2-VL-2B)
    first = model_outline(params_K)
    layers = tuple(range(view.n_lm_blocks(first))) if layers is None else tuple(layers)
    return table_call(view, resume_plan(view, groups_GxBxS, shared_B), layers, tuple(twins))


def table_compile_at(call, params_K, inputs, twins: dict, groups_GxBxS, answer_B, other_B):
    """`b -> call` compiled for chunks of b examples (for `memory.plan_rows`)."""
    n = len(np.asarray(answer_B))

    def compile_at(b: int):
        args = chunk_args(inputs, twins, groups_GxBxS, answer_B, other_B, np.arange(b) % n)
        return call.lower(params_K, *args).compile()

    return compile_at
