"""The statistics of ``pyengine bench``: robust per-round figures, outlier rounds, and
the ratio of two builds (or of a run and a stored baseline) with a bootstrap interval.

Rules chosen (README "Performance regression checks" says why):

- A *sample* is ``loops`` back-to-back calls timed together (loops calibrated so a
  sample lasts about :data:`SAMPLE_S`); a *round* is a few consecutive samples; the
  round's statistic is its **minimum** per-call time: a neighbour's burst only ever
  adds time, so the fastest of a few consecutive samples is the least disturbed.
- Rounds whose statistic is more than :data:`OUTLIER_MADS` scaled MADs (and at least
  :data:`OUTLIER_FLOOR`) above the median round are outliers and are re-run.
- A comparison is the ratio new/old of per-call times (or old/new of a figure where
  higher is better), summarised by the median over rounds, with a percentile
  bootstrap interval (:data:`LEVEL`, :data:`BOOTSTRAP` resamples, a fixed seed so a
  verdict is reproducible). Paired rounds (A/B, same machine state) bootstrap the
  per-round ratios; unpaired ones (a stored baseline) resample each side.
- A regression is declared only when the whole interval lies beyond the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["BOOTSTRAP", "LEVEL", "Ratio", "outlier_rounds", "paired_ratio", "round_stat", "unpaired_ratio", "verdict"]

#: Target length of one sample (seconds): long against the timer's resolution
#: (~0.1 us), short against a neighbour's scheduling burst (tens of ms).
SAMPLE_S = 0.005
#: Outlier round: above median + OUTLIER_MADS * 1.4826 * MAD and above median * (1 + OUTLIER_FLOOR).
OUTLIER_MADS = 3.0
OUTLIER_FLOOR = 0.10
#: Bootstrap resamples and the interval's confidence level.
BOOTSTRAP = 4000
LEVEL = 0.95


def round_stat(samples: Sequence[float]) -> float:
    """The statistic of one round: the minimum of its per-call sample times."""
    if len(samples) == 0:
        raise ValueError("a round needs at least one sample")
    return float(np.min(samples))


def outlier_rounds(stats: Sequence[float]) -> list[int]:
    """Indices of rounds whose statistic (a time: larger is worse) is an outlier above the rest."""
    x = np.asarray(stats, float)
    if x.size < 3:
        return []
    med = float(np.median(x))
    mad = 1.4826 * float(np.median(np.abs(x - med)))
    cut = max(med + OUTLIER_MADS * mad, med * (1 + OUTLIER_FLOOR))
    return [i for i, v in enumerate(x) if v > cut]


class Ratio(tuple):
    """(ratio, low, high): the median ratio and its bootstrap interval."""

    __slots__ = ()

    def __new__(cls, ratio: float, low: float, high: float):
        return super().__new__(cls, (float(ratio), float(low), float(high)))

    ratio = property(lambda self: self[0])
    low = property(lambda self: self[1])
    high = property(lambda self: self[2])


def _check(name: str, x: Sequence[float]) -> np.ndarray:
    a = np.asarray(x, float)
    if a.ndim != 1 or a.size < 2 or not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{name} must be at least 2 finite positive values; got {list(np.ravel(a))[:8]}")
    return a


def paired_ratio(old: Sequence[float], new: Sequence[float], seed: int = 0) -> Ratio:
    """Median of the per-round ratios new[i] / old[i] (rounds timed back to back), with a
    bootstrap interval over rounds (of the geometric, log-space, ratios)."""
    a, b = _check("old", old), _check("new", new)
    if a.size != b.size:
        raise ValueError(f"paired rounds need equal counts; got {a.size} and {b.size}")
    logs = np.log(b / a)
    rng = np.random.default_rng(seed)
    boot = np.median(logs[rng.integers(0, logs.size, (BOOTSTRAP, logs.size))], axis=1)
    lo, hi = np.quantile(boot, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return Ratio(math.exp(np.median(logs)), math.exp(lo), math.exp(hi))


def unpaired_ratio(old: Sequence[float], new: Sequence[float], seed: int = 0) -> Ratio:
    """median(new) / median(old) with a two-sample bootstrap interval (each side resampled)."""
    a, b = _check("old", old), _check("new", new)
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, a.size, (BOOTSTRAP, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, (BOOTSTRAP, b.size))], axis=1)
    lo, hi = np.quantile(mb / ma, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return Ratio(float(np.median(b) / np.median(a)), lo, hi)


def verdict(time_ratio: Ratio, threshold: float) -> str:
    """``"regression"`` when the whole interval of new/old *time* lies above
    1 / (1 - threshold) (speed dropped by more than ``threshold``), ``"faster"`` when it lies
    below 1 - threshold, ``"same"`` otherwise (no evidence either way is "same")."""
    if not (0 <= threshold < 1):
        raise ValueError(f"threshold must be in [0, 1); got {threshold!r}")
    if time_ratio.low > 1 / (1 - threshold):
        return "regression"
    if time_ratio.high < 1 - threshold:
        return "faster"
    return "same"
