"""Steering a VLM with its spatial IDs (paper 003), for any family.

At one LM site `lm/resid_pre.{y}`, add to the object word X's residual (its last
sub-token, `Spans.x_B`) the ID difference

    alpha * (Delta_y(target) - Delta_y(source))

where `Delta_y` is the model's spatial ID (`analysis.spatial_ids.spatial_ids`), source
is X's true cell and target a chosen cell: the model should then answer as if X stood
at the target. `alpha` multiplies the raw ID difference (the paper's convention, where
5 was its grid-searched value); the report also gives the added vector's norm relative
to the residual's, so alphas can be compared across models.

Controls, each matched per example to the steering vector's norm: Gaussian noise, and
a Gaussian direction projected off the ID subspace (`id_span_projector`: the span of
`Delta_y` over the cells that holds `energy` of its variance).

The authors' protocol (their adversarial script; `authors_margins`), beside it: the
direction `Delta_y(target) - Delta_y(source)` rescaled to `AUTHORS_SCALE` times the norm
of the unsteered residual at that token, added to X's word and, in the opposite
direction, to Y's; each LM site steered on its own; a flip is any sign change of the
margin logp(answer) - logp(other) (= the logit margin), counted over all examples, right
or wrong; the summary is the mean over the `TOP_LAYERS` sites of highest ID flip rate,
the controls read at those same sites (`top_sites_mean`).

A family enters only through its VLM view (`families.vlm_view`).

Axis names (`jaxmech.shapes`): B examples, S LM tokens, L cells, D d_model, V
vocabulary, A alphas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmech.analysis import spatial_ids as si
from jaxmech.data.spec import RELATIONS
from jaxmech.families.vlm_view import VLMView, margin, model_outline, over_models, rows_at
from jaxmech.models.edits import Edits

KINDS = ("id", "noise", "orthogonal")
AUTHORS_SCALE = 5.0  # the authors' script: 5 x the unsteered activation's norm
TOP_LAYERS = 3  # their summary: the mean flip rate of the 3 best layers
ALPHAS = (0.5, 1.0, 2.0, 5.0, 10.0)
REF_ALPHA = 5.0  # the paper's grid-searched value
CURVE_ALPHA = 1.0  # moving X's ID exactly to the target's (no extrapolation)
PAPER_CURVE_ALPHA = REF_ALPHA  # the paper's ID-curve figure steers at alpha 5


def at_word(vectors_BxD, pos_B, length: int):
    """[B, S, D]: each example's vector at its position pos_B[b], zeros elsewhere."""
    B, D = vectors_BxD.shape
    out = jnp.zeros((B, length, D), vectors_BxD.dtype)
    return out.at[jnp.arange(B), jnp.asarray(pos_B)].set(vectors_BxD)


def steered_logits(view: VLMView, params, inputs, spans, site: int, vectors_BxD, pos_B=None,
                   clean_aux=None):  # fmt: skip
    """[B, V] the logits with `vectors_BxD` added to `lm/resid_pre.{site}` at each
    example's position `pos_B` (default: X's word; a zero vector is a no-op)."""
    pos_B = spans.x_B if pos_B is None else pos_B
    return add_forward(view, params, inputs, site, at_word(vectors_BxD, pos_B, spans.length),
                       pos_B, clean_aux)  # fmt: skip


def add_forward(view: VLMView, params, inputs, site: int, add_BxSxD, pos, clean_aux=None):
    """[B, V] the logits with `add_BxSxD` added to `lm/resid_pre.{site}`, nonzero only
    at positions `pos` ([B] or a list of [B]). Where the view has `forward_from`,
    `clean_aux` (the `unsteered` run's intermediates) is given and the positions are
    concrete, the run resumes at that site from the first of them: the rows before it
    are the clean run's (a causal LM), so only the rows after are run."""
    name = f"lm/resid_pre.{site}"
    first = _first_row(pos) if view.forward_from is not None and clean_aux is not None else None
    if first is None:
        return view.forward(params, inputs, Edits(add={name: add_BxSxD}))[0]
    x = clean_aux[name][:, first:] + add_BxSxD[:, first:]
    return view.forward_from(params, inputs, site, first, x, clean_aux)


def _first_row(pos):
    """The smallest of concrete positions `pos` ([B] or a list of [B]), None if traced."""
    try:
        return int(min(np.min(np.asarray(p)) for p in (pos if isinstance(pos, list) else [pos])))
    except jax.errors.TracerArrayConversionError:
        return None


