"""The result objects of :mod:`pyengine.linalg.spectral` and :mod:`pyengine.linalg.weights`.

:class:`SpectralResult` (sigma_max per operator, its bounds and convergence record),
:class:`SpectralRadiusResult` (max |eigenvalue| per operator) and :class:`WeightScan`
(sigma_max of weight matrices and the spectral-condition ratio). Frozen dataclasses
with read-only arrays, a ``summary()`` or ``to_text()`` and plain-list exports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["TOL", "TOL_RADIUS", "SpectralRadiusResult", "SpectralResult", "WeightScan"]

#: Default relative residual tolerance of spectral_norm / *_spectral_norm (and of SpectralResult.tol).
TOL = 1e-6
#: Default relative residual tolerance of spectral_radius (and of SpectralRadiusResult.tol).
TOL_RADIUS = 1e-8


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    a.flags.writeable = False
    return a


def _stats_line(name: str, a: np.ndarray) -> str:
    a = np.asarray(a, np.float64).ravel()
    if a.size == 0:
        return f"{name}: (none)"
    return f"{name}: min {a.min():.6g}  median {np.median(a):.6g}  max {a.max():.6g}"


def _short(a: np.ndarray) -> str:
    with np.printoptions(threshold=6, edgeitems=3, precision=6):
        return np.array2string(np.asarray(a), separator=", ")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class SpectralResult:
    """sigma_max per operator (token), with its bounds and convergence record.

    Every array has the batch shape: ``(B,)`` for :func:`spectral_norm`,
    ``x.shape[:-1]`` for the LayerNorm / RMSNorm scans. Arrays are read-only.

    Attributes
    ----------
    sigma : float64
        The estimate of sigma_max (for power and Lanczos, equal to ``lower``).
    lower : float64
        ``||A v||`` for the final unit vector v: sigma_max >= lower.
    upper : float64
        A cheap guaranteed bound, sigma_max <= upper (``inf`` if none); >= lower.
    residual : float64
        ``||A^T A v - sigma^2 v|| / sigma^2`` of the final v (0 for "exact").
    iterations : int64
        Products with A and with A^T used (one of each per iteration).
    converged : bool
        ``residual <= tol``; never True otherwise.
    method : str
        "power", "lanczos" or "exact", per operator.
    tol : float
        The tolerance that was asked for.
    """

    sigma: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    residual: np.ndarray
    iterations: np.ndarray
    converged: np.ndarray
    method: np.ndarray
    tol: float = TOL

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "tol":
                object.__setattr__(self, f.name, _frozen(getattr(self, f.name)))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.sigma.shape

    def __len__(self) -> int:
        return int(self.sigma.size)

    @property
    def all_converged(self) -> bool:
        return bool(self.converged.all())

    def summary(self) -> str:
        """A few lines: counts, sigma statistics, worst residual, iterations, bounds gap."""
        n = len(self)
        methods = ", ".join(sorted(set(self.method.ravel().tolist()))) or "-"
        conv = int(self.converged.sum())
        lines = [
            f"SpectralResult: {n} operator(s), shape {self.shape}, method {methods}, tol {self.tol:g}",
            f"converged: {conv}/{n}" + ("" if conv == n else f"  ({n - conv} NOT converged: sigma is a lower bound)"),
            _stats_line("sigma", self.sigma),
        ]
        if n:
            lines.append(f"residual: max {self.residual.max():.3g}   iterations: mean "
                         f"{self.iterations.mean():.1f}  max {self.iterations.max()}")
            with np.errstate(invalid="ignore", divide="ignore"):
                gap = np.where(self.upper > 0, self.upper / np.where(self.lower > 0, self.lower, np.nan), 1.0)
            finite = np.isfinite(gap)
            if finite.any():
                lines.append(f"upper/lower: median {np.median(gap[finite]):.4g}  max {gap[finite].max():.4g}")
            lines.append(f"sigma < 1: {int((self.sigma < 1).sum())}/{n}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        n, conv = len(self), int(self.converged.sum())
        methods = ",".join(sorted(set(self.method.ravel().tolist())))
        return (f"SpectralResult(shape={self.shape}, method={methods!r}, converged={conv}/{n}, "
                f"sigma={_short(self.sigma)}, max_residual={self.residual.max(initial=0.0):.3g})")

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (JSON-ready), flattened in C order, plus the tolerance."""
        return {f.name: (getattr(self, f.name).ravel().tolist() if f.name != "tol" else self.tol)
                for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class SpectralRadiusResult:
    """rho = ``max |eigenvalue|`` per operator, and which method found it.

    Attributes
    ----------
    rho : float64
        The spectral radius estimate, ``|eigenvalue|``.
    eigenvalue : complex128
        The dominant eigenvalue found (one of a conjugate or tied pair).
    residual : float64
        ``||A x - lambda x|| / (|lambda| ||x||)`` for its eigenvector x, computed explicitly.
    iterations : int64
        Products with A used (power iterations plus Arnoldi's).
    converged : bool
        ``residual <= tol``.
    method : str
        "power", "arnoldi" (scipy.sparse.linalg.eigs) or "dense" (LAPACK on the formed
        matrix: n < 3 or 128 <= n <= 2048), per operator; see :func:`spectral_radius`.
    upper : float64
        Guaranteed bound rho <= ||A|| <= upper (``inf`` if none).
    tol : float
    """

    rho: np.ndarray
    eigenvalue: np.ndarray
    residual: np.ndarray
    iterations: np.ndarray
    converged: np.ndarray
    method: np.ndarray
    upper: np.ndarray
    tol: float = TOL_RADIUS

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "tol":
                object.__setattr__(self, f.name, _frozen(getattr(self, f.name)))

    def __len__(self) -> int:
        return int(self.rho.size)

    @property
    def all_converged(self) -> bool:
        return bool(self.converged.all())

    def summary(self) -> str:
        n, conv = len(self), int(self.converged.sum())
        counts = {m: int((self.method == m).sum()) for m in ("power", "arnoldi", "dense")}
        by = ", ".join(f"{m} {c}" for m, c in counts.items() if c)
        lines = [
            f"SpectralRadiusResult: {n} operator(s), tol {self.tol:g}; answered by {by or '-'}",
            f"converged: {conv}/{n}" + ("" if conv == n else f"  ({n - conv} NOT converged)"),
            _stats_line("rho", self.rho),
        ]
        if n:
            lines.append(f"residual: max {self.residual.max():.3g}   iterations: mean "
                         f"{self.iterations.mean():.1f}  max {self.iterations.max()}")
            lines.append(f"rho < 1: {int((self.rho < 1).sum())}/{n};  complex dominant eigenvalue: "
                         f"{int((np.abs(self.eigenvalue.imag) > 0).sum())}/{n}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        n, conv = len(self), int(self.converged.sum())
        return (f"SpectralRadiusResult(n={n}, converged={conv}/{n}, rho={_short(self.rho)}, "
                f"method={_short(self.method)})")



@dataclasses.dataclass(frozen=True, eq=False)
class WeightScan:
    """Spectral view of weight matrices; one entry per matrix.

    ``sigma_max`` is the largest singular value; with ``W`` of shape
    (d_out, d_in) acting as ``y = W x``, ``rms_to_rms = sigma_max * sqrt(d_in / d_out)``
    is the operator norm from RMS-normalized inputs to RMS-normalized outputs, and
    ``ratio = sigma_max / target`` compares sigma_max with the spectral-condition
    rule ``target = sqrt(d_out / d_in)`` (numerically ratio == rms_to_rms: both
    should be Theta(1) for stable feature learning).
    """

    name: tuple[str, ...]
    d_out: np.ndarray
    d_in: np.ndarray
    sigma_max: np.ndarray
    rms_to_rms: np.ndarray
    target: np.ndarray
    ratio: np.ndarray
    converged: np.ndarray

    def __len__(self) -> int:
        return len(self.name)

    def to_dict(self) -> dict[str, list[Any]]:
        return {f.name: list(getattr(self, f.name)) if f.name == "name" else getattr(self, f.name).tolist()
                for f in dataclasses.fields(self)}

    def to_text(self) -> str:
        """A fixed-width table, one row per matrix."""
        w = max([4] + [len(s) for s in self.name])
        head = f"{'name':<{w}}  {'shape':>13}  {'sigma_max':>11}  {'rms->rms':>10}  {'sqrt(dout/din)':>14}  {'ratio':>8}"
        rows = [head, "-" * len(head)]
        for i, nm in enumerate(self.name):
            shape = f"{self.d_out[i]}x{self.d_in[i]}"
            flag = "" if self.converged[i] else "  (not converged)"
            rows.append(f"{nm:<{w}}  {shape:>13}  {self.sigma_max[i]:>11.5g}  {self.rms_to_rms[i]:>10.4g}  "
                        f"{self.target[i]:>14.4g}  {self.ratio[i]:>8.4g}{flag}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.to_text()

