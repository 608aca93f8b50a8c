"""rho and sigma_max of the per-token diagonal Jacobian blocks of one block, dense or matrix-free.

A_t = d out_t / d h_t (d_model x d_model) is the change of block k's output at token t per
change of its input at the same token (with a causal mask the Jacobian over all T tokens
is block lower-triangular, so its eigenvalues are those of the A_t).
:func:`token_jacobian_spectra` gives rho(A_t) = max |eigenvalue| and sigma_max(A_t) at
the chosen tokens in one of two ways:

* ``"dense"``: A_t formed by :func:`~pyengine.analysis.token_jacobians` (d tangents), then
  LAPACK: exact to rounding, and fast while d is moderate.
* ``"matrix_free"``: :class:`TokenJacobian` (``matvec`` one diagonal JVP, ``rmatvec`` one
  block VJP) handed to :func:`pyengine.spectral_norm` (Lanczos on A^T A) and
  :func:`pyengine.spectral_radius` (power iteration on A, then dense LAPACK or Arnoldi
  where it stalls). A_t is never formed; every value carries its solver's residual and
  ``converged`` flag.

``method="auto"`` picks dense for d_model <= :data:`DENSE_MAX_D`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import _validate as _v
from ..linalg import BatchedOperator, SpectralRadiusResult, SpectralResult, spectral_norm, spectral_radius
from ..linalg.results import TOL, TOL_RADIUS
from ..linalg.spectral import MAX_ITER
from .jacobians import token_jacobians
from .propagate import resolve_positions

__all__ = ["DENSE_MAX_D", "TokenJacobian", "TokenSpectra", "token_jacobian_spectra"]

#: Largest d_model that ``method="auto"`` answers densely. Up to it the formed A_t
#: (d x d float64, 32 MiB at 2048) and LAPACK's O(d^3) eigenvalues and SVD take seconds and
#: are exact; beyond it (8B-shaped blocks: d = 4096, 128 MiB per token and 8x the LAPACK
#: work of d = 2048) Krylov solvers need far fewer products than the d tangents of the
#: formed matrix. It equals the largest n that spectral_radius still answers with LAPACK.
DENSE_MAX_D = 2048

METHODS = ("auto", "dense", "matrix_free")


class TokenJacobian(BatchedOperator):
    """The diagonal Jacobian blocks A_t of block ``block`` at R tokens, each (d, d), matrix-free.

    Parameters
    ----------
    model : Stack
    h : array_like, (T, d_model), float32 or float64
        The block's input (e.g. ``model.hidden_states(ids)[block]``); its dtype is the operator's.
    block : int
        Block index (negative counts from the end).
    tokens : "all", "last", int, slice or sequence of ints
        The positions t, used sorted and without repeats (as :func:`token_jacobians`).
    mode : {"full", "frozen_scale"}
        As :meth:`pyengine.Stack.block_jvp`.

    ``matvec`` is :meth:`pyengine.Stack.block_jvp_diagonal`; ``rmatvec`` is
    :meth:`pyengine.Stack.block_vjp` of a cotangent that is zero except at row t, read at
    row t (its exact transpose). With one token (batch 1) every row of V is a tangent of
    that token. The block's forward runs once here; ``take`` shares its cache.
    """

    def __init__(self, model: Any, h: Any, block: int, tokens: Any = "last", mode: str = "full") -> None:
        if not hasattr(model, "block_jvp_diagonal"):
            raise TypeError(f"model must be a pyengine Stack; got {type(model).__name__}")
        k = model.block_index(block)
        _v.frozen(mode)
        x, batched = model.as_stream(h)
        if batched:
            raise ValueError(f"h must have shape (T, d_model); got {x.shape}")
        rows = resolve_positions(tokens, x.shape[1])
        _, cache = model.block_forward(k, x[0], return_cache=True)
        self._init(model, k, mode, cache, rows)

    def _init(self, model: Any, k: int, mode: str, cache: Any, rows: np.ndarray) -> None:
        d = cache.h.shape[1]
        super().__init__(rows.size, (d, d), cache.h.dtype)
        self.model, self.block, self.mode, self.cache, self.tokens = model, k, mode, cache, rows

    def _matvec(self, V: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        if self.batch == 1:  # n tangents of the one token
            res = self.model.block_jvp_diagonal(self.block, self.cache.h, V[:, None, :], self.tokens, self.mode,
                                                self.cache)[:, 0]
        else:  # one tangent: row r perturbs token tokens[r]
            res = self.model.block_jvp_diagonal(self.block, self.cache.h, V, self.tokens, self.mode, self.cache)
        if out is None:
            return res
        out[...] = res
        return out

    def _rmatvec(self, U: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        n = U.shape[0]
        t = np.broadcast_to(self.tokens, (n,)) if self.batch == 1 else self.tokens
        G = np.zeros((n,) + self.cache.h.shape, self.dtype)
        G[np.arange(n), t] = U
        res = self.model.block_vjp(self.block, self.cache.h, G, self.mode, self.cache)[np.arange(n), t]
        if out is None:
            return res
        out[...] = res
        return out

    def take(self, idx: Any) -> TokenJacobian:
        idx = self._indices(idx)
        if len(idx) == 0:
            raise ValueError("idx must select at least one operator")
        new = TokenJacobian.__new__(TokenJacobian)
        new._init(self.model, self.block, self.mode, self.cache, self.tokens[idx])
        return new


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSpectra:
    """rho and sigma_max of A_t at each of R tokens, and how they were found.

    Attributes
    ----------
    tokens : ndarray of int, (R,)
    norm : SpectralResult, (R,)
        sigma_max; ``method`` "dense" (LAPACK SVD of the formed A_t: residual 0, converged),
        or "lanczos".
    radius : SpectralRadiusResult, (R,)
        rho; ``method`` "dense" (LAPACK eigenvalues, formed here or by spectral_radius's
        fallback), "power" or "arnoldi".
    ones_residual : ndarray of float64, (R,)
        ``|A_t 1 - 1|_inf`` (0 up to rounding for a pre-LN LayerNorm residual block).
    """

    tokens: np.ndarray
    norm: SpectralResult
    radius: SpectralRadiusResult
    ones_residual: np.ndarray

    @property
    def rho(self) -> np.ndarray:
        return self.radius.rho

    @property
    def sigma(self) -> np.ndarray:
        return self.norm.sigma

    @property
    def converged(self) -> np.ndarray:
        """(R,) bool: both rho and sigma_max met their tolerance."""
        return self.radius.converged & self.norm.converged


def token_jacobian_spectra(
    model: Any, h: Any, block: int, tokens: Any = "last", *, method: str = "auto", mode: str = "full",
    tol: float = TOL, tol_radius: float = TOL_RADIUS, max_iter: int = MAX_ITER, seed: int | None = 0,
) -> TokenSpectra:
    """rho and sigma_max of the diagonal Jacobian blocks A_t of block ``block`` at ``tokens``.

    Parameters
    ----------
    model : Stack
    h : array_like, (T, d_model), float32 or float64
        The block's input; its dtype is the compute dtype.
    block : int
        Block index (negative counts from the end).
    tokens : "all", "last", int, slice or sequence of ints
        Positions t, used sorted and without repeats.
    method : {"auto", "dense", "matrix_free"}
        ``"auto"``: dense for d_model <= :data:`DENSE_MAX_D`, else matrix-free.
    mode : {"full", "frozen_scale"}
        As :meth:`pyengine.Stack.block_jvp`.
    tol, tol_radius : float in (0, 1)
        The matrix-free tolerances of :func:`pyengine.spectral_norm` and
        :func:`pyengine.spectral_radius` (unused by "dense").
    max_iter : int
        Cap on the iterations of each matrix-free solver.
    seed : int >= 0 or None
        The solvers' start vectors.

    Returns
    -------
    TokenSpectra
        Arrays of shape (R,); ``norm.method`` / ``radius.method`` say which path answered.
    """
    _v.choice("method", method, METHODS)
    tol, tol_radius = _v.tol(tol), _v.tol(tol_radius, "tol_radius")
    max_iter = _v.count("max_iter", max_iter)
    op = TokenJacobian(model, h, block, tokens, mode)
    d = op.shape[0]
    if method == "dense" or (method == "auto" and d <= DENSE_MAX_D):
        return _dense(model, op, tol, tol_radius)
    norm = spectral_norm(op, method="lanczos", tol=tol, max_iter=max_iter, seed=seed)
    radius = spectral_radius(op, tol=tol_radius, max_iter=max_iter, seed=seed)
    one = np.abs(op.matvec(np.ones((op.batch, d))).astype(np.float64) - 1.0).max(axis=1)
    return TokenSpectra(op.tokens, norm, radius, one)


def _dense(model: Any, op: TokenJacobian, tol: float, tol_radius: float) -> TokenSpectra:
    """The formed A_t and LAPACK: exact to rounding (residual 0, converged)."""
    A = token_jacobians(model, op.cache.h, op.block, op.tokens, mode=op.mode)
    R, d = op.batch, op.shape[0]
    sig, one, lam = np.empty(R), np.empty(R), np.empty(R, complex)
    for r in range(R):
        ev = np.linalg.eigvals(A[r])
        lam[r] = ev[np.argmax(np.abs(ev))]
        sig[r] = np.linalg.norm(A[r], 2)
        one[r] = np.abs(A[r] @ np.ones(d) - 1.0).max()
    zero, yes, dense = np.zeros(R), np.ones(R, bool), np.full(R, "dense", dtype="<U7")
    iters = np.full(R, d, np.int64)  # the d tangents that formed A_t
    norm = SpectralResult(sigma=sig, lower=sig, upper=sig, residual=zero, iterations=iters, converged=yes,
                          method=dense, tol=tol)
    radius = SpectralRadiusResult(rho=np.abs(lam), eigenvalue=lam, residual=zero, iterations=iters,
                                  converged=yes, method=dense, upper=np.full(R, np.inf), tol=tol_radius)
    return TokenSpectra(op.tokens, norm, radius, one)