def id_span_projector(delta_LxD, energy: float = 0.99):
    """[D, D] the orthogonal projector onto the fewest principal directions of the ID
    (rows of `delta_LxD`, uncentred) that hold `energy` of its squared norm."""
    _, s, vt = jnp.linalg.svd(delta_LxD, full_matrices=False)
    share = jnp.cumsum(s**2) / jnp.maximum(jnp.sum(s**2), 1e-30)
    keep = jnp.concatenate([jnp.ones(1, bool), share[:-1] < energy])
    v = vt.T * keep[None, :]
    return v @ v.T


def matched_noise(key, like_BxD, projector_DxD=None):
    """[B, D] Gaussian directions with the norms of `like_BxD`'s rows; with a
    projector P, drawn in the complement of P's range (orthogonal to it)."""
    z = jax.random.normal(key, like_BxD.shape, like_BxD.dtype)
    if projector_DxD is not None:
        z = z - z @ projector_DxD
    norm = jnp.linalg.norm(like_BxD, axis=-1, keepdims=True)
    return z * norm / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-30)


def unsteered(view: VLMView, params, ex, batch=None):
    """(logits [B, V], intermediates) of the examples' plain forward, which every site's
    steering starts from (`flip_margins`, `authors_margins`: pass it as `clean`): the
    residual entering every LM block and the view's `cache_sites` (to resume from);
    `batch` examples at a time (`spatial_ids.map_chunks`; None: all at once)."""

    def chunk(rows):
        inputs = si.take_rows(ex.inputs, rows)
        return view.forward(params, inputs, capture=["lm/resid_pre", *view.cache_sites])

    return si.map_chunks(chunk, np.shape(ex.answer_B)[0], batch)


def flip_margins(view, params, ex, site, delta_LxD, source_B, target_B, alphas, key, clean=None) -> dict:  # fmt: skip
    """Answer margins under ID steering and its two norm-matched controls.

    Args:
      view: the family's VLM view; params: one model's params; ex: the examples
        (`Examples`: inputs, spans, answer and other word [B]); site: y in
        `lm/resid_pre.{y}` (a Python int: static under jit).
      delta_LxD: the model's ID at that site; source_B, target_B: cells (X's own cell,
        the cell to steer it to).
      alphas: [A] multipliers; key: PRNG key of the controls.
      clean: the examples' `unsteered` forward (computed here when None).

    Returns:
      {"plain": [B], kind: [A, B] for kind in KINDS} margins (`margin`); "rel_norm"
      [A, B]: |added vector| / |X's residual at the site|.
    """
    plain, aux = unsteered(view, params, ex) if clean is None else clean
    x_BxD = rows_at(aux[f"lm/resid_pre.{site}"], ex.spans.x_B)
    step_BxD = delta_LxD[target_B] - delta_LxD[source_B]
    projector = id_span_projector(delta_LxD)
    k_noise, k_orth = jax.random.split(key)
    noise = matched_noise(k_noise, step_BxD)
    orth = matched_noise(k_orth, step_BxD, projector)

    def at(alpha):
        return {
            kind: margin(
                steered_logits(
                    view, params, ex.inputs, ex.spans, site, alpha * v, clean_aux=aux
                ),  # fmt: skip
                ex.answer_B,
                ex.other_B,
            )
            for kind, v in zip(KINDS, (step_BxD, noise, orth))
        }

    out = jax.lax.map(at, jnp.asarray(alphas, jnp.float32))
    rel = jnp.linalg.norm(step_BxD, axis=-1) / jnp.maximum(jnp.linalg.norm(x_BxD, axis=-1), 1e-30)
    return out | {
        "plain": margin(plain, ex.answer_B, ex.other_B),
        "rel_norm": jnp.asarray(alphas, jnp.float32)[:, None] * rel[None],
    }


def authors_vectors(delta_LxD, source_B, target_B, norms_B, scale: float):
    """[B, D] `scale * norms_B[b]` times the unit ID difference Delta(target) - Delta(source)."""
    u = delta_LxD[target_B] - delta_LxD[source_B]
    unit = u / jnp.maximum(jnp.linalg.norm(u, axis=-1, keepdims=True), 1e-30)
    return scale * jnp.asarray(norms_B)[:, None] * unit


