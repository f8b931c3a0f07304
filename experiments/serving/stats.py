"""Medians and 95% bootstrap confidence intervals, seeded so that the same data give the same interval.

Three pieces, used by experiments/serving/confidence.py (serving runs) and experiments/analysis/interference.py:

- `resample_counts(n, num, rng)`: `num` bootstrap resamples of n units as counts per unit (row b holds
  how often each unit was drawn), so one resample can weight several arrays of the same units alike.
- `interval(replicates)`: the percentile interval (2.5 %, 97.5 %) of bootstrap replicates.
- `two_level(replicates_per_repeat, rng)`: the interval of the median across repeats, resampling the
  repeats and, inside each drawn repeat, one of its own within-run replicates. With one repeat this is
  the within-run interval; with a few, it does not collapse to [min, max] of the repeats' values the
  way a plain bootstrap of three medians does (whose coverage is only 1 - 2 * 0.5**3 = 75 %).

`median_ci(values)` is the plain bootstrap of a median over independent values (microbenchmark
repetitions). NaN marks a replicate where the statistic is undefined (no data in that resample).
"""
from __future__ import annotations

import zlib

import numpy as np

LEVEL = 0.95
NUM_BOOT = 1000


def rng_for(*keys) -> np.random.Generator:
    """A generator seeded from `keys` (strings or ints): the same keys give the same stream, in any process."""
    return np.random.default_rng(zlib.crc32(repr(keys).encode()))


def resample_counts(n: int, num: int, rng: np.random.Generator) -> np.ndarray:
    """[num, n] ints: row b counts how often each of n units was drawn in resample b (each row sums to n)."""
    if n == 0:
        return np.zeros((num, 0), dtype=np.int64)
    draws = rng.integers(0, n, size=(num, n))
    offsets = (np.arange(num) * n)[:, None]
    return np.bincount((draws + offsets).ravel(), minlength=num * n).reshape(num, n)


def interval(replicates, level: float = LEVEL) -> tuple[float, float] | None:
    """Percentile interval of bootstrap replicates (NaNs dropped); None when fewer than half are defined."""
    a = np.asarray(replicates, dtype=float)
    a = a[~np.isnan(a)]
    if a.size == 0 or a.size < 0.5 * np.size(replicates):
        return None
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(a, [tail, 100 - tail])
    return float(lo), float(hi)


def median_ci(values, num: int = NUM_BOOT, seed: int = 0, level: float = LEVEL) -> dict:
    """{median, lo, hi, n} of independent values; lo = hi = None with fewer than 2 values."""
    a = np.asarray(list(values), dtype=float)
    if a.size == 0:
        return {"median": None, "lo": None, "hi": None, "n": 0}
    med = float(np.median(a))
    if a.size < 2:
        return {"median": med, "lo": None, "hi": None, "n": 1}
    idx = np.random.default_rng(seed).integers(0, a.size, size=(num, a.size))
    lo, hi = interval(np.median(a[idx], axis=1), level)
    return {"median": med, "lo": lo, "hi": hi, "n": int(a.size)}


def two_level(replicates_per_repeat: list, rng: np.random.Generator, level: float = LEVEL) -> tuple[float, float] | None:
    """Interval of the median across repeats: draw repeats with replacement, then for each drawn repeat
    one of its within-run replicates (rows: repeats, columns: that repeat's replicates, equal length)."""
    w = np.asarray(replicates_per_repeat, dtype=float)
    if w.ndim != 2 or w.size == 0:
        return None
    n, num = w.shape
    rows = rng.integers(0, n, size=(num, n))
    cols = rng.integers(0, num, size=(num, n))
    drawn = w[rows, cols]
    with np.errstate(all="ignore"):
        ok = ~np.isnan(drawn).all(axis=1)
        medians = np.full(num, np.nan)
        medians[ok] = np.nanmedian(drawn[ok], axis=1)
    return interval(medians, level)


def separated(a: tuple[float, float] | None, b: tuple[float, float] | None) -> int:
    """-1 when interval a lies wholly below b, +1 when wholly above, 0 when they overlap or one is missing."""
    if a is None or b is None or None in a or None in b:
        return 0
    if a[1] < b[0]:
        return -1
    if a[0] > b[1]:
        return 1
    return 0
