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
  equation) and run power iteration and Lanczos in fused per-token kernels.
* :func:`spectral_radius` -- max |lambda(A_b)| of square, possibly non-symmetric
  operators: power iteration on A; where the Rayleigh quotient never settles (a complex
  or tied dominant pair), LAPACK on the formed matrix for 128 <= n <= 2048, else Arnoldi.

Every result says, per operator, whether it converged: ``converged`` is False
whenever the residual test was not met, and then ``sigma`` is only the lower
bound reached. ``lower`` is ``||A v||`` for the final unit vector v (a bound
that holds up to rounding in the operator's dtype), ``upper`` is the operator's
cheap guaranteed bound (``BatchedOperator.upper_bound``; never below ``lower``).

Start vectors are drawn from a counter-based generator (Philox) keyed by
``seed`` and positioned by the *global* index of the operator (token), so the
results do not depend on how a scan is split into chunks, and a seed reproduces
them bit for bit.

The result classes are in :mod:`pyengine.linalg.results`, the solvers in
:mod:`pyengine.linalg._solvers`, the start vectors and chunks of a scan in
:mod:`pyengine.linalg._scan`, :func:`~pyengine.linalg.weights.weight_scan` in
:mod:`pyengine.linalg.weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _validate as _v
from ..backends import check_name, resolve
from ._lanczos import _lanczos
from ._scan import _chunks, _empty_result, _seed_key, _slice_op, _start_vectors
from ._solvers import LANCZOS_MAX_SUBSPACE, _power, _radius
from .convert import as_batched_operator
from .norm_jacobians import LayerNormJacobian, RMSNormJacobian, _NormJacobian, row_scales
from .results import TOL, TOL_RADIUS, SpectralRadiusResult, SpectralResult

__all__ = [
    "layer_norm_spectral_norm",
    "rms_norm_spectral_norm",
    "spectral_norm",
    "spectral_radius",
]

# -- caps and sizes: the public defaults (TOL, TOL_RADIUS: results.py; the solvers' own: _solvers.py) --
#: Default cap on iterations (products with A and A^T) per operator.
MAX_ITER = 1000
#: Working memory of one chunk of a scan (bytes); sets the default chunk_size.
SCAN_CHUNK_BYTES = 64 * 2**20

METHODS_NORM = ("power", "lanczos")
METHODS_LN = ("exact", "power", "lanczos")


# -- public: spectral_norm -----------------------------------------------------------
def _default_chunk(method: str, width: int, itemsize: int, p: int) -> int:
    per = {"exact": width * 8, "power": 4 * width * 8, "lanczos": (2 * p + 8) * width * 8}[method]
    return max(1, SCAN_CHUNK_BYTES // per)


def spectral_norm(
    op: Any, method: str = "power", tol: float = TOL, max_iter: int = MAX_ITER, seed: int | None = 0,
    v0: Any = None, backend: str = "auto", callback: Callable[[int, int], Any] | None = None,
    *, chunk_size: int | None = None,
) -> SpectralResult:
    """sigma_max of every operator of a batch, matrix-free, with a stated accuracy.

    Parameters
    ----------
    op : BatchedOperator, array (m, n) / (B, m, n), or scipy LinearOperator
        The batch (see :mod:`pyengine.linalg.operators`); arrays become a DenseOperator.
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
    method = _v.choice("method", method, METHODS_NORM)
    tol, max_iter = _v.tol(tol), _v.count("max_iter", max_iter)
    chunk_size = _v.count("chunk_size", chunk_size, allow_none=True)
    callback = _v.callback(callback)
    backend = check_name(backend)
    key = _seed_key(seed)
    start = None if v0 is None else _v.start_vectors("v0", v0, op.batch, op.shape[1])
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
    return row_scales(norm, x, eps)


def _zero_jacobian(norm: str, d: int, eps: float, frozen: bool) -> bool:
    """True when every token's Jacobian is exactly 0: LayerNorm, full mode, eps = 0 and d = 2
    (J = diag(gamma)/s (I - 11^T/d - xh xh^T/d) has rank d - 2 when eps = 0)."""
    return norm == "layer_norm" and not frozen and eps == 0 and d == 2


def _norm_scan(
    norm: str, x2: np.ndarray, g: np.ndarray, eps: float, frozen: bool, method: str, tol: float,
    max_iter: int, key: np.ndarray, backend: str, chunk_size: int | None,
    callback: Callable[[int, int], Any] | None, shape: tuple[int, ...], start: np.ndarray | None = None,
) -> SpectralResult:
    """The chunked scan behind layer_norm_spectral_norm / rms_norm_spectral_norm."""
    N, d = x2.shape
    out = _empty_result((N,), tol, method)
    if _zero_jacobian(norm, d, eps, frozen):
        # sigma = 0 exactly, the same answer from every method (no solver can converge on
        # a zero operator from rounding noise); the rows are still checked.
        with np.errstate(invalid="ignore", over="ignore"):
            scale = _norm_scale(norm, x2, eps)
        bad = ~(np.isfinite(scale) & (scale > 0))
        if bad.any():
            _v.raise_bad_rows(int(bad.sum()), x2, shape + (d,), eps, norm)
        out.update(sigma=np.zeros(N), lower=np.zeros(N), upper=np.zeros(N), residual=np.zeros(N),
                   converged=np.ones(N, bool))
        if callback is not None:
            callback(N, N)
        return SpectralResult(**{k: v.reshape(shape) for k, v in out.items()}, tol=tol)
    if method == "exact":
        kern = resolve(norm + "_sigma_max", backend)
    elif method == "power":
        kern = resolve(norm + "_power_iteration", backend)
    else:  # the fused per-token kernel; the NumPy backend keeps the generic batched solver
        kern = resolve(norm + "_lanczos", backend)
        if kern is resolve(norm + "_lanczos", "numpy"):
            kern = None
    # The fused Lanczos kernel keeps its basis per thread, not per token: chunks as for power.
    fused = method == "lanczos" and kern is not None
    size = chunk_size or _default_chunk("power" if fused else method, d, x2.dtype.itemsize, LANCZOS_MAX_SUBSPACE)
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
            if kern is None:
                _lanczos(op, V0, tol, max_iter, part)
            else:
                nbad = kern(xc, g, eps, frozen, np.ascontiguousarray(V0, dtype=np.float64), tol, max_iter,
                            part["sigma"], part["residual"], part["iterations"])
                if nbad:
                    _v.raise_bad_rows(nbad, x2, full_shape, eps, norm)
                part["converged"][:] = part["residual"] <= tol
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
    method = _v.choice("method", method, METHODS_LN)
    tol, max_iter = _v.tol(tol), _v.count("max_iter", max_iter)
    chunk_size = _v.count("chunk_size", chunk_size, allow_none=True)
    callback = _v.callback(callback)
    backend = check_name(backend)
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
        fused per-token power iteration on J^T J. ``"lanczos"``: fused per-token
        Lanczos on J^T J with full reorthogonalization (C++ / Numba; the
        ``"numpy"`` backend runs the batched Golub-Kahan-Lanczos of
        :func:`spectral_norm`); the same result contract. Iterations are in
        [1, max_iter], except for the zero operator (mode "full", eps = 0, d = 2: J = 0),
        which every method answers with sigma 0, residual 0, converged and 0 iterations.
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
def spectral_radius(
    op: Any, tol: float = TOL_RADIUS, max_iter: int = MAX_ITER, seed: int | None = 0, v0: Any = None,
) -> SpectralRadiusResult:
    """``max |eigenvalue|`` of every operator of a batch of square, possibly non-symmetric operators.

    Power iteration on A (not A^T A: that is :func:`spectral_norm`) for the whole
    batch; an operator stops when ``||A v - lambda v|| / |lambda| <= tol`` with the
    Rayleigh quotient lambda = v^T A v. If its residual does not halve over
    ``STALL_WINDOW`` iterations (a complex-conjugate or +-lambda dominant pair makes
    the Rayleigh quotient oscillate; a tiny gap makes it crawl), or it runs out of
    iterations, ``method`` says what answered instead: ``"dense"`` for 128 <= n <= 2048 (and
    n < 3), LAPACK on the matrix formed by n products (0.4 s at n = 768), the true radius;
    ``"arnoldi"`` otherwise, the largest of the 10 eigenvalues of largest modulus that
    ``scipy.sparse.linalg.eigs`` computes from the current iterate (asked for one, it can stop
    at a smaller one close in modulus): a converged answer certifies its residual, not dominance.
    A zero image A v = 0 is the exact eigenpair (0, v): rho = 0, converged, residual 0 (from a
    random start, A is nilpotent); a stalled operator bound for Arnoldi, of any n, first continues
    its power sequence (matrix-free) for up to n products looking for one: Arnoldi cannot answer 0.

    Parameters
    ----------
    op : BatchedOperator, array (n, n) / (B, n, n), or scipy LinearOperator
        Square operators (shape (n, n)).
    tol : float in (0, 1), default 1e-8
    max_iter : int, default 1000
        Cap on power iterations, and on Arnoldi restarts (a run cut short: not converged).
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
    tol, max_iter = _v.tol(tol), _v.count("max_iter", max_iter)
    key = _seed_key(seed)
    B, n = op.batch, op.shape[0]
    V = _start_vectors(key, 0, B, n) if v0 is None else _v.start_vectors("v0", v0, B, n)
    return SpectralRadiusResult(**_radius(op, V, tol, max_iter), tol=tol)