def authors_margins(view, params, ex, site, delta_LxD, source_B, target_B, scale, key, clean=None) -> dict:  # fmt: skip
    """The authors' steering at one site (module docstring): {"plain": [B], kind: [B]}
    margins with X's word moved towards `target_B` and Y's word the opposite way, each
    by `scale` x its own residual's norm; the controls at the same words and norms.
    `clean`: the examples' `unsteered` forward (computed here when None)."""
    plain, aux = unsteered(view, params, ex) if clean is None else clean
    resid = aux[f"lm/resid_pre.{site}"]
    words = (ex.spans.x_B, ex.spans.y_B)
    vecs = [
        sign * authors_vectors(delta_LxD, source_B, target_B, jnp.linalg.norm(rows_at(resid, w), axis=-1), scale)
        for sign, w in zip((1.0, -1.0), words)
    ]  # fmt: skip
    projector = id_span_projector(delta_LxD)
    keys = jax.random.split(key, 4)
    controls = {
        "id": vecs,
        "noise": [matched_noise(keys[i], v) for i, v in enumerate(vecs)],
        "orthogonal": [matched_noise(keys[2 + i], v, projector) for i, v in enumerate(vecs)],
    }

    def steered(pair):
        add = sum(at_word(v, w, ex.spans.length) for v, w in zip(pair, words))
        logits = add_forward(view, params, ex.inputs, site, add, list(words), aux)
        return margin(logits, ex.answer_B, ex.other_B)

    return {k: steered(controls[k]) for k in KINDS} | {
        "plain": margin(plain, ex.answer_B, ex.other_B)
    }


def answer_corners(plain_BxV, words_Rx2, relation_B, grid_h: int, grid_w: int):
    """([B] source cell, [B] target cell, [B] bool counted): the authors' steering
    against the model's own answer with fixed corner IDs (`adversarial_steering.py`,
    the response tests at lines 77-121). The answer is the top token over the whole
    vocabulary; the relation's first word (left / above): X steered from cell (0, 0)
    towards the far corner along the relation ((0, W - 1) for left / right, (H - 1, 0)
    for above / below: their `ID(3, 0) - ID(0, 0)`, `ID(0, 3) - ID(0, 0)`), Y the other
    way (`authors_margins`); the second word: from that corner to (0, 0); any other
    top token is ambiguous: not counted (their `return None`)."""
    top = jnp.argmax(plain_BxV, axis=-1)
    w = jnp.asarray(words_Rx2)[jnp.asarray(relation_B)]
    first, second = top == w[:, 0], top == w[:, 1]
    far = jnp.where(jnp.asarray(relation_B) == 0, grid_w - 1, (grid_h - 1) * grid_w)
    return jnp.where(first, 0, far), jnp.where(first, far, 0), first | second


# the authors' response tests in their order (`adversarial_steering.py` 86-124): a reply
# holding the first word and not the second is steered as having answered the first
REPLY_TESTS = (("right", "left"), ("left", "right"), ("above", "below"), ("below", "above"))
REPLY_WORDS = ("left", "right", "above", "below")  # `token_directions`' indices


def reply_direction(text: str) -> str | None:
    """The word the authors steer a reply `text` against (`REPLY_TESTS` on the
    lower-cased text, substrings as theirs: "leftmost" holds "left"), whatever the
    question's relation; None: not steered (their `return None`)."""
    t = text.lower()
    return next((a for a, b in REPLY_TESTS if a in t and b not in t), None)


def token_directions(texts) -> np.ndarray:
    """[V] int32 per vocabulary entry (its decoded `texts`) the index in `REPLY_WORDS`
    of its `reply_direction` (-1: none): a one-token reply's direction as a table."""
    return np.asarray([REPLY_WORDS.index(d) if (d := reply_direction(t)) else -1
                       for t in texts], np.int32)  # fmt: skip


def reply_corners(plain_BxV, directions_V, grid_h: int, grid_w: int):
    """([B] source cell, [B] target cell, [B] bool counted): `answer_corners` with the
    answer read as the authors read a reply (`reply_direction`, here of the top token:
    `directions_V` from `token_directions`): "left" / "right" steer along the row and
    "above" / "below" along the column whatever the question's relation, so a "left" to
    an above / below question is steered along x, as their script does."""
    top = jnp.argmax(plain_BxV, axis=-1)
    d = jnp.take(jnp.asarray(directions_V), top, mode="fill", fill_value=-1)
    return direction_corners(d, grid_h, grid_w)


