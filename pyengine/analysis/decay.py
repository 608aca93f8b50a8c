"""Exponential decay fits of a per-layer magnitude: :func:`fit_decay` and :class:`DecayFit`.

The rate of ``|p_k| ~ exp(intercept - rate k)`` by least squares on ``log |p_k|``, with a
95 % interval for the rate (Student t). :meth:`pyengine.Propagation.fit` fits the
projection of a propagated perturbation with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

__all__ = ["DecayFit", "fit_decay"]


@dataclasses.dataclass(frozen=True)
class DecayFit:
    """Exponential fit ``|p_k| ~ exp(intercept - rate k)`` by least squares on ``log |p_k|``.

    ``rate`` > 0 is decay, < 0 growth. ``rate_ci`` is the 95 % interval of the
    slope (Student t, n - 2 degrees of freedom; NaN with fewer than 3 points);
    ``half_life`` = ln 2 / rate layers (inf when the rate is <= 0: see :attr:`doubling`
    and :meth:`timescale` for growth); ``intercept``
    ``log |p|`` extrapolated to layer 0 (absolute index); ``r2`` the
    coefficient of determination of the log-linear fit; ``n_points`` the layers used
    (those with ``|p_k| > 0`` and finite).
    """

    rate: float
    rate_ci: tuple[float, float]
    r2: float
    half_life: float
    intercept: float
    n_points: int

    @property
    def doubling(self) -> float:
        """ln 2 / -rate layers for a growing magnitude (rate < 0); inf otherwise."""
        return math.log(2) / -self.rate if self.rate < 0 else math.inf

    def timescale(self) -> str:
        """In words: "half-life 3.2 layers" (decay), "doubles every 3.2 layers" (growth),
        "constant" (rate 0) or "no fit" (NaN rate): never "half-life inf"."""
        if not math.isfinite(self.rate):
            return "no fit"
        if self.rate > 0:
            return f"half-life {self.half_life:.3g} layers"
        if self.rate < 0:
            return f"doubles every {self.doubling:.3g} layers"
        return "constant"

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "rate_ci": list(self.rate_ci), "r2": self.r2,
                "half_life": self.half_life, "doubling": self.doubling, "intercept": self.intercept,
                "n_points": self.n_points}


def fit_decay(values: Any, layers: Any | None = None) -> DecayFit:
    """Fit the exponential rate of ``|values|`` over ``layers`` (default 0, 1, ...).

    Parameters
    ----------
    values : array_like, (n,)
        A magnitude per layer, e.g. ``|projection|`` at one position.
    layers : array_like, (n,), optional
        The layer index of each value.

    Returns
    -------
    DecayFit
        NaN rate (and n_points < 2) when fewer than two values are > 0.
    """
    from scipy.special import stdtrit  # scipy.stats.t.ppf's kernel, without importing scipy.stats

    y = np.abs(np.asarray(values, dtype=np.float64))
    if y.ndim != 1:
        raise ValueError(f"values must be 1-D (one per layer); got shape {y.shape}")
    x = np.arange(y.size, dtype=np.float64) if layers is None else np.asarray(layers, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"layers must have the shape of values {y.shape}; got {x.shape}")
    keep = np.isfinite(y) & (y > 0) & np.isfinite(x)
    x, y = x[keep], np.log(y[keep])
    n = int(x.size)
    nan = float("nan")
    if n < 2 or np.ptp(x) == 0:
        return DecayFit(nan, (nan, nan), nan, nan, nan, n)
    xm, ym = x.mean(), y.mean()
    sxx = float(((x - xm) ** 2).sum())
    slope = float(((x - xm) * (y - ym)).sum() / sxx)
    intercept = float(ym - slope * xm)
    resid = y - (intercept + slope * x)
    ss_res, ss_tot = float((resid**2).sum()), float(((y - ym) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    if n > 2:
        half = float(stdtrit(n - 2, 0.975)) * math.sqrt(ss_res / (n - 2) / sxx)
        ci = (-slope - half, -slope + half)
    else:
        ci = (nan, nan)
    rate = -slope
    return DecayFit(rate, ci, r2, math.log(2) / rate if rate > 0 else math.inf, intercept, n)
