"""Small statistics over seeds: means with t-based 95% confidence intervals (no SciPy),
and per-question bootstrap intervals for one checkpoint (one model: no seeds to vary)."""

from __future__ import annotations

import math

import numpy as np

# two-sided 95% Student-t critical values t_{0.975, df}, df = 1..30
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t975(df: int) -> float:
    """Two-sided 95% t critical value (normal 1.96 beyond df = 30)."""
    if df < 1:
        return float("nan")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(
    values, lo: float | None = 0.0, hi: float | None = 1.0
) -> tuple[float, float, float, int]:
    """(mean, ci_low, ci_high, n) over the finite values: mean +- t * sd / sqrt(n).

    The interval is clipped to [lo, hi] (accuracies by default). n < 2 gives NaN bounds.
    """
    v = _finite(values)
    n = len(v)
    if n < 2:
        return _too_few(v)
    m = float(v.mean())
    half = t975(n - 1) * float(v.std(ddof=1)) / np.sqrt(n)
    return (m, *_clipped(m - half, m + half, lo, hi), n)


def _finite(values) -> np.ndarray:
    v = np.asarray(values, float).ravel()
    return v[np.isfinite(v)]


def _too_few(v: np.ndarray) -> tuple[float, float, float, int]:
    """The interval of fewer than two values: NaN bounds, the mean where there is one."""
    nan = float("nan")
    return (float(v.mean()) if len(v) else nan), nan, nan, len(v)


def _clipped(a: float, b: float, lo, hi) -> tuple[float, float]:
    return (a if lo is None else max(a, lo)), (b if hi is None else min(b, hi))


BOOTSTRAP_DRAWS = 2000  # resamples of a bootstrap interval


def bootstrap_ci(values, lo: float | None = None, hi: float | None = None, seed: int = 0,
                 draws: int = BOOTSTRAP_DRAWS) -> tuple[float, float, float, int]:  # fmt: skip
    """(mean, ci_low, ci_high, n) over the finite values, the 95% percentile interval of
    the mean over `draws` resamples of the values with replacement (seeded: the same
    values give the same interval). For one checkpoint's per-question numbers, where
    `mean_ci` over models has n = 1. n < 2 gives NaN bounds; clipped to [lo, hi]."""
    v = _finite(values)
    n = len(v)
    if n < 2:
        return _too_few(v)
    m = float(v.mean())
    rng = np.random.default_rng([seed, 95])
    means = v[rng.integers(0, n, (draws, n))].mean(1)
    a, b = (float(x) for x in np.quantile(means, [0.025, 0.975]))
    return (m, *_clipped(a, b, lo, hi), n)


def diff_ci(a, b) -> tuple[float, float, float]:
    """(mean(b) - mean(a), ci_low, ci_high): Welch 95% interval of a difference of means.

    Welch-Satterthwaite degrees of freedom, rounded down; NaN bounds with < 2 values on
    a side. Not clipped (a difference of accuracies lies in [-1, 1]).
    """
    a = np.asarray(a, float)
    b = np.asarray(b, float)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if len(a) == 0 or len(b) == 0:
        return float("nan"), float("nan"), float("nan")
    d = float(b.mean() - a.mean())
    if len(a) < 2 or len(b) < 2:
        return d, float("nan"), float("nan")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = float(np.sqrt(va + vb))
    if se == 0.0:
        return d, d, d
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t975(max(int(df), 1)) * se
    return d, d - half, d + half


def _ranks(v: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their mean rank."""
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v), float)
    ranks[order] = np.arange(1, len(v) + 1)
    for value in np.unique(v):
        tie = v == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def correlation_ci(x, y, rank: bool = False) -> tuple[float, float, float, int]:
    """(r, ci_low, ci_high, n): Pearson's r (Spearman's with `rank`) over the pairs
    where both are finite, with a Fisher-z 95% interval (NaN bounds below 4 pairs, NaN r
    when either side is constant)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = len(x)
    if rank:
        x, y = _ranks(x), _ranks(y)
    if n < 2 or x.std() == 0 or y.std() == 0:
        return float("nan"), float("nan"), float("nan"), n
    r = float(np.clip(np.corrcoef(x, y)[0, 1], -1.0, 1.0))
    if n < 4:
        return r, float("nan"), float("nan"), n
    z, half = np.arctanh(np.clip(r, -0.999999, 0.999999)), 1.96 / np.sqrt(n - 3)
    return r, float(np.tanh(z - half)), float(np.tanh(z + half)), n


def mann_whitney_u(a, b) -> tuple[float, float]:
    """(U of `a`, two-sided p): the Mann-Whitney U test by its normal approximation
    with the tie correction and a continuity correction (no SciPy; fine from ~8 values
    a side). U / (len(a) len(b)) is the probability that a value of `a` exceeds one of
    `b` (ties count half)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return float("nan"), float("nan")
    ranks = _ranks(np.concatenate([a, b]))
    u = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2)
    n = n1 + n2
    _, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    var = n1 * n2 / 12 * ((n + 1) - (counts**3 - counts).sum() / (n * (n - 1)))
    if var <= 0:
        return u, 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / np.sqrt(var)
    return u, float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2))))
