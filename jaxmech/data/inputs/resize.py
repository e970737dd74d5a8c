"""Resizing a photograph as a checkpoint's reference processor does.

transformers' default image processors (the "fast" ones, `TorchvisionBackend`) resize
a uint8 image with torchvision's `resize(..., BICUBIC, antialias=True)`, which on uint8
runs torch's Pillow-SIMD-derived kernel: the antialiased Keys cubic (a = -0.5, its
support widened by the scale when shrinking), weights computed in float64, normalised,
then scaled to int16 fixed point at the largest precision that keeps the largest weight
below 2^15; the width resampled first, rounded and clipped to uint8, then the height;
an axis whose size is kept is not touched. `resize_bicubic(..., "torchvision")` does
exactly that in NumPy integers (equal to torchvision 0.29's output, every value, on the
fixture cases: `tests/fixtures/resize`). Their PIL backend (`...ImageProcessorPil`)
resizes with Pillow's BICUBIC (the same filter, 22-bit int32 weights): `"pil"`. The
two differ by a level or two in a few values per thousand, more where the width grows
and the height shrinks. `resize_bilinear` is the same kernel with the triangle filter
(support 1, widened alike; torchvision's BILINEAR, Pillow's BILINEAR): Gemma-3's processor.
"""

from __future__ import annotations

import numpy as np

BACKENDS = ("torchvision", "pil")  # the reference's default first


def resize_bicubic(x_HxWx3: np.ndarray, height: int, width: int,
                   backend: str = "torchvision") -> np.ndarray:  # fmt: skip
    """uint8 [height, width, 3] of uint8 RGB `x` resized as `backend` does (docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"resize = {backend!r}: expected one of {', '.join(BACKENDS)}")
    x = np.asarray(x_HxWx3)
    if backend == "pil":
        from PIL import Image

        return np.asarray(Image.fromarray(x).resize((width, height), Image.BICUBIC))
    y = x
    if width != x.shape[1]:
        y = _resample(y, 1, width)
    if height != x.shape[0]:
        y = _resample(y, 0, height)
    return y


def resize_bilinear(x_HxWx3: np.ndarray, height: int, width: int,
                    backend: str = "torchvision") -> np.ndarray:  # fmt: skip
    """uint8 [height, width, 3] of uint8 RGB `x` resized with the antialiased triangle
    filter as `backend` does (module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"resize = {backend!r}: expected one of {', '.join(BACKENDS)}")
    x = np.asarray(x_HxWx3)
    if backend == "pil":
        from PIL import Image

        return np.asarray(Image.fromarray(x).resize((width, height), Image.BILINEAR))
    y = x
    if width != x.shape[1]:
        y = _resample(y, 1, width, _triangle, 1.0)
    if height != x.shape[0]:
        y = _resample(y, 0, height, _triangle, 1.0)
    return y


def _resample(x_u8, axis: int, n_out: int, kernel=None, half_support: float = 2.0) -> np.ndarray:
    """uint8 `x` resampled along `axis` to n_out (one pass of torch's uint8 kernel;
    `kernel` of `half_support`: Keys' cubic by default)."""
    index, k, bits = _taps(x_u8.shape[axis], n_out, kernel, half_support)
    x = np.moveaxis(x_u8, axis, 0).astype(np.int64)
    acc = np.full((n_out,) + x.shape[1:], 1 << (bits - 1), np.int64)  # rounds the shift
    for t in range(index.shape[1]):
        acc += x[index[:, t]] * k[:, t].reshape((-1,) + (1,) * (x.ndim - 1))
    return np.moveaxis(np.clip(acc >> bits, 0, 255).astype(np.uint8), 0, axis)


def _taps(n_in: int, n_out: int, kernel=None, half_support: float = 2.0):
    """([n_out, T] input indices, [n_out, T] int weights (0 past a row's taps), the
    weights' fixed-point bits) of torch's antialiased bicubic (or `kernel` of
    `half_support`) from n_in to n_out."""
    kernel = _cubic if kernel is None else kernel
    scale = n_in / n_out
    support = half_support * max(scale, 1.0)
    inv = 1.0 / scale if scale >= 1 else 1.0
    rows = []
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        w = kernel((np.arange(lo, hi) - center + 0.5) * inv)
        rows.append((lo, w / w.sum()))
    T = max(len(w) for _, w in rows)
    largest = max(float(w.max()) for _, w in rows)
    bits = 0  # the most bits that keep the largest weight an int16
    while bits < 22 and int(0.5 + largest * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    index = np.zeros((n_out, T), np.int64)
    k = np.zeros((n_out, T), np.int64)
    for i, (lo, w) in enumerate(rows):
        scaled = w * (1 << bits)
        index[i, : len(w)] = np.arange(lo, lo + len(w))
        k[i, : len(w)] = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5))
    return index, k, bits


def _cubic(t: np.ndarray, a: float = -0.5) -> np.ndarray:
    """Keys' cubic convolution kernel, in float64."""
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t < 1, near, np.where(t < 2, far, 0.0))


def _triangle(t: np.ndarray) -> np.ndarray:
    """The bilinear (triangle) kernel, in float64."""
    return np.maximum(0.0, 1.0 - np.abs(t))
