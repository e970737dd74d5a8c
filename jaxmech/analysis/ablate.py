"""Ablations as data: evaluation with chosen logit terms removed, in one compiled call.

An ablation is named by the removed terms in lower case joined by `+` (`ep`, `ep+bp`,
`ep+vp`); `none` is the baseline. Terms are those of `models.edits.TERMS` (the first
vision block's logits: `ee ep eb pe pp pb be bp bb`) plus `vp`, the position part
`P W_V` of the values. Every ablation is an `Edits` value with the same structure
(all-ones masks where nothing is removed, which is exactly the plain forward), so a
table of ablations is a `lax.map` over stacked edits inside one jitted program.

Axis names (`jaxmech.shapes`): K models, A ablations (stacked edits), H heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.families.dual_encoder.evaluate import METRICS, evaluate
from jaxmech.models.edits import TERMS, Edits

DEFAULT_ABLATIONS = (
    "none",
    "ep",
    "pe",
    "pp",
    "bp",
    "ee",
    "vp",
    "ep+bp",
    "ep+vp",
    "ep+pp+bp",
    "ep+bp+vp",
)


def parse_ablation(name: str) -> tuple[tuple[str, ...], bool]:
    """`"ep+bp"` -> (("EP", "BP"), remove_vp=False); errors name the bad part."""
    if name == "none":
        return (), False
    terms, vp = [], False
    for part in name.split("+"):
        if part == "vp":
            vp = True
        elif part.upper() in TERMS:
            terms.append(part.upper())
        else:
            known = ", ".join(t.lower() for t in TERMS)
            raise ValueError(f"ablation {name!r}: unknown term {part!r}; known: {known}, vp, none")
    return tuple(terms), vp


def ablation_edits(names, n_heads: int, heads=None, tower: str = "vision") -> Edits:
    """Stacked Edits [A] for the named ablations, in `heads` (default all heads)."""
    rows = jnp.arange(n_heads) if heads is None else jnp.asarray(heads, jnp.int32)
    in_heads = jnp.zeros((n_heads,), bool).at[rows].set(True)
    keeps, vps = [], []
    for name in names:
        terms, vp = parse_ablation(name)
        drop_t = jnp.asarray([t in terms for t in TERMS])
        keeps.append(jnp.where(in_heads[:, None] & drop_t[None, :], 0.0, 1.0))
        vps.append(jnp.where(in_heads & vp, 0.0, 1.0))
    return Edits(
        term_keep={tower: jnp.stack(keeps).astype(jnp.float32)},
        vp_keep={tower: jnp.stack(vps).astype(jnp.float32)},
    )


@jax.jit
def _table(params_K, settings_K, evals, captions, edits_A):
    def per_model(args):
        params, settings = args
        return jax.lax.map(lambda e: evaluate(params, evals, captions, settings, edits=e), edits_A)

    return jax.lax.map(per_model, (params_K, settings_K))


def evaluate_edits(params_K, settings_K, data, edits_A: Edits):
    """Accuracies of K models under A stacked edits: dict metric -> [K, A], one compiled call.

    The metrics are `evaluate.METRICS` plus any per-group accuracies of the task's
    validation sets (2D relations, distractor places; `data.tasks.grouped`).

    Any stacked `Edits` (leading axis A on every leaf) works: term masks, rope keep
    masks (`analysis.rope`), patches. The text tower's mask is each model's
    `params_K["static"]["causal_text"]` (`families.dual_encoder.checks.with_static` edits it).
    """
    evals = jax.tree_util.tree_map(jnp.asarray, data.evals)
    out = _table(params_K, settings_K, evals, jnp.asarray(data.tables.captions), edits_A)
    return {m: out[m] for m in METRICS} | {m: v for m, v in out.items() if m not in METRICS}


def ablation_table(params_K, settings_K, data, names=DEFAULT_ABLATIONS, *, heads=None) -> dict:
    """Accuracies of K models under A ablations: dict metric -> [K, A], one compiled call.

    Args:
      params_K: stacked params (leading model axis).
      settings_K: stacked `Settings` (decide each model's seen-pair set).
      data: `data.tasks.Data` (tables and validation sets).
      names: ablation names (module docstring).
      heads: head indices to ablate in (default: all heads).

    The switches (text mask, logit-scale cap) are those of `params_K["static"]`.
    """
    n_heads = params_K["vision"]["block_0"]["W_Q"].shape[1]
    edits = ablation_edits(names, n_heads, heads)
    return evaluate_edits(params_K, settings_K, data, edits)