def direction_corners(d_B, grid_h: int, grid_w: int):
    """([B] source cell, [B] target cell, [B] bool counted) of each reply's direction
    d_B (an index into `REPLY_WORDS`, -1: none, not counted): "left" / "above" steer X
    from (0, 0) to the far corner along the row / column, "right" / "below" back."""
    d = jnp.asarray(d_B)
    far = jnp.where(d < 2, grid_w - 1, (grid_h - 1) * grid_w)
    first = (d == 0) | (d == 2)  # left / above: X from (0, 0) to the far corner
    return jnp.where(first, 0, far), jnp.where(first, far, 0), d >= 0


def steered_replies(view: VLMView, params, ex, site: int, delta_LxD, source_B, target_B,
                    max_new_tokens: int, clean, scale: float = AUTHORS_SCALE,
                    norms=None, model: int | None = None):  # fmt: skip
    """The greedy replies (`view.generate`'s `Generation`) with the authors' steering at
    `site` on the prompt's forward (their hooks: X's word moved `scale` x its own norm
    towards `target_B`, Y's the other way, `authors_margins`' ID vectors); `clean`: the
    examples' `unsteered` forward, whose residual gives the norms; `norms`: (X's, Y's)
    [B] norms to use instead (the authors' over prompt and reply: `reports.steering`;
    `clean` then unread, may be None); `model`: an index into params stacked over
    models (`view.generate`'s)."""
    words = (ex.spans.x_B, ex.spans.y_B)
    if norms is None:  # each word's state in the prompt
        resid = clean[1][f"lm/resid_pre.{site}"]
        norms = [jnp.linalg.norm(rows_at(resid, w), axis=-1) for w in words]
    add = sum(
        at_word(sign * authors_vectors(delta_LxD, source_B, target_B, n, scale), w,
                ex.spans.length)
        for sign, w, n in zip((1.0, -1.0), words, norms)
    )  # fmt: skip
    edits = Edits(add={f"lm/resid_pre.{site}": add})
    return view.generate(params, ex.inputs, max_new_tokens=max_new_tokens, edits=edits,
                         model=model)  # fmt: skip


def sign_flips(plain_B, steered_B) -> jax.Array:
    """[B] bool: the margin changed sign (the authors' flip: right or wrong before)."""
    return (jnp.asarray(plain_B) > 0) != (jnp.asarray(steered_B) > 0)


def top_sites_mean(id_rate_KxY, control_rates: dict, n: int = TOP_LAYERS) -> dict:
    """{"id": [K], kind: [K]}: per model the mean ID flip rate over its `n` sites of
    highest ID flip rate, and each control's mean over those same sites."""
    rate = np.asarray(id_rate_KxY)
    top = np.argsort(-rate, axis=1, kind="stable")[:, : min(n, rate.shape[1])]
    pick = lambda r: np.take_along_axis(np.asarray(r), top, axis=1).mean(1)  # noqa: E731
    return {"id": pick(rate)} | {k: pick(v) for k, v in control_rates.items()}


def id_curve(view, params, ex, site, delta_LxD, source_B, alpha, words, clean=None):
    """[L, B, W] the logits of `words` (token ids [W]) with X steered from its cell to
    every cell in turn (`alpha * (Delta(target) - Delta(source))`); `clean`: the
    examples' `unsteered` forward (resumed from where the view allows)."""
    words = jnp.asarray(words)
    aux = None if clean is None else clean[1]

    def to(target):
        v = alpha * (delta_LxD[target] - delta_LxD[source_B])
        return steered_logits(view, params, ex.inputs, ex.spans, site, v, clean_aux=aux)[:, words]

    return jax.lax.map(to, jnp.arange(delta_LxD.shape[0]))


def adversarial_targets(cells_Nx3, relation_N, grid_h: int, grid_w: int,
                        first_N=None) -> np.ndarray:  # fmt: skip
    """[N] the cell X is steered to: the far column on the other side of Y in X's row
    (left/right questions), the far row on the other side of Y in X's column
    (above/below). Which side Y is on: from the cells; where they tie along the
    relation (a photograph's box centres in one column), from `first_N` (X is left of /
    above Y: the answer), when given."""
    (xr, xc), (yr, yc) = np.divmod(cells_Nx3[:, 0], grid_w), np.divmod(cells_Nx3[:, 1], grid_w)
    rel = np.asarray(relation_N)
    first = np.where(rel == 0, xc < yc, xr < yr)
    if first_N is not None:
        first = np.where(np.where(rel == 0, xc == yc, xr == yr), first_N, first)
    h_col = np.where(first, grid_w - 1, 0)
    v_row = np.where(first, grid_h - 1, 0)
    return np.where(relation_N == 0, xr * grid_w + h_col, v_row * grid_w + xc).astype(np.int32)


