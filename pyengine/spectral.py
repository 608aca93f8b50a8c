"""Spectral norms and spectral radii of batches of operators, with stated accuracy.

Two quantities, two separate algorithms (on non-normal operators they differ):

* :func:`spectral_norm` -- sigma_max(A_b) for every operator of a batch, by power
  iteration on A^T A (``method="power"``) or by Golub-Kahan-Lanczos
  bidiagonalization with full reorthogonalization and thick restarts
  (``method="lanczos"``). Both stop each operator on the *residual*
  ``||A^T A v - sigma^2 v|| / sigma^2 <= tol`` of its unit iterate v (not on the
  change of sigma), which is the same relative residual that ARPACK tests.
  For LayerNorm / RMSNorm Jacobians, :func:`layer_norm_spectral_norm` and
  :func:`rms_norm_spectral_norm` add ``method="exact"`` (the O(d) secular
  equation) and run power iteration in a fused per-token kernel.
* :func:`spectral_radius` -- max |lambda(A_b)| of square, possibly non-symmetric
  operators: power iteration on A, with a fall-back to Arnoldi
  (:func:`scipy.sparse.linalg.eigs`) for the operators whose dominant
  eigenvalues are a complex or tied pair (the Rayleigh quotient never settles).

Every result says, per operator, whether it converged: ``converged`` is False
whenever the residual test was not met, and then ``sigma`` is only the lower
bound reached. ``lower`` is ``||A v||`` for the final unit vector v (a bound
that holds up to rounding in the operator's dtype), ``upper`` is the operator's
cheap guaranteed bound (``BatchedOperator.upper_bound``; never below ``lower``).

Start vectors are drawn from a counter-based generator (Philox) keyed by
``seed`` and positioned by the *global* index of the operator (token), so the
results do not depend on how a scan is split into chunks, and a seed reproduces
them bit for bit.

:func:`weight_scan` tabulates sigma_max of weight matrices with the RMS -> RMS
operator norm of the "spectral condition" for feature learning.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _validate as _v
from .backends import _check_name, resolve
from .operators import (
    BatchedOperator,
    LayerNormJacobian,
    RMSNormJacobian,
    _NormJacobian,
    as_batched_operator,
)

__all__ = [
    "SpectralRadiusResult",
    "SpectralResult",
    "WeightScan",
    "layer_norm_spectral_norm",
    "rms_norm_spectral_norm",
    "spectral_norm",
    "spectral_radius",
    "weight_scan",
]

# -- tolerances, caps and sizes: every one of them lives here ---------------------------
#: Default relative residual tolerance of spectral_norm / *_spectral_norm.
TOL = 1e-6
#: Default relative residual tolerance of spectral_radius.
TOL_RADIUS = 1e-8
#: Default cap on iterations (products with A and A^T) per operator.
MAX_ITER = 1000
#: Largest Krylov subspace of method="lanczos" (basis vectors kept per operator).
LANCZOS_MAX_SUBSPACE = 50
#: Ritz vectors kept across a thick restart of method="lanczos".
LANCZOS_KEEP = 20
#: Lanczos: alpha or beta below this fraction of the largest seen is a breakdown (an
#: invariant subspace was found; the next basis vector would be noise).
BREAKDOWN = 1e-14
#: Gram-Schmidt: a second pass for a vector whose norm fell below this fraction.
DGKS_ETA = 0.7071067811865476
#: First Ritz test of method="lanczos" (product pairs), and the longest gap between tests.
LANCZOS_FIRST_TEST = 4
LANCZOS_TEST_GAP = 8
#: Compact the active set once this fraction of it has converged (a compaction copies
#: the operators' data, so doing it for every single converged operator costs more
#: than iterating a few finished ones a little longer; their results are frozen).
COMPACT_FRACTION = 0.125
#: spectral_radius: a residual that has not halved over this many power iterations
#: marks a dominant eigenvalue that power iteration cannot separate (complex or
#: tied pair, or a gap too small): that operator goes to Arnoldi.
STALL_WINDOW = 25
STALL_RATIO = 0.5
#: Arnoldi is asked for this fraction of tol, so that its answer passes our own
#: explicit residual test (ARPACK tests its Ritz estimate, not the residual).
ARNOLDI_TOL_FACTOR = 0.1
#: Working memory of one chunk of a scan (bytes); sets the default chunk_size.
SCAN_CHUNK_BYTES = 64 * 2**20

METHODS_NORM = ("power", "lanczos")
METHODS_LN = ("exact", "power", "lanczos")


_BLAS = None


def _one_blas_thread():
    """Single-threaded BLAS for the many tiny dense problems (projected SVDs, Gram-Schmidt):
    threaded OpenBLAS on 40 x 40 matrices is slower by orders of magnitude on a busy machine."""
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


# -- results ------------------------------------------------------------------------------
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
    """rho = max |eigenvalue| per operator, and which method found it.

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
        "power", "arnoldi" (scipy.sparse.linalg.eigs) or "dense" (n < 3), per operator.
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


# -- argument checks ------------------------------------------------------------------
def _check_tol(tol: Any) -> float:
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (0 < float(tol) < 1):
        raise ValueError(f"tol must be a real number in (0, 1) (a relative residual); got {tol!r}")
    return float(tol)


