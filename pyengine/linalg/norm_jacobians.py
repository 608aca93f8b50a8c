"""Per-token LayerNorm and RMSNorm Jacobians as matrix-free batched operators.

:class:`LayerNormJacobian` and :class:`RMSNormJacobian` hold the points of
linearization x (validated once, at construction) and multiply through the raw JVP /
VJP kernels (:func:`pyengine.kernels.layernorm.kernel`), with no validation per
product; the d x d Jacobian is never formed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from ..backends import check_name
from ..kernels import layernorm as _ln
from .operators import _BOUND_SLACK, BatchedOperator, _as_slice

__all__ = ["LayerNormJacobian", "RMSNormJacobian"]

#: Rows per pass when a per-token statistic is computed over a large batch (bounds
#: the float64 temporaries of :class:`LayerNormJacobian` to ~ this many rows).
_STAT_ROWS = 4096


def row_scales(norm: str, x: np.ndarray, eps: float) -> np.ndarray:
    """Per-row scale s (LayerNorm) or r (RMSNorm), (n,) float64, of rows of any magnitude; NaN
    or 0 for a bad row. Each row is divided by a power of two t first (exact) and eps by t^2, so
    neither a row of 1e-170 (whose squares underflow) nor one of 1e+200 (whose squares
    overflow) loses its scale, as in the kernels."""
    xd = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.maximum(np.abs(xd).max(axis=1), np.sqrt(eps))
        ok = np.isfinite(top) & (top > 0)
        t = np.ldexp(1.0, np.clip(np.frexp(np.where(ok, top, 1.0))[1], -1022, 1023))
        xd /= t[:, None]
        if norm == "layer_norm":
            xd -= xd.mean(axis=1, keepdims=True)
        return np.sqrt(np.einsum("ij,ij->i", xd, xd) / x.shape[1] + eps / t / t) * t


class _NormJacobian(BatchedOperator):
    """Shared machinery of the LayerNorm and RMSNorm Jacobian operators."""

    _norm = ""  # "layer_norm" | "rms_norm"

    def __init__(self, x: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full", backend: str = "auto") -> None:
        x2, shape = _v.rows("x", x)
        g = _v.param("gamma", gamma, x2, 1.0)
        self.eps = _v.eps(eps)
        self.frozen = _v.frozen(mode)
        self.mode = mode
        self.backend = check_name(backend)
        if x2.shape[0] == 0:
            raise ValueError(f"x must hold at least one token; got shape {shape}")
        super().__init__(x2.shape[0], (x2.shape[1], x2.shape[1]), x2.dtype)
        self.x, self.gamma, self.batch_shape = x2, g, shape[:-1]
        self._tiled: np.ndarray | None = None
        self._scale = self._token_scale(shape)

    def _token_scale(self, shape: tuple[int, ...]) -> np.ndarray:
        """s (LayerNorm) or r (RMSNorm) per token, float64; validates the values of x."""
        x2, scale, nbad = self.x, np.empty(self.batch), 0
        for lo in range(0, self.batch, _STAT_ROWS):
            sc = row_scales(self._norm, x2[lo : lo + _STAT_ROWS], self.eps)
            ok = np.isfinite(sc) & (sc > 0)
            nbad += int((~ok).sum())
            scale[lo : lo + _STAT_ROWS] = np.where(ok, sc, 1.0)
        _v.raise_bad_rows(nbad, x2, shape, self.eps, self._norm)
        return scale

    # -- the fast path: x, gamma, eps and mode were validated once, in __init__; V / U and
    # out by BatchedOperator (C-contiguous, the operator's dtype and shape), so the
    # products call the registry's kernels directly, with no second validation.
    def _x_for(self, rows: int) -> np.ndarray:
        if rows == self.batch:
            return self.x
        if self._tiled is None or self._tiled.shape[0] != rows:  # one token shared by k rows:
            self._tiled = np.ascontiguousarray(np.broadcast_to(self.x, (rows, self.shape[0])))  # copied once
        return self._tiled

    def _apply(self, which: str, name: str, W: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        x = self._x_for(W.shape[0])
        res = np.empty(W.shape, self.dtype) if out is None else out
        # resolved per call (about a microsecond) so that backends.use_backend applies as before
        nbad = _ln.kernel(self._norm + which, self.backend)(x, W, self.gamma, self.eps, self.frozen, res)
        if nbad:  # x is known good: the tangent holds NaN/Inf
            _v.raise_bad_rows(nbad, x, x.shape, self.eps, self._norm, name, W)
        return res

    def _out(self, out, rows, width, inputs):
        return super()._out(out, rows, width, inputs + (self.x, self.gamma))

    def _matvec(self, V, out):
        return self._apply("_jvp", "V", V, out)

    def _rmatvec(self, U, out):
        return self._apply("_vjp", "U", U, out)

    def scale(self) -> np.ndarray:
        """(B,) float64: s = sqrt(var + eps) (LayerNorm) or r = sqrt(mean(x^2) + eps) (RMSNorm)."""
        return self._scale.copy()

    def upper_bound(self):
        # J = diag(gamma)/s * P with P an orthogonal projector scaled into [0, 1]:
        # ||J|| <= max|gamma| / s (the scale r for RMSNorm).
        gmax = float(np.abs(self.gamma.astype(np.float64)).max())
        if self._norm == "layer_norm" and not self.frozen and self.eps == 0 and self.shape[0] == 2:
            return np.zeros(self.batch)  # eps = 0, d = 2: J has rank d - 2 = 0
        return gmax / self._scale * (1.0 + _BOUND_SLACK)

    @classmethod
    def _trusted(cls, x2, gamma, eps, mode, backend, scale):
        """Build from arguments that are already validated (x2 (n, d) C-contiguous, scale (n,))."""
        new = object.__new__(cls)
        BatchedOperator.__init__(new, x2.shape[0], (x2.shape[1], x2.shape[1]), x2.dtype)
        new.x, new.gamma, new.eps, new.frozen = x2, gamma, eps, mode == "frozen_scale"
        new.mode, new.backend, new.batch_shape = mode, backend, (x2.shape[0],)
        new._scale, new._tiled = scale, None
        return new

    def take(self, idx):
        idx = self._indices(idx)
        if self.batch == 1:
            return self
        sl = _as_slice(idx)
        x = self.x[sl] if sl is not None else self.x[idx]
        return self._trusted(x, self.gamma, self.eps, self.mode, self.backend, self._scale[idx])

    def _name(self) -> str:
        return f"{type(self).__name__} of {self.batch} token(s), d = {self.shape[0]}, mode {self.mode!r}"


class LayerNormJacobian(_NormJacobian):
    """Per-token LayerNorm Jacobians ``J_b = diag(gamma)/s_b (I - 11^T/d - xh xh^T/d)``, matrix-free.

    Parameters
    ----------
    x : array_like, shape (..., d), float32 or float64
        Points of linearization; B = prod(x.shape[:-1]) operators of shape (d, d).
    gamma : array_like, shape (d,), optional
        LayerNorm scale (default ones).
    eps : float, default 1e-5
    mode : {"full", "frozen_scale"}
    backend : {"auto", "cpp", "numba", "numpy"}
        Backend of the JVP / VJP kernels (and of the fused spectral kernels).

    Notes
    -----
    ``matvec`` is :func:`pyengine.layer_norm_jvp`, ``rmatvec`` is
    :func:`pyengine.layer_norm_vjp` (their kernels, called directly: x and gamma
    are checked once, here); ``upper_bound()`` is ``max|gamma| / s``.
    ``batch_shape`` keeps ``x.shape[:-1]``.

    Raises
    ------
    TypeError, ValueError
        As :func:`pyengine.layer_norm_jvp` (checked here, once).
    """

    _norm = "layer_norm"


class RMSNormJacobian(_NormJacobian):
    """Per-token RMSNorm Jacobians ``J_b = diag(gamma)/r_b (I - x x^T/(d r_b^2))``, matrix-free.

    Parameters and notes as :class:`LayerNormJacobian`; ``upper_bound()`` is ``max|gamma| / r``.
    """

    _norm = "rms_norm"