AGAINST = ("truth", "answer", "reply", "given")  # the authors' steering's directions


def _check_against(against: str, directions, corners) -> None:
    """`steer_models`' `against` with exactly the inputs it reads (ValueError naming
    them): `directions` with "reply", `corners` with "given"."""
    if against not in AGAINST:
        raise ValueError(f"against = {against!r}: expected 'truth', 'answer', 'reply' or 'given'")
    if (against == "given") != (corners is not None):
        raise ValueError("corners: given exactly when against = 'given' (source, target, "
                         "counted)")  # fmt: skip
    if (against == "reply") != (directions is not None):
        raise ValueError("directions: given exactly when against = 'reply' (the vocabulary's "
                         "`token_directions`)")  # fmt: skip


def _authors_corners(view: VLMView, ex, plain_BxV, against: str, source_B, target_B,
                     directions, corners) -> tuple:  # fmt: skip
    """(source [B], target [B], counted [B]) of the authors' steering `against` (see
    `steer_models`), from the plain run's logits `plain_BxV` where it reads them."""
    if against == "answer":
        words = view.answer_words[:2]
        return answer_corners(plain_BxV, words, ex.spec.relation_B, *view.grid)
    if against == "reply":
        return reply_corners(plain_BxV, directions, *view.grid)
    if against == "given":
        return tuple(jnp.asarray(c) for c in corners)
    return source_B, target_B, jnp.ones(len(source_B), bool)


def steer_models(
    view: VLMView,
    params_K,
    ex,
    source_B,
    target_B,
    seed: int = 0,
    labels=None,
    sites=None,
    probe_batch=None,
    call=None,
    against: str = "truth",
    factorial: bool = False,
    directions=None,
    corners=None,
) -> dict:
    """Per model and LM site y >= 1 (before it the object word has seen no image):
    flip margins (`flip_margins` at `ALPHAS`) [K, Y', ...] and the ID curves' logits of
    the four spatial answer words [K, Y', L, B, 4] (`id_curve` at `CURVE_ALPHA`; at
    `PAPER_CURVE_ALPHA` under "curves_paper"), the
    authors' protocol's margins [K, Y', B] (`authors_margins` at `AUTHORS_SCALE`), with
    the examples' relations and the IDs `delta` [K, Y, L, D] of every site, from probe
    scenes of `labels` (`spatial_ids.probe`; default every label: a caller with
    training labels passes those, as the paper's universal ID). `sites`: the LM sites
    steered (default every y >= 1); `probe_batch`: scenes per chunk of the IDs' probe
    forward (`spatial_ids.word_states`) and of the examples' plain one (`unsteered`);
    `call(fn, args)`: how the one program runs (default jitted, results on the host;
    a report's logs its compile and compute times). `against`: the direction of the
    authors' protocol's steering, "truth" (X from its cell to beyond Y: `source_B`,
    `target_B`) or "answer" (against the model's own answer with fixed corner IDs,
    ambiguous answers not counted: `answer_corners`) or "reply" (the top token read as
    their script reads a reply, `reply_corners` over `directions` [V], `token_directions`
    of the tokenizer's vocabulary) or "given" (`corners`: ([B] source, [B] target, [B]
    counted), e.g. a generated reply's `direction_corners`); its margins carry
    "counted" [K, Y', B].
    `factorial`: the IDs' probes put the other object at every other cell
    (`spatial_ids.probe`, the authors' extraction)."""
    _check_against(against, directions, corners)
    call = call or (lambda fn, args: jax.device_get(jax.jit(fn)(*args)))
    labels = range(1, view.n_labels + 1) if labels is None else labels
    pr = si.probe(view, labels, factorial=factorial)
    n_blocks = view.n_lm_blocks(model_outline(params_K))
    sites = range(1, n_blocks) if sites is None else sites
    words = np.asarray(view.answer_words)[:2].ravel()  # left, right, above, below
    L = view.grid.cells

    def one_model(args, inputs):  # the rendered inputs arguments, not folded constants
        (p, key), ex_ = args, ex._replace(inputs=inputs[1])
        states = si.word_states(view, p, inputs[0], pr.spans.x_B, probe_batch)
        delta = si.spatial_ids(states, pr.label_N, pr.cell_N, L)
        clean = unsteered(view, p, ex_, probe_batch)  # one plain forward serves every site
        a_src, a_tgt, counted = _authors_corners(view, ex, clean[0], against, source_B,
                                                 target_B, directions, corners)  # fmt: skip
        out = [
            (
                flip_margins(view, p, ex_, y, delta[y], source_B, target_B, ALPHAS, key, clean),
                id_curve(view, p, ex_, y, delta[y], source_B, CURVE_ALPHA, words, clean),
                id_curve(view, p, ex_, y, delta[y], source_B, PAPER_CURVE_ALPHA, words, clean),
                authors_margins(view, p, ex_, y, delta[y], a_src, a_tgt, AUTHORS_SCALE, key, clean)
                | {"counted": counted},
            )
            for y in sites
        ]
        stack = lambda *xs: jnp.stack(xs)  # noqa: E731
        return (*jax.tree_util.tree_map(stack, *out), delta)

    k = len(jax.tree_util.tree_leaves(params_K)[0])
    keys = jax.random.split(jax.random.PRNGKey(seed), k)
    models = lambda a, x: over_models(lambda m: one_model(m, x), a)  # noqa: E731
    flips, curves, paper_curves, authors, delta = call(
        models, ((params_K, keys), (pr.inputs, ex.inputs))
    )
    return {
        "flips": flips,
        "curves": curves,
        "curves_paper": paper_curves,
        "authors": authors,
        "relation": np.asarray(ex.spec.relation_B),
        "delta": np.asarray(delta),
    }


