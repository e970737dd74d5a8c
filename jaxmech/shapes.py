"""The axis vocabulary of jaxmech, and small validators for concrete inputs.

Glossary (shape suffixes: `x_BxSxD` is an array of shape [B, S, D]; one letter, one
meaning, everywhere in `models/` and `analysis/`):

  K   models (the stacked-seeds axis of params, settings and results)
  B   batch rows: images, or the sequences a tower runs on (never a bias)
  C   captions (rows of a caption table or of a caption batch)
  L   image length (pixels)
  T   caption length (tokens)
  S   sequence positions of the tower being run: L + 1 in vision (CLS first), T in text
  Q   query rows a block computes: S, or 1 on the readout-only path
  D   d_model (the residual stream)
  H   attention heads
  Dh  d_head (one two-letter code)
  M   d_mlp (the MLP hidden width)
  Z   d_embed, the width of the output embedding (after W_proj)
  W   the width of a set of vectors being compared (`analysis.align`: d_model for
      token rows, d_embed for tower outputs)
  V   vocabulary size (rows of a tower's E)
  Y   blocks (layers) of a tower
  R   rotary frequency pairs, Dh / 2
  A   stacked edits (ablations) evaluated in one call
  G   caption groups (`analysis.text_heads`)
  F   caption forms of one image (left / right wording) in evaluation
  N   rows of a set of items: evaluation rows, or labels where a set has one row per
      label (`analysis.probes`, `analysis.align`)
  I   distinct images of an evaluation set (rows of a set index them); in a VLM's
      spans (`families.vlm_view.Spans`), its image tokens in the LM's sequence
  P   a VLM's ViT tokens (patches; the toy's are its cells, L)
  J   fit labels of a Procrustes fit (`analysis.align`)
  U   held-out (test) labels
  O   random orthogonal maps (controls)

Names that are not axes: the logit-term names of `models.edits.TERMS` and
`analysis.decompose` ("EE", "EP", "BP", "XX", "QP", ...) name input parts (E token
rows, P position rows, B biases, R earlier layers' residual, X = E + P); they are
dictionary keys, never shape letters, even where a letter coincides.

Validators: the public functions of `models` and `analysis` check their inputs before
tracing. Every check here inspects shapes and dtypes always (they are static, also
under `jax.jit`) and values only when the array is concrete (not a tracer), so the
checked functions stay jittable and vmappable; under a trace, value checks are skipped.
Errors are `ValueError`s that name the argument, the value seen and what was expected.
"""

from __future__ import annotations

import jax
import numpy as np


def is_concrete(x) -> bool:
    """Whether `x` holds values now (a NumPy / jax array or a Python number, no tracer)."""
    return not isinstance(x, jax.core.Tracer)


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def check_ndim(name: str, x, ndims: tuple[int, ...], expected: str) -> None:
    """Raises unless `x.ndim` is one of `ndims`; `expected` reads like "[B, L] int ids"."""
    if np.ndim(x) not in ndims:
        raise ValueError(f"{name} has shape {_shape(x)}: expected {expected}")


def check_int_array(
    name: str, x, ndim: int, lo=None, hi=None, expected: str = "", note: str = ""
) -> None:
    """Checks an integer array of `ndim` dims whose concrete values lie in [lo, hi].

    `lo` / `hi` None: open on that side (inclusive bounds). `expected` describes the
    array in the shape message (e.g. "[B, L] int pixel ids"); `note` is appended to the
    range message. Raises ValueError.
    """
    expected = expected or f"an int array with {ndim} dims"
    check_ndim(name, x, (ndim,), expected)
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{name} has dtype {dtype}: expected {expected}")
    check_range(name, x, lo, hi, note)


def check_range(name: str, x, lo=None, hi=None, note: str = "") -> None:
    """Raises if a concrete `x` has a value outside [lo, hi] (inclusive; None: open).

    `note` is appended to the message (e.g. what the ids mean).
    """
    if not is_concrete(x) or np.size(x) == 0:
        return
    a = np.asarray(x)
    bad = None
    if lo is not None and a.min() < lo:
        bad = a.min()
    elif hi is not None and a.max() > hi:
        bad = a.max()
    if bad is not None:
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise ValueError(f"{name} contains {bad}: expected values in [{lo_s}, {hi_s}]{note}")


def check_positions(name: str, x, length: int, batch: int, lo=None, hi=None) -> None:
    """Position ids: shape [length] or [batch, length]; concrete values in [lo, hi]."""
    shape = _shape(x)
    if shape not in ((length,), (batch, length)):
        raise ValueError(
            f"{name} has shape {shape}: expected [{length}] or [{batch}, {length}] "
            "(one position per sequence element, optionally one row per input)"
        )
    check_range(name, x, lo, hi)