def _check_count(name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def _check_method(method: Any, allowed: tuple[str, ...]) -> str:
    if method not in allowed:
        raise ValueError(f"method must be one of {', '.join(map(repr, allowed))}; got {method!r}")
    return method


def _check_callback(callback: Any) -> Callable[[int, int], Any] | None:
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable as callback(done, total) or None; got {type(callback).__name__}")
    return callback


def _seed_key(seed: Any) -> np.ndarray:
    """The Philox key of ``seed`` (None: fresh entropy; otherwise a non-negative int)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise ValueError(f"seed must be a non-negative integer or None; got {seed!r}")
    return np.random.SeedSequence(seed).generate_state(2, np.uint64)


def _start_vectors(key: np.ndarray, first: int, count: int, n: int) -> np.ndarray:
    """Unit Gaussian start vectors of operators ``first .. first+count-1``, (count, n) float64.

    Each operator i owns a fixed stretch of the Philox stream (counter offset
    ``i * per``), so its vector depends only on (seed, i), not on the chunk it is in.
    """
    raw_per = 4 * (-(-(n + (n & 1)) // 4))  # n rounded up to even, then to whole Philox blocks
    bg = np.random.Philox(key=key, counter=first * (raw_per // 4))
    raw = bg.random_raw(count * raw_per).reshape(count, raw_per)[:, : n + (n & 1)]
    u = (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    rad = np.sqrt(-2.0 * np.log1p(-u[:, 0::2]))  # Box-Muller on (0, 1]
    ang = 2.0 * np.pi * u[:, 1::2]
    z = np.empty((count, n + (n & 1)))
    z[:, 0::2], z[:, 1::2] = rad * np.cos(ang), rad * np.sin(ang)
    z = z[:, :n]
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return z


def _check_v0(v0: Any, batch: int, n: int) -> np.ndarray:
    arr = _v.float_array("v0", v0)
    if arr.shape != (batch, n):
        raise ValueError(f"v0 must have shape (B, n) = ({batch}, {n}); got {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError("v0 contains NaN or Inf")
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    if (norms == 0).any():
        raise ValueError(f"v0 row {int(np.flatnonzero(norms[:, 0] == 0)[0])} is zero; start vectors must be non-zero")
    return arr / norms


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b, dtype=np.float64)


def _empty_result(shape, tol, method) -> dict[str, np.ndarray]:
    return {
        "sigma": np.zeros(shape), "lower": np.zeros(shape), "upper": np.full(shape, np.inf),
        "residual": np.full(shape, np.inf), "iterations": np.zeros(shape, np.int64),
        "converged": np.zeros(shape, bool), "method": np.full(shape, method, dtype="<U7"),
    }


# -- power iteration on A^T A (generic operators) ------------------------------------
def _power(op: BatchedOperator, V0: np.ndarray, tol: float, max_iter: int, out: dict[str, np.ndarray]) -> None:
    """Batched power iteration on A^T A; fills ``out`` (arrays of shape (B,)) in place.

    Each step: U = A v, W = A^T U, sigma^2 = ||U||^2, residual ||W - sigma^2 v|| / sigma^2;
    an operator stops when its residual is <= tol, else v <- W / ||W||.
    """
    B, (m, n) = op.batch, op.shape
    dt = op.dtype
    ids = np.arange(B)  # global (within this call) index of each active row
    active_op, V = op, V0.astype(dt)
    U, W = np.empty((B, m), dt), np.empty((B, n), dt)
    done = np.zeros(B, bool)  # finished, but maybe not yet compacted away
    bound = op.upper_bound()
    for k in range(max_iter):
        a = len(ids)
        active_op.matvec(V, out=U[:a])
        active_op.rmatvec(U[:a], out=W[:a])
        s2 = _rowdot(U[:a], U[:a])
        R = W[:a] - s2.astype(dt)[:, None] * V
        rn = np.sqrt(_rowdot(R, R))
        with np.errstate(divide="ignore", invalid="ignore"):
            res = np.where(s2 > 0, rn / s2, np.where(rn == 0, 0.0, np.inf))
        live = ~done[ids]
        g = ids[live]
        out["sigma"][g] = np.sqrt(s2[live])
        out["residual"][g] = res[live]
        out["iterations"][g] = k + 1
        # sigma = 0 is an answer only if the operator is provably zero (bound 0).
        conv = live & (res <= tol) & ((s2 > 0) | (bound[ids] == 0))
        out["converged"][ids[conv]] = True
        done[ids[conv]] = True
        wn = np.sqrt(_rowdot(W[:a], W[:a]))
        zero = wn == 0  # A^T A v = 0: v lies in the null space; restart elsewhere
        V[...] = W[:a] / np.where(zero, 1.0, wn).astype(dt)[:, None]
        if zero.any():
            fresh = np.random.default_rng([k, *ids[zero][:1].tolist()]).standard_normal((int(zero.sum()), n))
            V[zero] = (fresh / np.linalg.norm(fresh, axis=1, keepdims=True)).astype(dt)
        keep = ~done[ids]
        if not keep.any():
            break
        if (~keep).sum() >= max(1, COMPACT_FRACTION * a):
            sel = np.flatnonzero(keep)
            active_op, V, ids = active_op.take(sel), np.ascontiguousarray(V[sel]), ids[sel]
            a = len(ids)


# -- Golub-Kahan-Lanczos bidiagonalization with thick restarts --------------------------
def _orthogonalize(w: np.ndarray, basis: np.ndarray, j: int) -> np.ndarray:
    """w -= Q Q^T w against the first j basis vectors; returns the coefficients Q^T w.

    Classical Gram-Schmidt with the DGKS test: a row whose norm dropped below
    DGKS_ETA of its former value has lost digits to cancellation and gets a second
    pass ("twice is enough"), which keeps the basis orthonormal to rounding.
    """
    if j == 0:
        return np.zeros((w.shape[0], 0))
    Q = basis[:j].transpose(1, 0, 2)  # (a, j, n) view
    before = _rowdot(w, w)
    coef = np.matmul(Q, w[:, :, None])[:, :, 0]
    w -= np.matmul(coef[:, None, :], Q)[:, 0, :]
    again = np.flatnonzero(_rowdot(w, w) < DGKS_ETA**2 * before)
    if again.size:
        Qa, wa = Q[again], w[again]
        c2 = np.matmul(Qa, wa[:, :, None])[:, :, 0]
        w[again] = wa - np.matmul(c2[:, None, :], Qa)[:, 0, :]
        coef[again] += c2
    return coef


def _lanczos(op: BatchedOperator, V0: np.ndarray, tol: float, max_iter: int, out: dict[str, np.ndarray]) -> None:
    """Batched Golub-Kahan-Lanczos for sigma_max; fills ``out`` in place.

    Keeps, per operator, orthonormal V (n x j), U (m x j) and the j x j projection M with
        A V = U M,    A^T U = V M^T + v_next f^T.
    The top singular triplet (theta, p, q) of M gives the Ritz vector V q, whose
    residual is ||A^T A (Vq) - theta^2 Vq|| / theta^2 = |f . p| / theta. When that
    estimate passes tol, the Ritz vector is verified with one explicit product pair
    (that residual is what is reported). At LANCZOS_MAX_SUBSPACE vectors the basis is
    thick-restarted on the LANCZOS_KEEP top Ritz vectors (the decomposition stays exact:
    M becomes diag(theta_keep) and f becomes P_keep^T f).

    The small SVDs cost O(j^3) per operator, far more than a LayerNorm product, so
    an operator is tested only when due: the next test is scheduled halfway to where
    the observed convergence rate of its estimate predicts tol (every step once it
    is near), and at every restart, which needs the SVD anyway.
    """
    if max_iter == 1:  # no room for a step and its check: one power step is the same thing
        _power(op, V0, tol, max_iter, out)
        return
    B, (m, n) = op.batch, op.shape
    p = int(min(LANCZOS_MAX_SUBSPACE, m, n))
    keep_k = int(min(LANCZOS_KEEP, max(p - 2, 1)))
    ids = np.arange(B)
    act = op
    Vb = np.zeros((p + 1, B, n))
    Ub = np.zeros((p, B, m))
    M = np.zeros((B, p, p))
    f = np.zeros((B, p))
    Vb[0] = V0
    j = 0
    used = np.zeros(B, np.int64)  # product pairs per operator (this call)
    factor = np.ones(B)  # tightened after a failed verification
    done = np.zeros(B, bool)
    bound = op.upper_bound()
    scale = np.zeros(B)  # per operator: largest alpha / beta seen (~ ||A||), for breakdown tests
    due = np.full(B, LANCZOS_FIRST_TEST, np.int64)  # pair count at which to test next
    last_est, last_at = np.full(B, np.inf), np.zeros(B, np.int64)
    while True:
        a = len(ids)
        # -- extend by one: u = A v_j, orthogonalize against U, alpha; w = A^T u, beta --------
        u = act.matvec(Vb[j, :a]).astype(np.float64)
        with _one_blas_thread():
            c = _orthogonalize(u, Ub[:, :a], j)
        alpha = np.sqrt(_rowdot(u, u))
        tiny = alpha <= BREAKDOWN * np.maximum(scale[ids], 1e-300)
        u /= np.where(tiny, 1.0, alpha)[:, None]
        u[tiny] = 0.0
        alpha[tiny] = 0.0
        Ub[j, :a] = u
        M[:a, :j, j] = c
        M[:a, j, j] = alpha
        w = act.rmatvec(u).astype(np.float64)
        with _one_blas_thread():
            _orthogonalize(w, Vb[:, :a], j + 1)
        beta = np.sqrt(_rowdot(w, w))
        scale[ids] = np.maximum(scale[ids], np.maximum(alpha, beta))
        btiny = beta <= BREAKDOWN * np.maximum(scale[ids], 1e-300)
        beta[btiny] = 0.0
        Vb[j + 1, :a] = w / np.where(btiny, 1.0, beta)[:, None]
        Vb[j + 1, :a][btiny] = 0.0
        f[:a, :j] = 0.0
        f[:a, j] = beta
        j += 1
        used[ids] += 1
        # -- Ritz test, for the operators that are due (all of them before a restart) ------
        live = ~done[ids]
        out_of_budget = used[ids] + 1 >= max_iter  # one pair stays reserved for the final check
        restart = j == p
        test = live & (restart | out_of_budget | (used[ids] >= due[ids]) | btiny)
        ti = np.flatnonzero(test)
        if restart:
            ti = np.arange(a)
        if ti.size:
            with _one_blas_thread():
                P, theta, Qt = np.linalg.svd(M[ti, :j, :j])
            th = theta[:, 0]
            fp = np.abs(np.einsum("aj,aj->a", f[ti, :j], P[:, :, 0]))
            with np.errstate(divide="ignore", invalid="ignore"):
                est = np.where(th > 0, fp / th, np.where(fp == 0, 0.0, np.inf))
            g = ids[ti]
            _schedule(due, last_est, last_at, g, est, used[g], tol * factor[g])
            cand_local = live[ti] & ((est <= tol * factor[g]) | out_of_budget[ti])
            if cand_local.any():
                ci = ti[cand_local]
                ritz = np.einsum("jan,aj->an", Vb[:j, ci], Qt[cand_local, 0, :])
                ritz /= np.linalg.norm(ritz, axis=1, keepdims=True)
                sub = act.take(ci)
                y = sub.matvec(ritz).astype(np.float64)
                z = sub.rmatvec(y).astype(np.float64)
                s2 = _rowdot(y, y)
                r = z - s2[:, None] * ritz
                rn = np.sqrt(_rowdot(r, r))
                with np.errstate(divide="ignore", invalid="ignore"):
                    res = np.where(s2 > 0, rn / s2, np.where(rn == 0, 0.0, np.inf))
                gc = ids[ci]
                used[gc] += 1
                ok = (res <= tol) & ((s2 > 0) | (bound[gc] == 0))
                fin = ok | out_of_budget[ci]
                out["sigma"][gc[fin]] = np.sqrt(s2[fin])
                out["residual"][gc[fin]] = res[fin]
                out["iterations"][gc[fin]] = used[gc[fin]]
                out["converged"][gc[ok]] = True
                done[gc[fin]] = True
                factor[gc[~fin]] *= 0.1  # the estimate was optimistic: ask more of it next time
        keep = ~done[ids]
        if not keep.any():
            return
        # -- thick restart when the basis is full -------------------------------------------
        if restart:
            k = keep_k
            with _one_blas_thread():
                newV = np.einsum("lan,akl->kan", Vb[:j, :a], Qt[:, :k, :])  # V_j q_i, i < k
                newU = np.einsum("lam,alk->kam", Ub[:j, :a], P[:, :, :k])  # U_j p_i
            nxt = Vb[j, :a].copy()
            Vb[:k, :a], Ub[:k, :a] = newV, newU
            Vb[k, :a] = nxt
            fk = np.einsum("aj,ajk->ak", f[:a, :j], P[:, :, :k])
            M[:a] = 0.0
            M[:a, np.arange(k), np.arange(k)] = theta[:, :k]
            f[:a] = 0.0
            f[:a, :k] = fk
            j = k
        if (~keep).sum() >= max(1, COMPACT_FRACTION * a):
            sel = np.flatnonzero(keep)
            act, ids = act.take(sel), ids[sel]
            Vb = np.ascontiguousarray(Vb[:, sel])
            Ub = np.ascontiguousarray(Ub[:, sel])
            M, f = M[sel], f[sel]


def _schedule(due, last_est, last_at, g, est, now, target) -> None:
    """Set the pair count of the next Ritz test of operators ``g`` from their estimates' progress."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rate = (est / last_est[g]) ** (1.0 / np.maximum(now - last_at[g], 1))  # per step
        steps = np.log(target / est) / np.log(rate)  # predicted steps to reach target
    gap = np.where((rate > 0) & (rate < 1) & np.isfinite(steps), np.floor(steps / 2), LANCZOS_TEST_GAP)
    due[g] = now + np.clip(gap, 1, LANCZOS_TEST_GAP).astype(np.int64)
    last_est[g], last_at[g] = est, now


# -- public: spectral_norm -----------------------------------------------------------
def _default_chunk(method: str, width: int, itemsize: int, p: int) -> int:
    per = {"exact": width * 8, "power": 4 * width * 8, "lanczos": (2 * p + 8) * width * 8}[method]
    return max(1, SCAN_CHUNK_BYTES // per)


def _chunks(total: int, size: int):
    for lo in range(0, total, size):
        yield lo, min(total, lo + size)


def _slice_op(op: BatchedOperator, lo: int, hi: int) -> BatchedOperator:
    return op if (lo, hi) == (0, op.batch) else op.take(np.arange(lo, hi))


def spectral_norm(
    op: Any, method: str = "power", tol: float = TOL, max_iter: int = MAX_ITER, seed: int | None = 0,
    v0: Any = None, backend: str = "auto", callback: Callable[[int, int], Any] | None = None,
    *, chunk_size: int | None = None,
) -> SpectralResult:
    """sigma_max of every operator of a batch, matrix-free, with a stated accuracy.

    Parameters
    ----------
    op : BatchedOperator, array (m, n) / (B, m, n), or scipy LinearOperator
        The batch (see :mod:`pyengine.operators`); arrays become a DenseOperator.
    method : {"power", "lanczos"}
        ``"power"``: power iteration on A^T A. ``"lanczos"``: Golub-Kahan-Lanczos
        bidiagonalization with full reorthogonalization and thick restarts (far
        fewer products when the top singular values are close).
    tol : float in (0, 1), default 1e-6
        Stop an operator when ``||A^T A v - sigma^2 v|| / sigma^2 <= tol``.
    max_iter : int, default 1000
        Cap on iterations (one product with A and one with A^T each) per operator.
    seed : int >= 0 or None, default 0
        Start vectors are a function of (seed, operator index); None: fresh entropy.
    v0 : array_like, shape (B, n), optional
        Start vectors (normalized here); overrides ``seed``.
    backend : {"auto", "cpp", "numba", "numpy"}
        For LayerNormJacobian / RMSNormJacobian operators: the backend of the
        fused kernels (``"auto"``: the operator's own backend).
    callback : callable(done, total), optional
        Called after each chunk with the number of operators finished so far.
    chunk_size : int, optional
        Operators per chunk (bounds the working memory; default from a 64 MiB budget).

    Returns
    -------
    SpectralResult
        Arrays of shape (B,).

    Raises
    ------
    TypeError, ValueError
        Bad operator, method, tol, max_iter, seed, v0, backend or chunk_size.
    """
    op = as_batched_operator(op)
    method = _check_method(method, METHODS_NORM)
    tol, max_iter = _check_tol(tol), _check_count("max_iter", max_iter)
    chunk_size = _check_count("chunk_size", chunk_size, allow_none=True)
    callback = _check_callback(callback)
    backend = _check_name(backend)
    key = _seed_key(seed)
    start = None if v0 is None else _check_v0(v0, op.batch, op.shape[1])
    if isinstance(op, _NormJacobian) and type(op) in (LayerNormJacobian, RMSNormJacobian):
        res = _norm_scan(
            op._norm, op.x, op.gamma, op.eps, op.frozen, method, tol, max_iter, key,
            op.backend if backend == "auto" else backend, chunk_size, callback, (op.batch,), start,
        )
        return res
    B, n = op.batch, op.shape[1]
    out = _empty_result((B,), tol, method)
    bound = op.upper_bound()
    size = chunk_size or _default_chunk(method, max(op.shape), op.dtype.itemsize, LANCZOS_MAX_SUBSPACE)
    solver = _power if method == "power" else _lanczos
    for lo, hi in _chunks(B, size):
        sub = _slice_op(op, lo, hi)
        V0 = _start_vectors(key, lo, hi - lo, n) if start is None else start[lo:hi]
        part = {k: v[lo:hi] for k, v in out.items()}
        solver(sub, V0, tol, max_iter, part)
        if callback is not None:
            callback(hi, B)
    out["lower"] = out["sigma"].copy()
    out["upper"] = np.maximum(bound, out["lower"])
    return SpectralResult(**out, tol=tol)


# -- LayerNorm / RMSNorm scans ----------------------------------------------------------
def _norm_scale(norm: str, x: np.ndarray, eps: float) -> np.ndarray:
    xd = x.astype(np.float64)
    if norm == "layer_norm":
        xd -= xd.mean(axis=1, keepdims=True)
    return np.sqrt(np.einsum("ij,ij->i", xd, xd) / x.shape[1] + eps)


def _norm_scan(
    norm: str, x2: np.ndarray, g: np.ndarray, eps: float, frozen: bool, method: str, tol: float,
    max_iter: int, key: np.ndarray, backend: str, chunk_size: int | None,
    callback: Callable[[int, int], Any] | None, shape: tuple[int, ...], start: np.ndarray | None = None,
) -> SpectralResult:
    """The chunked scan behind layer_norm_spectral_norm / rms_norm_spectral_norm."""
    N, d = x2.shape
    out = _empty_result((N,), tol, method)
    if method == "exact":
        kern = resolve(norm + "_sigma_max", backend)
    elif method == "power":
        kern = resolve(norm + "_power_iteration", backend)
    size = chunk_size or _default_chunk(method, d, x2.dtype.itemsize, LANCZOS_MAX_SUBSPACE)
    gmax = float(np.abs(g.astype(np.float64)).max())
    full_shape = shape + (d,)
    mode = "frozen_scale" if frozen else "full"
    for lo, hi in _chunks(N, size):
        xc = np.ascontiguousarray(x2[lo:hi])
        if method == "exact":
            sig = out["sigma"][lo:hi]
            nbad = kern(xc, g, eps, frozen, sig)
            if nbad:
                _v.raise_bad_rows(nbad, x2, full_shape, eps, norm)
            out["residual"][lo:hi] = 0.0
            out["converged"][lo:hi] = True
            out["upper"][lo:hi] = sig
        elif method == "power":
            v0 = (_start_vectors(key, lo, hi - lo, d) if start is None else start[lo:hi]).astype(x2.dtype)
            it = out["iterations"][lo:hi]
            sig, res = out["sigma"][lo:hi], out["residual"][lo:hi]
            nbad = kern(xc, g, eps, frozen, v0, tol, max_iter, sig, res, it)
            if nbad:
                _v.raise_bad_rows(nbad, x2, full_shape, eps, norm)
            out["converged"][lo:hi] = res <= tol
            with np.errstate(divide="ignore"):
                out["upper"][lo:hi] = np.maximum(gmax / _norm_scale(norm, xc, eps), sig)
        else:
            cls = LayerNormJacobian if norm == "layer_norm" else RMSNormJacobian
            with np.errstate(invalid="ignore", over="ignore"):
                scale = _norm_scale(norm, xc, eps)
                bad = ~(np.isfinite(scale) & (scale > 0))
            if bad.any():  # the message names the row in the whole input, not in the chunk
                _v.raise_bad_rows(int(bad.sum()), x2, full_shape, eps, norm)
            op = cls._trusted(xc, g, eps, mode, backend, scale)
            V0 = _start_vectors(key, lo, hi - lo, d) if start is None else start[lo:hi]
            part = {k: v[lo:hi] for k, v in out.items()}
            _lanczos(op, V0, tol, max_iter, part)
            out["upper"][lo:hi] = np.maximum(op.upper_bound(), part["sigma"])
        if callback is not None:
            callback(hi, N)
    out["lower"] = out["sigma"].copy()
    if method == "exact":
        out["iterations"][:] = 0
    lead = shape
    return SpectralResult(**{k: v.reshape(lead) for k, v in out.items()}, tol=tol)


def _norm_spectral_norm(
    norm: str, x: Any, gamma: Any, eps: Any, mode: Any, method: Any, tol: Any, max_iter: Any, seed: Any,
    backend: Any, chunk_size: Any, callback: Any,
) -> SpectralResult:
    x2, shape = _v.rows("x", x)
    g = _v.param("gamma", gamma, x2, 1.0)
    eps, frozen = _v.eps(eps), _v.frozen(mode)
    method = _check_method(method, METHODS_LN)
    tol, max_iter = _check_tol(tol), _check_count("max_iter", max_iter)
    chunk_size = _check_count("chunk_size", chunk_size, allow_none=True)
    callback = _check_callback(callback)
    backend = _check_name(backend)
    key = _seed_key(seed)
    return _norm_scan(norm, x2, g, eps, frozen, method, tol, max_iter, key, backend, chunk_size,
                      callback, shape[:-1])


def layer_norm_spectral_norm(
    x: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full", method: str = "exact",
    tol: float = TOL, max_iter: int = MAX_ITER, seed: int | None = 0, backend: str = "auto",
    *, chunk_size: int | None = None, callback: Callable[[int, int], Any] | None = None,
) -> SpectralResult:
    """sigma_max of the LayerNorm Jacobian of every token, streamed in chunks.

    Parameters
    ----------
    x : array_like, shape (..., d), float32 or float64
        Tokens (any leading shape; a ``np.load(..., mmap_mode="r")`` array is read
        chunk by chunk).
    gamma : array_like, shape (d,), optional
    eps : float, default 1e-5
    mode : {"full", "frozen_scale"}
    method : {"exact", "power", "lanczos"}, default "exact"
        ``"exact"``: the secular equation of DESIGN.md, O(d) per token, exact to
        rounding (lower = upper = sigma, residual 0, iterations 0). ``"power"``:
        fused per-token power iteration on J^T J. ``"lanczos"``: batched
        Golub-Kahan-Lanczos (see :func:`spectral_norm`).
    tol, max_iter, seed
        As :func:`spectral_norm` (unused by "exact"). A token's start vector
        depends only on (seed, its flat index), so results do not depend on
        ``chunk_size``.
    backend : {"auto", "cpp", "numba", "numpy"}
    chunk_size : int, optional
        Tokens per chunk; the default keeps the working memory near 64 MiB.
    callback : callable(done, total), optional
        Progress: called after every chunk with the tokens done and the total.

    Returns
    -------
    SpectralResult
        Arrays of shape ``x.shape[:-1]``.

    Raises
    ------
    TypeError, ValueError
        As :func:`pyengine.layer_norm_jvp`, plus bad method, tol, max_iter, seed,
        chunk_size or callback.
    """
    return _norm_spectral_norm("layer_norm", x, gamma, eps, mode, method, tol, max_iter, seed,
                               backend, chunk_size, callback)


def rms_norm_spectral_norm(
    x: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full", method: str = "exact",
    tol: float = TOL, max_iter: int = MAX_ITER, seed: int | None = 0, backend: str = "auto",
    *, chunk_size: int | None = None, callback: Callable[[int, int], Any] | None = None,
) -> SpectralResult:
    """sigma_max of the RMSNorm Jacobian of every token; as :func:`layer_norm_spectral_norm`."""
    return _norm_spectral_norm("rms_norm", x, gamma, eps, mode, method, tol, max_iter, seed,
                               backend, chunk_size, callback)


# -- spectral radius ----------------------------------------------------------------------
def _arnoldi(op_i: BatchedOperator, v0: np.ndarray, tol: float, max_iter: int) -> tuple[complex, np.ndarray, int, bool]:
    """Dominant eigenpair of one operator by ARPACK (eigs, k=1, which="LM"); counts products."""
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigs

    n = op_i.shape[0]
    count = [0]

    def mv(v):
        count[0] += 1
        return op_i.matvec(np.reshape(v, (1, n)))[0].astype(np.float64)

    L = LinearOperator((n, n), matvec=mv, dtype=np.float64)
    try:
        vals, vecs = eigs(L, k=1, which="LM", tol=tol * ARNOLDI_TOL_FACTOR, v0=v0, maxiter=max_iter,
                          ncv=min(n, 20))
        ok = True
    except ArpackNoConvergence as exc:
        vals, vecs, ok = exc.eigenvalues, exc.eigenvectors, False
        if len(vals) == 0:
            return complex(np.nan), np.zeros(n, complex), count[0], False
    return complex(vals[0]), vecs[:, 0], count[0], ok


def spectral_radius(
    op: Any, tol: float = TOL_RADIUS, max_iter: int = MAX_ITER, seed: int | None = 0, v0: Any = None,
) -> SpectralRadiusResult:
    """max |eigenvalue| of every operator of a batch of square, possibly non-symmetric operators.

    Power iteration on A (not A^T A: that is :func:`spectral_norm`) for the whole
    batch; an operator stops when ``||A v - lambda v|| / |lambda| <= tol`` with the
    Rayleigh quotient lambda = v^T A v. If its residual does not halve over
    ``STALL_WINDOW`` iterations (a complex-conjugate or +-lambda dominant pair makes
    the Rayleigh quotient oscillate; a tiny gap makes it crawl), or it runs out of
    iterations, the operator goes to Arnoldi (``scipy.sparse.linalg.eigs``, k=1,
    which="LM"), started from its current iterate; ``method`` says which answered.

    Parameters
    ----------
    op : BatchedOperator, array (n, n) / (B, n, n), or scipy LinearOperator
        Square operators (shape (n, n)).
    tol : float in (0, 1), default 1e-8
    max_iter : int, default 1000
        Cap on power iterations, and on Arnoldi restarts, per operator.
    seed : int >= 0 or None, default 0
    v0 : array_like, shape (B, n), optional
        Start vectors; overrides ``seed``.

    Returns
    -------
    SpectralRadiusResult
        Arrays of shape (B,).

    Raises
    ------
    TypeError, ValueError
        Non-square or bad operator, bad tol, max_iter, seed or v0.
    """
    op = as_batched_operator(op)
    if op.shape[0] != op.shape[1]:
        raise ValueError(f"op must be square for a spectral radius; got operators of shape {op.shape}")
    tol, max_iter = _check_tol(tol), _check_count("max_iter", max_iter)
    key = _seed_key(seed)
    B, n = op.batch, op.shape[0]
    V = _start_vectors(key, 0, B, n) if v0 is None else _check_v0(v0, B, n)
    rho, lam = np.zeros(B), np.zeros(B, complex)
    residual, iters = np.full(B, np.inf), np.zeros(B, np.int64)
    converged, method = np.zeros(B, bool), np.full(B, "power", dtype="<U7")
    bound = op.upper_bound()
    hist = np.full((STALL_WINDOW, B), np.inf)  # residual history, a ring per operator
    ids, act = np.arange(B), op
    done = np.zeros(B, bool)
    fallback = np.zeros(B, bool)
    dt = op.dtype
    Vw = V.astype(dt)
    for k in range(max_iter if n >= 3 else 0):
        a = len(ids)
        W = act.matvec(Vw)
        lq = _rowdot(Vw, W)
        R = W - lq.astype(dt)[:, None] * Vw
        rn = np.sqrt(_rowdot(R, R))
        with np.errstate(divide="ignore", invalid="ignore"):
            res = np.where(lq != 0, rn / np.abs(lq), np.where(rn == 0, 0.0, np.inf))
        live = ~done[ids]
        g = ids[live]
        rho[g], lam[g], residual[g], iters[g] = np.abs(lq[live]), lq[live], res[live], k + 1
        conv = live & (res <= tol) & ((lq != 0) | (bound[ids] == 0))
        converged[ids[conv]] = True
        old = hist[k % STALL_WINDOW, ids]
        stalled = live & ~conv & (k >= STALL_WINDOW) & ~(res <= STALL_RATIO * old)
        hist[k % STALL_WINDOW, ids] = res
        fallback[ids[stalled]] = True
        done[ids[conv | stalled]] = True
        wn = np.sqrt(_rowdot(W, W))
        stuck = live & (wn == 0) & ~conv  # A v = 0 but A is not known to be zero
        fallback[ids[stuck]] = True
        done[ids[stuck]] = True
        Vw = W / np.where(wn == 0, 1.0, wn).astype(dt)[:, None]
        V[ids] = Vw
        keep = ~done[ids]
        if not keep.any():
            break
        if (~keep).sum() >= max(1, COMPACT_FRACTION * a):
            sel = np.flatnonzero(keep)
            act, ids, Vw = act.take(sel), ids[sel], np.ascontiguousarray(Vw[sel])
    fallback |= ~converged
    for i in np.flatnonzero(fallback):
        one = op.take(np.array([i]))
        if n < 3:  # ARPACK needs n >= 3: the dense eigenvalues of a tiny operator
            dense = one.matvec(np.eye(n)).T.astype(np.float64)
            ev, vecs = np.linalg.eig(dense)
            top = int(np.argmax(np.abs(ev)))
            x, val, used, ok, name = vecs[:, top], ev[top], n, True, "dense"
        else:
            val, x, used, ok = _arnoldi(one, V[i].astype(np.float64), tol, max_iter)
            name = "arnoldi"
        iters[i] += used
        method[i] = name
        if not np.isfinite(val):
            converged[i], residual[i] = False, np.inf
            continue
        xr = np.stack([x.real, x.imag]).astype(np.float64)
        Ax = one.matvec(xr).astype(np.float64)
        Axc = Ax[0] + 1j * Ax[1]
        xn = np.linalg.norm(x)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.linalg.norm(Axc - val * x) / (abs(val) * xn) if abs(val) > 0 else (0.0 if np.linalg.norm(Axc) == 0 else np.inf)
        rho[i], lam[i], residual[i] = abs(val), val, r
        converged[i] = bool(ok and r <= tol and (abs(val) > 0 or bound[i] == 0))
    return SpectralRadiusResult(rho=rho, eigenvalue=lam, residual=residual, iterations=iters,
                                converged=converged, method=method, upper=np.maximum(bound, rho), tol=tol)


# -- weight scans ------------------------------------------------------------------------
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


#: weight_scan: matrices up to this min(d_out, d_in) get a dense SVD, larger ones Lanczos.
WEIGHT_SVD_MAX = 1024


def weight_scan(
    weights: Mapping[str, Any] | Sequence[Any], layout: str = "out_in", tol: float = 1e-10, seed: int = 0,
) -> WeightScan:
    """sigma_max, the RMS -> RMS norm and the spectral-condition ratio of weight matrices.

    Parameters
    ----------
    weights : dict name -> 2-D array, or a list of 2-D arrays (named "0", "1", ...)
        Real float matrices.
    layout : {"out_in", "in_out"}, default "out_in"
        "out_in": W has shape (d_out, d_in), ``y = W x`` (torch.nn.Linear.weight);
        "in_out": shape (d_in, d_out), ``y = x W`` (GPT-2 Conv1D, JAX).
    tol : float, default 1e-10
        Residual tolerance for matrices too large for a dense SVD (min side
        over 1024), which use ``spectral_norm(method="lanczos")``.
    seed : int, default 0

    Returns
    -------
    WeightScan
        Arrays in the order of ``weights``; ``to_text()`` gives a table.

    Raises
    ------
    TypeError, ValueError
        Not a list/dict, a matrix that is not 2-D, not float, empty or not finite.
    """
    import scipy.linalg

    if layout not in ("out_in", "in_out"):
        raise ValueError(f"layout must be 'out_in' or 'in_out'; got {layout!r}")
    if isinstance(weights, Mapping):
        items = [(str(k), w) for k, w in weights.items()]
        label = "weights[{!r}]"
    elif isinstance(weights, Sequence) and not isinstance(weights, (str, bytes)) and not isinstance(weights, np.ndarray):
        items = [(str(i), w) for i, w in enumerate(weights)]
        label = "weights[{}]"
    else:
        raise TypeError(f"weights must be a dict of name -> matrix or a list of matrices; got {type(weights).__name__}")
    tol = _check_tol(tol)
    names, dout, din, sig, conv = [], [], [], [], []
    for i, (name, w) in enumerate(items):
        arg = label.format(name if isinstance(weights, Mapping) else i)
        arr = _v.float_array(arg, w)
        if arr.ndim != 2 or 0 in arr.shape:
            raise ValueError(f"{arg} must be a non-empty 2-D matrix; got shape {arr.shape}")
        if not np.isfinite(arr).all():
            raise ValueError(f"{arg} contains NaN or Inf")
        do, di = arr.shape if layout == "out_in" else arr.shape[::-1]
        if min(arr.shape) <= WEIGHT_SVD_MAX:
            s, ok = float(scipy.linalg.svdvals(arr.astype(np.float64, copy=False), check_finite=False)[0]), True
        else:
            r = spectral_norm(arr, method="lanczos", tol=tol, seed=seed)
            s, ok = float(r.sigma[0]), bool(r.converged[0])
        names.append(name)
        dout.append(do)
        din.append(di)
        sig.append(s)
        conv.append(ok)
    dout_a, din_a, sig_a = np.array(dout, np.int64), np.array(din, np.int64), np.array(sig)
    target = np.sqrt(dout_a / din_a) if len(names) else np.zeros(0)
    rms = sig_a * np.sqrt(din_a / dout_a) if len(names) else np.zeros(0)
    return WeightScan(name=tuple(names), d_out=dout_a, d_in=din_a, sigma_max=sig_a, rms_to_rms=rms,
                      target=target, ratio=sig_a / target if len(names) else np.zeros(0),
                      converged=np.array(conv, bool))
