"""The transformer pieces every loaded checkpoint family shares: pre-norm blocks with
rotary, grouped-query attention, the MLP (gated or not), RMSNorm / LayerNorm as the
reference computes them, the site recorder that applies `Edits` and keeps captures, the
causal LM stack with its resumable run (a key / value cache), the unembedding, and the
forward's tail every family shares: logits at the asked rows (`logits_at`), at each
prompt's answer row as a VLM view asks them (`answer_forward`) and as the checkpoint
contract's `next_token` gives them (`next_token_logprobs`).

Numerics as the Hugging Face reference: norms, the rotary rotation and the softmax in
float32, everything else in the params' dtype. Params in TransformerLens layout: a
block holds `W_Q, W_K, W_V` [H, D, Dh] (and `b_Q ...` [H, Dh] where the model has
biases), `W_O` [H, Dh, D], `ln1_w` / `ln2_w` (+ `_b` for LayerNorm), the MLP's `W_in`,
`W_out` (+ `W_gate` when gated, biases where present). Optional per-head q / k norms
(`q_norm_w`, `k_norm_w` [Dh], Qwen3's) act before the rotary.

Sites, per block i of a part ("vit", "lm"): `{part}/{point}.{i}` for point in
`POINTS` (`q, k, v` [B, N, H, Dh]; `attn_scores, pattern` [B, H, N, N]).

An LM's blocks are stacked (`lm["blocks"]`, `models.layout.BLOCKS`) and run under one
`lax.scan` (`stack`, `models.scan`: one compiled block), its edits and captures still
per site name.

Axis names (`jaxmech.shapes`): B sequences, N / S rows, D width, H heads, Dh head
width, R rotary pairs, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.models import layout
from jaxmech.models.attention import layer_norm as attention_layer_norm
from jaxmech.models.attention import rotate
from jaxmech.models.attention_core import by_head, core_by_head, staged
from jaxmech.models.edits import Edits
from jaxmech.models.order import low_precision, tie
from jaxmech.models.precision import choose, einsum, matmul
from jaxmech.models.scan import LAYER, has_rows, in_place, remat_of, scan_blocks

POINTS = (
    "resid_pre",
    "q",
    "k",
    "v",
    "rot_q",
    "rot_k",
    "attn_scores",
    "pattern",
    "z",
    "attn_out",
    "resid_mid",
    "mlp_out",
    "resid_post",
)
RESUME_SITES = ("lm/rot_k", "lm/v")  # what a `Resume` reads from its run (every block)
UNROTATED_POINTS = tuple(p for p in POINTS if p not in ("rot_q", "rot_k"))  # a ViT without rotary


def block_sites(part: str, n_blocks: int, points=POINTS) -> list[str]:
    """`{part}/{point}.{i}` for every block i < n_blocks, block by block: a part's sites
    in the order its forward names them."""
    return [f"{part}/{p}.{i}" for i in range(n_blocks) for p in points]


class Sites:
    """Applies the edits at each named site and keeps what `capture` asks for: True
    (every site), False (none) or names (a full name like "lm/resid_pre.3", or a name
    without its block like "lm/resid_pre" for every block). `remat`: what its scanned
    blocks keep for a backward (`models.scan.REMAT`; the config's `remat`)."""

    def __init__(self, edits: Edits, capture, remat: str = "off"):
        self.edits, self.capture, self.aux, self.remat = edits, capture, {}, remat

    def wants(self, name: str) -> bool:
        """Whether the capture asks for site `name`."""
        return self.capture is True or bool(
            self.capture and (name in self.capture or name.split(".")[0] in self.capture)
        )

    def edits_at(self, name: str) -> bool:
        return name in self.edits.replace or name in self.edits.add

    def captures(self, name: str) -> bool:
        return self.wants(name)

    def __call__(self, name: str, x):
        x = self.edits(name, x)
        if self.wants(name):
            self.aux[name] = x
        return x


def rms_norm(x, w, eps):
    """RMSNorm as Qwen2 / Llama: float32 statistics, then the weight in the input's dtype."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)
    return w * h.astype(x.dtype)


def layer_norm(x, w, b, eps):
    """LayerNorm (`models.attention`) in float32, back in the input's dtype."""
    return attention_layer_norm(x.astype(jnp.float32), w, b, eps).astype(x.dtype)


def norm(block, prefix, x, eps):
    """The block's norm `prefix`: LayerNorm where it has a bias `{prefix}_b`, else RMSNorm."""
    if f"{prefix}_b" in block:
        return layer_norm(x, block[f"{prefix}_w"], block[f"{prefix}_b"], eps)
    return rms_norm(x, block[f"{prefix}_w"], eps)


ACT = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def _rot(x, angles):
    """x [B, N, H, Dh] rotated by angles [B, N, R] in float32 (rotate-half layout)."""
    return rotate(x.astype(jnp.float32), angles[:, :, None, :]).astype(x.dtype)


def attention(block, x_in, angles, mask_BxNxN, site, part: str, i: int, cache=None,
              q_last=False, eps=1e-6):  # fmt: skip
    """One attention sublayer: [B, N, D] -> [B, N, D] (grouped-query where W_K has fewer
    heads than W_Q; biases where the block has them; per-head q / k RMSNorms
    `q_norm_w` / `k_norm_w` before the rotary where it has them). `angles` [B, N, R]
    (None: no rotary positions, and no `rot_q` / `rot_k` sites). `cache`: (rotated keys,
    values) of the positions before these N rows, which the rows also attend to
    (`Resume`). `q_last`: only the last row queries ([B, 1, D] out)."""

    def at(point, x):
        return site(f"{part}/{point}.{i}", x)

    def proj(w, x):
        y = einsum("bnd,hde->bnhe", x, block[f"W_{w}"])
        y = y + block[f"b_{w}"] if f"b_{w}" in block else y
        norm_w = block.get(f"{w.lower()}_norm_w")
        return y if norm_w is None else rms_norm(y, norm_w, eps)

    q_in = x_in[:, -1:] if q_last else x_in
    mask_BxNxN = mask_BxNxN[:, -1:] if q_last else mask_BxNxN
    q, k, v = at("q", proj("Q", q_in)), at("k", proj("K", x_in)), at("v", proj("V", x_in))
    if angles is not None:
        q_angles = angles[:, -1:] if q_last else angles
        q, k = at("rot_q", _rot(q, q_angles)), at("rot_k", _rot(k, angles))
    if cache is not None:
        k, v = (jnp.concatenate([c.astype(x.dtype), x], axis=1) for c, x in zip(cache, (k, v)))
    # grouped-query attention without copying k, v per query head: head h = c G + g
    # reads key / value head c (as the reference's repeat_kv)
    B, N, H, E = q.shape
    C = k.shape[2]
    qg = q.reshape(B, N, C, H // C, E)
    if by_head(N * k.shape[1]):  # on a CPU, one head at a time (`models.attention_core`)
        z = core_by_head(qg, k, v, mask_BxNxN, E**-0.5, at if staged(site, part, i) else None)
    else:
        scores = einsum("bqcge,bkce->bcgqk", qg, k).reshape(B, H, N, k.shape[1])
        scores = at("attn_scores", scores * E**-0.5)
        logits = jnp.where(mask_BxNxN[:, None], scores.astype(jnp.float32), -jnp.inf)
        pattern = at("pattern", jax.nn.softmax(logits, -1).astype(v.dtype))
        pg = pattern.reshape(B, C, H // C, N, k.shape[1])
        z = einsum("bcgqk,bkce->bqcge", pg, v).reshape(B, N, H, E)
    z = at("z", z)
    out = einsum("bqhe,hed->bqd", z, block["W_O"])
    return out + block["b_O"] if "b_O" in block else out


def mlp(block, x, act):
    """The MLP: W_out(act(x W_gate) * x W_in) when gated, else W_out(act(x W_in)); biases
    where the block has them."""

    def lin(w, b):
        y = matmul(x, block[w])
        return y + block[b] if b in block else y

    h = (
        act(lin("W_gate", "b_gate")) * lin("W_in", "b_in")
        if "W_gate" in block
        else act(lin("W_in", "b_in"))
    )
    y = matmul(h, block["W_out"])
    return y + block["b_out"] if "b_out" in block else y


# weights a product reads as stored ([D, M] / [M, D]): nothing of theirs is hoisted
# when their products run in their own dtype
READ_AS_STORED = ("W_in", "W_gate", "W_out", "W1", "W2")


def after(x, weights):
    """(x, weights), low-precision `weights` computed after `x` (`models.order.tie`):
    XLA's CPU backend would otherwise convert every block's weights to float32 at the
    start and hold them all (5.5 GB of scratch at Qwen2-VL-2B's size); tied, each
    block's copy is made when the block runs. Float32 weights pass untouched. With
    low-precision products (`models.precision`) nothing is converted, but the attention
    weights' relayout copies would be hoisted alike (the scratch grew by 0.8 of a block's
    bytes per block, measured): those are tied, the MLP's (`READ_AS_STORED`) not, as a
    tied copy costs a pass over the weights."""
    if not low_precision(weights):
        return x, weights
    narrowest = min(
        (w.dtype for w in jax.tree_util.tree_leaves(weights)),
        key=lambda d: jnp.dtype(d).itemsize if jnp.issubdtype(d, jnp.inexact) else 9,
    )
    if not choose(narrowest)[0]:
        return x, tie(weights, x)
    tied = tie({k: w for k, w in weights.items() if k not in READ_AS_STORED}, x)
    return x, {**weights, **tied}


def block_forward(
    block, x, angles, mask, site, part: str, i: int, eps, act, cache=None, q_last=False
):
    """One pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)), each sublayer's
    output scaled by a layer scale `ls1` / `ls2` [D] where the block has one
    (InternViT's); `q_last`: for the last row only ([B, 1, D] out; keys and values from
    every row)."""
    x, block = after(site(f"{part}/resid_pre.{i}", x), block)
    attn = attention(block, norm(block, "ln1", x, eps), angles, mask, site, part, i, cache,
                     q_last, eps)  # fmt: skip
    attn = attn * block["ls1"] if "ls1" in block else attn
    x = x[:, -1:] if q_last else x
    x = site(f"{part}/resid_mid.{i}", x + site(f"{part}/attn_out.{i}", attn))
    out = mlp(block, norm(block, "ln2", x, eps), act)
    out = site(f"{part}/mlp_out.{i}", out * block["ls2"] if "ls2" in block else out)
    return site(f"{part}/resid_post.{i}", x + out)


def place_images(emb_BxSxD, feats_BxIxD, image_BxI):
    """The LM's input: token embeddings with the image features at their positions."""
    b = jnp.arange(emb_BxSxD.shape[0])[:, None]
    return emb_BxSxD.at[b, image_BxI].set(feats_BxIxD.astype(emb_BxSxD.dtype))


def lm_mask(valid_BxS):
    """[B, S, S] causal attention to the valid tokens (and each token to itself, so a
    padding row stays finite)."""
    S = valid_BxS.shape[1]
    causal = jnp.tril(jnp.ones((S, S), bool))
    return causal & (valid_BxS[:, None, :] | jnp.eye(S, dtype=bool))


class Resume(NamedTuple):
    """Run the LM from block `layer` on the rows from `start` on only, with the rows
    before them read from a run that is the same there (incremental decoding's cache):

    x_BxTxD: the residual entering block `layer` at rows start..S-1 (T = S - start).
    aux: a run's intermediates holding `lm/rot_k.{i}` and `lm/v.{i}` of every block i >=
      layer (`RESUME_SITES`); their rows before `start` serve as those rows' keys and
      values. Right when the run and this one agree on every row before `start`: a
      causal LM's rows there do not see the rows changed.

    `start` is a Python int (static). `layer` a Python int, or a traced int32 scalar
    (one compiled LM for every layer, e.g. a patching table's `lax.map` over its
    layers: every block runs under the scan, those before `layer` skipped; `aux` must
    then hold every block's `RESUME_SITES`). The ViT and the blocks before `layer` are
    not run; the sites of the resumed blocks hold the T rows only (those of skipped
    blocks, with a traced `layer`, nothing meaningful)."""

    layer: Any
    start: int
    x_BxTxD: Any
    aux: dict


def is_static(layer) -> bool:
    """Whether a `Resume.layer` is a Python / NumPy int (not traced)."""
    return isinstance(layer, (int, np.integer))


def inv_freq(dim: int, theta: float) -> np.ndarray:
    """[dim / 2] float32, theta^(-2i / dim): the rotary pairs' frequencies."""
    return (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float32)


def run_lm(lm, x, angles_BxSxR, valid_BxS, n_layers: int, eps: float, site, resume=None,
           last_row: bool = False, act: str = "silu", between=None,
           n_between: int = 0):  # fmt: skip
    """[B, S, D] the final-normed residual stream of a causal LM's stacked blocks
    `lm["blocks"]` and final norm `lm["lnf_w"]` ([B, T, D] rows start.. when resumed;
    [B, 1, D] the last row with `last_row`: the last block's other rows are not run).
    `between(i, x, row0)`: what enters block i + 1 given block i's output x, whose first
    row is row0 of the sequence, for the blocks i < `n_between` (e.g. Qwen3-VL's
    DeepStack features added at the image tokens).

    The blocks run as `lax.scan`s (`models.scan`: one compiled block); the blocks with a
    `between` and the last block under `last_row` run on their own (`stack`)."""
    causal = lm_mask(jnp.asarray(valid_BxS, bool))
    first, s0 = (0, 0) if resume is None else (resume.layer, resume.start)
    angles, causal = angles_BxSxR[:, s0:], causal[:, s0:]

    def block(w, x, site_, i, c, q_last=False, layer=None):
        return block_forward(w, x, angles, causal, site_, "lm", i, eps, ACT[act], c, q_last)

    def after_block(i, x, q_last):
        if between is None or i >= n_between:
            return x
        return between(i, x, angles_BxSxR.shape[1] - 1 if q_last else s0)

    cache = functools.partial(resume_cache, resume)
    apart = n_between if between is not None else 0
    x = stack(lm, x, n_layers, first, site, block, after_block, cache, last_row, apart)
    return site("lm/final", rms_norm(x, lm["lnf_w"], eps))


def resume_cache(resume, i: int):
    """Block i's (keys, values) of the rows before `resume.start`, or None (no `Resume`,
    or one from row 0)."""
    if resume is None or not resume.start:
        return None
    return tuple(resume.aux[f"{n}.{i}"][:, : resume.start] for n in RESUME_SITES)


def stack(lm, x, n_layers: int, first, site, block, after_block, cache, last_row: bool,
          n_apart: int = 0):  # fmt: skip
    """x after an LM's blocks `first`..n_layers - 1 (`run_lm`'s and the families' own):
    `block(weights, x, site, i, cache_i, q_last=False, layer=None)` one block (i its
    index in site names: an int, or `models.scan.LAYER` under the scan; `layer` its
    index, an int or traced), `after_block(i, x, q_last)` what follows it,
    `cache(i)` its keys / values from a `Resume` or None. The blocks i < `n_apart` run
    on their own (with their `after_block`), the last one too under `last_row` (it runs
    the last row only), the others under one `lax.scan` (`models.scan.scan_blocks`).
    `first` may be traced (`Resume`): every block then runs, those before it skipped.
    Stacked low-precision weights on a CPU run unrolled (`models.scan.in_place`); rows
    (`layout.Rows`, what a loaded model holds there) scan, each block's read by a switch."""
    static = is_static(first)
    end = n_layers - 1 if last_row else n_layers
    lo = first if static else 0
    n_apart = n_apart if in_place(lm[layout.BLOCKS]) else end
    for i in range(lo, min(n_apart, end)):
        y = after_block(i, block(block_after(lm, i, x), x, site, i, cache(i), layer=i), False)
        x = y if static else jnp.where(i >= first, y, x)
    scanned = range(max(lo, min(n_apart, end)), end)
    if len(scanned):
        caches = [cache(i) for i in scanned]
        xs = None if caches[0] is None else jax.tree_util.tree_map(lambda *c: jnp.stack(c), *caches)

        def body(w, x, s, i, c):
            return block(w, x, s, LAYER, c, layer=i)

        x = scan_blocks(lm[layout.BLOCKS], x, scanned, body, site, xs, None if static else first,
                        remat_of(site))  # fmt: skip
    if last_row:
        i = n_layers - 1
        x = after_block(i, block(block_after(lm, i, x), x, site, i, cache(i), True, layer=i), True)
    return x


def block_after(lm, i: int, x):
    """Block i's weights (`models.layout.block`) for an unrolled loop, sliced from the
    stack after `x` exists (`models.order.tie`) when they are low-precision: XLA's CPU
    backend copies each static slice, and untied it makes every block's copies at the
    start (the MLP's too, which `after` leaves). Rows (`layout.Rows`, what a loaded
    model holds there: `models.scan.held_apart`) are read as they are, no slice made."""
    w = layout.block(lm, i)
    sliced = layout.is_stacked(lm) and not has_rows(lm[layout.BLOCKS])
    return tie(w, x) if sliced and low_precision(w) else w


def unembed(lm, x):
    """Logits of the rows `x` [..., D]: x W_U, or x E^T for tied embeddings. Not tied to
    `x` (`after`): a table's runs share one float32 copy of the unembedding, 0.9 GB at
    Qwen2-VL-2B's size, where tied ones would each make their own."""
    if "W_U" in lm:
        return matmul(x, lm["W_U"])
    return einsum("...d,vd->...v", x, lm["E"])


# the last block's sites that hold every row when that block queries the last row only
WHOLE_UNDER_LAST_ROW = ("resid_pre", "k", "v", "rot_k")


def needs_all_rows(capture, n_layers: int) -> bool:
    """Whether a capture asks for a site of the last LM block that only a run of every
    query row gives (True: every site; names: any of the last block's but
    `WHOLE_UNDER_LAST_ROW`, or `lm/final`)."""
    if capture is True:
        return True
    last = n_layers - 1
    for name in capture or ():
        part, _, block = name.partition(".")
        point = part.split("/", 1)[-1]
        if name == "lm/final" or (
            part.startswith("lm/") and block in ("", str(last)) and point not in
            WHOLE_UNDER_LAST_ROW + ("embed",)
        ):  # fmt: skip
            return True
    return False


def logits_at(lm, x_BxSxD, rows=None, resume: Resume | None = None, last_row: bool = False):
    """The forward's tail, every family's: logits [B, S, V] of the final-normed rows
    `x_BxSxD` (`run_lm`'s), or [B, V] at `rows` ([B] positions counted from 0, also when
    resumed from `resume.start`) or at the last row (`last_row`: `run_lm` ran it alone)."""
    if last_row:
        x_BxSxD = x_BxSxD[:, -1]
    elif rows is not None:
        start = 0 if resume is None else resume.start
        x_BxSxD = x_BxSxD[jnp.arange(x_BxSxD.shape[0]), jnp.asarray(rows) - start]
    return unembed(lm, x_BxSxD)


def answer_forward(forward, n_layers: int, params, inputs, edits=None, capture=False,
                   resume: Resume | None = None):  # fmt: skip
    """(logits [B, V] at each row's last token, the answer's position; aux) of a family's
    `forward(params, inputs, edits, *, capture, rows, resume, last_row)` (its config
    bound) with an LM of `n_layers` blocks: the last block runs that row only unless
    `capture` asks for one of its sites that needs every row (`needs_all_rows`). What a
    checkpoint's VLM view's `forward` is, for every family (rows left-padded, so the
    answer is the last row)."""
    whole = needs_all_rows(capture, n_layers)
    B, S = inputs.tokens_BxS.shape
    rows = jnp.full(B, S - 1, jnp.int32) if whole else None
    return forward(params, inputs, edits, capture=capture, rows=rows, resume=resume,
                   last_row=not whole)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("forward", "config"))
def _last_row_logprobs(params, inputs, forward, config):
    logits, _ = forward(params, inputs, config=config, last_row=True)
    return jax.nn.log_softmax(logits.astype("float32"), -1)


def next_token_logprobs(forward, config, params, encoded) -> np.ndarray:
    """[B, V] log-probabilities of the token after each prompt of `encoded` (a family's
    processor output; its `inputs`, rows left-padded) under the family's `forward` with
    `config` (one compiled call; the last block runs the last row only): the checkpoint
    contract's `next_token`, the first check that a checkpoint loaded right
    (`experiments.ask`)."""
    return np.asarray(_last_row_logprobs(params, encoded.inputs, forward, config))