def flip_rates(res: dict) -> dict:
    """{(kind, relation): [K, Y', A] flip rates}, {("flips", kind, relation): [K, Y', A,
    B]} each example's flip (NaN: not counted, i.e. not right before steering), {("n",
    relation): [K, Y']} answers right before steering, {("rel_norm", relation): [K,
    Y', A]} mean relative norms."""
    f = res["flips"]
    right = f["plain"] > 0  # [K, Y', B]
    out = {}
    for r, name in enumerate(RELATIONS):
        w = right & (res["relation"] == r)[None, None]
        n = w.sum(-1)
        out[("n", name)] = n
        den = np.maximum(n, 1)[..., None]
        for kind in KINDS:
            flipped = w[:, :, None] & (f[kind] < 0)
            # no example right before steering: the rate is empty (NaN), not a zero
            out[(kind, name)] = np.where(n[..., None] > 0, flipped.sum(-1) / den, np.nan)
            out[("flips", kind, name)] = np.where(w[:, :, None], flipped, np.nan)
        out[("rel_norm", name)] = (f["rel_norm"] * w[:, :, None]).sum(-1) / den
    return out


def authors_flip_rates(res: dict) -> dict:
    """{(kind, relation): [K, Y']} the authors' flip rates (any sign change, over the
    relation's counted examples: all, or those with an unambiguous answer when steered
    against it), {("flips", kind, relation): [K, Y', B]} each example's flip (NaN: not
    counted), {("n", relation): [K, Y']} the counts and {("top", relation):
    `top_sites_mean`}. Where the margins carry "reply_flip" [K, Y', B] (generated
    replies judged as the authors' `compute_coco_stats.py`: a verdict change), that is
    the ID steering's flip; the controls' stay sign changes of the margin."""
    a = res["authors"]
    counted = np.asarray(a.get("counted", np.ones_like(a["plain"], bool)), bool)
    out = {}
    for r, name in enumerate(RELATIONS):
        w = counted & (res["relation"] == r)
        out[("n", name)] = w.sum(-1)
        for kind in KINDS:
            flips = a["reply_flip"] if kind == "id" and "reply_flip" in a else sign_flips(a["plain"], a[kind])  # fmt: skip
            f = np.where(w, np.asarray(flips), np.nan)
            out[("flips", kind, name)] = f
            n = np.maximum(w.sum(-1), 1)
            out[(kind, name)] = np.where(w.any(-1), np.nansum(f, -1) / n, np.nan)
        controls = {k: out[(k, name)] for k in KINDS if k != "id"}
        out[("top", name)] = top_sites_mean(out[("id", name)], controls)
    return out
