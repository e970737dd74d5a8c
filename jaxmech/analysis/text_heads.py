"""Text-encoder heads: the EOT row's attention and a first-mentioned-entity preference.

Paper 000 (text side): the causal text encoder writes word order into its readout; at
least one head sends the EOT token's attention mostly to the entity mentioned *first*,
whatever the label. For a pair caption `BOS X is on the left of Y EOT` the EOT row
of head h gives mass `a_first` to X (position 1) and `a_second` to Y (position 7);

    pref = a_first - a_second  in [-1, 1].

Why the sign matters less than its constancy: in a one-layer tower the EOT output is
`sum_h sum_j a_j V_h(x_j)`, and the caption and its swap (X <-> Y) differ by
`(a_first - a_second) V_h(E_X - E_Y)` per head (the position parts aside), so a head
encodes the order iff its preference is non-zero with one sign for every label pair.
A "second-mention" head (pref < 0 everywhere) would serve as well; both are reported.

The EOT query is the same token at the same position in every pair caption, so in the
first layer the logit difference (first - second key) splits exactly into a part from
the keys' position rows (`key_P`: a constant per head, label-independent by
construction) and a part from the keys' token rows (`key_E`: varies with the labels);
`decompose` gives both. Label independence shows as |key_P| >> std(key_E) and as the
fraction of captions with pref > 0 near 1 (or 0) on seen *and* unseen labels.

Everything here goes through the one forward (`encode_texts` and `analysis.decompose`)
and reads its named intermediates `text/pattern.{layer}`; no copy of the model.

Axis names (`jaxmech.shapes`): C captions, T caption length, Y text layers, H heads,
G caption groups, K models.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis.decompose import decompose
from jaxmech.data.tasks.vocab import Vocab
from jaxmech.families.dual_encoder.model import encode_texts, eot_index
from jaxmech.models.attention import n_blocks

GROUPS = ("all", "seen", "unseen", "mixed", "form_left", "form_right")
ROLES = ("none", "first", "second")


class PairCaptions(NamedTuple):
    """Every ordered pair caption of a task (host NumPy arrays).

    tokens:     [C, T] int32   `BOS a is on the <rel> of b EOT`
    first:      [C] int32      label mentioned first (a)
    second:     [C] int32      label mentioned second (b)
    first_pos:  [C] int32      its token position (1)
    second_pos: [C] int32      (7)
    form:       [C] int32      0: `rel = left` (X left of Y), 1: `rel = right` (Y right of X)
    """

    tokens: np.ndarray
    first: np.ndarray
    second: np.ndarray
    first_pos: np.ndarray
    second_pos: np.ndarray
    form: np.ndarray


def pair_captions(n_labels: int, caption_mode: str = "left") -> PairCaptions:
    """All ordered pairs (a, b), a != b, of labels 1..n_labels in the mode's caption forms.

    `caption_mode` "left": `a is on the left of b` only (C = n (n - 1)); "left_right":
    also `a is on the right of b` (C = 2 n (n - 1)). Captions are label-major.
    """
    if caption_mode not in ("left", "left_right"):
        raise ValueError(f"caption_mode = {caption_mode!r}: expected 'left' or 'left_right'")
    v = Vocab(n_labels)
    rels = ("left",) if caption_mode == "left" else ("left", "right")
    rows, first, second, form = [], [], [], []
    for a in range(1, n_labels + 1):
        for b in range(1, n_labels + 1):
            if a == b:
                continue
            for f, rel in enumerate(rels):
                rows.append(v.encode([a, "is", "on", "the", rel, "of", b]))
                first.append(a)
                second.append(b)
                form.append(f)
    tokens = np.asarray(rows, np.int32)
    is_label = (tokens >= 1) & (tokens <= n_labels)
    pos = np.argwhere(is_label)[:, 1].reshape(len(rows), 2)
    return PairCaptions(
        tokens,
        np.asarray(first, np.int32),
        np.asarray(second, np.int32),
        pos[:, 0].astype(np.int32),
        pos[:, 1].astype(np.int32),
        np.asarray(form, np.int32),
    )


def _check_captions(captions_CxT):
    if captions_CxT.ndim != 2:
        raise ValueError(f"captions must be [C, T] token ids, got shape {captions_CxT.shape}")
    if not jnp.issubdtype(captions_CxT.dtype, jnp.integer):
        raise ValueError(f"captions must be integer token ids, got dtype {captions_CxT.dtype}")


def _at(a_CxT, pos_C):
    """a[c, ..., pos_c] for a [C, ..., T] array -> [C, ...]."""
    idx = pos_C.reshape(pos_C.shape + (1,) * (a_CxT.ndim - 1))
    return jnp.take_along_axis(a_CxT, idx, axis=-1)[..., 0]


def eot_patterns(params, captions_CxT):
    """Attention pattern of the EOT query row, every text layer and head.

    Args:
      params: one model's params (vmap for stacked models).
      captions_CxT: int caption tokens [C, T] (each with an EOT).

    The mask is `params["static"]["causal_text"]` (as trained; `families.dual_encoder.checks.with_static`
    makes a counterfactual, e.g. a bidirectional text tower).

    Returns:
      [C, Y, H, T] float: row `eot` of the forward's `text/pattern.{layer}`; each row is
      a probability vector over the keys (zero on keys after EOT under the causal mask).
    """
    captions_CxT = jnp.asarray(captions_CxT)
    _check_captions(captions_CxT)
    _, aux = encode_texts(params, captions_CxT)
    eot_C = eot_index(params["text"], captions_CxT)
    rows = []
    for layer in range(n_blocks(params["text"])):
        pat_CxHxTxT = aux[f"text/pattern.{layer}"]
        rows.append(jnp.take_along_axis(pat_CxHxTxT, eot_C[:, None, None, None], axis=2)[:, :, 0])
    return jnp.stack(rows, axis=1)


def first_mention_preference(params, captions_CxT, first_pos_C, second_pos_C) -> dict:
    """EOT attention to the first- vs the second-mentioned label token, per layer and head.

    Args:
      params: one model's params.
      captions_CxT: int caption tokens [C, T] (e.g. `pair_captions(...).tokens`).
      first_pos_C, second_pos_C: int [C] token positions of the two labels.

    The mask is the params' own, as in `eot_patterns`.

    Returns dict of [C, Y, H] arrays:
      first, second: EOT attention mass on the first / second label token.
      pref: first - second.
      logit: EOT-row logit difference (first key - second key).
      key_E, key_P (and key_R for layers > 0, zero in layer 0): the parts of `logit`
        from the keys' token rows, position rows and earlier layers' residual (query
        side summed over all its parts; the key bias cancels). They sum to `logit`.
    """
    captions_CxT = jnp.asarray(captions_CxT)
    _check_captions(captions_CxT)
    first_pos_C = jnp.asarray(first_pos_C)
    second_pos_C = jnp.asarray(second_pos_C)
    C = captions_CxT.shape[0]
    if first_pos_C.shape != (C,) or second_pos_C.shape != (C,):
        raise ValueError(
            f"first_pos / second_pos must be [C] = [{C}], got {first_pos_C.shape} and "
            f"{second_pos_C.shape}"
        )
    pat = eot_patterns(params, captions_CxT)  # [C, Y, H, T]
    first = _at(pat, first_pos_C)
    second = _at(pat, second_pos_C)
    parts = {"logit": [], "key_E": [], "key_P": [], "key_R": []}
    eot_C = eot_index(params["text"], captions_CxT)
    for layer in range(pat.shape[1]):
        t = decompose(params, captions_CxT, tower="text", layer=layer)

        def diff(a_CxHxSxS):
            row = jnp.take_along_axis(a_CxHxSxS, eot_C[:, None, None, None], axis=2)[:, :, 0]
            return _at(row, first_pos_C) - _at(row, second_pos_C)  # [C, H]

        queries = ("E", "P", "R", "B") if layer > 0 else ("E", "P", "B")
        parts["logit"].append(diff(t["logits"]))
        for k in ("E", "P", "R"):
            names = [q + k for q in queries if q + k in t]
            parts[f"key_{k}"].append(
                sum(diff(t[n]) for n in names) if names else jnp.zeros_like(first[:, layer])
            )
    out = {k: jnp.stack(v, axis=1) for k, v in parts.items()}
    return {"first": first, "second": second, "pref": first - second, **out}


def caption_groups(first_C, second_C, form_C, n_pair_labels, first_val_label):
    """Masks [G, C] of the caption groups `GROUPS`.

    seen: both labels in 1..n_pair_labels (the trained pairs); unseen: both labels
    >= first_val_label (validation labels, never in a training pair); mixed: the rest;
    form_left / form_right: every pair in that caption form. `n_pair_labels` may be a
    traced scalar (it varies between models of a sweep).
    """
    first_C, second_C, form_C = (jnp.asarray(a) for a in (first_C, second_C, form_C))
    seen = (first_C <= n_pair_labels) & (second_C <= n_pair_labels)
    unseen = (first_C >= first_val_label) & (second_C >= first_val_label)
    return jnp.stack(
        [
            jnp.ones_like(seen),
            seen,
            unseen,
            ~(seen | unseen),
            form_C == 0,
            form_C == 1,
        ]
    )


def preference_stats(pref: dict, masks_GxC) -> dict:
    """Per caption group, the mean / spread of `first_mention_preference` over captions.

    Args:
      pref: `first_mention_preference` output ([C, Y, H] arrays).
      masks_GxC: bool caption groups (`caption_groups`).

    Returns dict of [G, Y, H] arrays (NaN for an empty group): mean_pref, std_pref
    (over the group's label pairs: the label-dependence), frac_first (fraction of
    captions with pref > 0), mean_first, mean_second, key_P (mean), key_E_mean,
    key_E_std, n (captions in the group, [G]).
    """
    m = jnp.asarray(masks_GxC, jnp.float32)[:, :, None, None]  # [G, C, 1, 1]
    n = m.sum(1)  # [G, 1, 1]

    def mean(a):
        return (m * a[None]).sum(1) / n

    def std(a):
        mu = mean(a)
        return jnp.sqrt((m * (a[None] - mu[:, None]) ** 2).sum(1) / n)

    p = pref["pref"]
    return {
        "mean_pref": mean(p),
        "std_pref": std(p),
        "frac_first": mean((p > 0).astype(jnp.float32)),
        "mean_first": mean(pref["first"]),
        "mean_second": mean(pref["second"]),
        "key_P": mean(pref["key_P"]),
        "key_E_mean": mean(pref["key_E"]),
        "key_E_std": std(pref["key_E"]),
        "n": n[:, 0, 0],
    }


def head_roles(stats: dict, min_pref: float = 0.05, min_frac: float = 0.95):
    """Role per layer and head, int [Y, H] indexing `ROLES`.

    "first": the EOT row prefers the first-mentioned label by >= min_pref on average and
    in >= min_frac of the captions of *every* group (seen, unseen, mixed labels; each
    caption form), i.e. regardless of label and form; "second": the mirror image; else
    "none". Empty groups (NaN) are ignored. `stats` is one model's `preference_stats`
    ([G, Y, H]).
    """
    groups = jnp.asarray([GROUPS.index(g) for g in GROUPS if g != "all"])
    frac = stats["frac_first"][groups]
    lo = jnp.where(jnp.isnan(frac), jnp.inf, frac).min(axis=0)
    hi = jnp.where(jnp.isnan(frac), -jnp.inf, frac).max(axis=0)
    mean = stats["mean_pref"][GROUPS.index("all")]
    first = (lo >= min_frac) & (mean >= min_pref)
    second = (hi <= 1.0 - min_frac) & (mean <= -min_pref)
    return jnp.where(first, 1, jnp.where(second, 2, 0))


def text_head_table(
    params_K,
    captions: PairCaptions,
    n_pair_labels_K,
    first_val_label: int,
    *,
    min_pref: float = 0.05,
    min_frac: float = 0.95,
) -> dict:
    """`preference_stats` and `head_roles` for K stacked models.

    Args:
      params_K: stacked params (leading model axis K).
      captions: `pair_captions(n_labels, caption_mode)`.
      n_pair_labels_K: int [K], each model's training-pair labels (seen group).
      first_val_label: the first validation label (n_labels - n_val_labels + 1).

    Returns dict of [K, G, Y, H] stats, "role" [K, Y, H] int (`ROLES`), "n" [K, G], and
    "pref" [K, C, Y, H] (every caption's preference, for figures).
    """

    def one(args):
        params, n_pair = args
        pref = first_mention_preference(
            params, captions.tokens, captions.first_pos, captions.second_pos
        )
        masks = caption_groups(
            captions.first, captions.second, captions.form, n_pair, first_val_label
        )
        stats = preference_stats(pref, masks)
        return {**stats, "role": head_roles(stats, min_pref, min_frac), "pref": pref["pref"]}

    return jax.lax.map(one, (params_K, jnp.asarray(n_pair_labels_K)))
