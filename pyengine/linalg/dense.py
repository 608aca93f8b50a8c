"""A stack of dense matrices as a :class:`~pyengine.linalg.operators.BatchedOperator`; products go to BLAS."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from .operators import _BOUND_SLACK, BatchedOperator, _as_slice

__all__ = ["DenseOperator"]


class DenseOperator(BatchedOperator):
    """A stack of dense matrices; products go to BLAS (``np.matmul``).

    Parameters
    ----------
    A : array_like, shape (m, n) or (..., m, n), float32 or float64
        One matrix (batch 1: shared by every row of a product, one GEMM) or a
        stack of B = prod(leading axes) matrices (a batched GEMV). Not copied if
        already C-contiguous; never modified.

    Notes
    -----
    ``upper_bound()`` is ``min(||A||_F, sqrt(||A||_1 ||A||_inf))`` per matrix.

    Raises
    ------
    TypeError
        A is not a float32/float64 array.
    ValueError
        A has fewer than 2 axes, an empty axis, or NaN/Inf entries.
    """

    def __init__(self, A: Any) -> None:
        arr = _v.float_array("A", A)
        if arr.ndim < 2:
            raise ValueError(f"A must have shape (m, n) or (B, m, n); got shape {arr.shape}")
        if 0 in arr.shape:
            raise ValueError(f"A must not have an empty axis; got shape {arr.shape}")
        _v.finite("A", arr)
        m, n = arr.shape[-2:]
        a3 = np.ascontiguousarray(arr).reshape(-1, m, n)
        super().__init__(a3.shape[0], (m, n), arr.dtype)
        self.A = a3
        self._bound: np.ndarray | None = None

    def _matvec(self, V, out):
        if self.batch == 1:  # one matrix for every row: a single GEMM
            return np.matmul(V, self.A[0].T, out=out)
        res = np.matmul(self.A, V[:, :, None], out=None if out is None else out[:, :, None])
        return res[:, :, 0]

    def _rmatvec(self, U, out):
        if self.batch == 1:
            return np.matmul(U, self.A[0], out=out)
        res = np.matmul(U[:, None, :], self.A, out=None if out is None else out[:, None, :])
        return res[:, 0, :]

    def upper_bound(self):
        if self._bound is None:
            a = self.A
            fro = np.sqrt(np.einsum("bij,bij->b", a, a, dtype=np.float64))
            one = np.abs(a).sum(axis=1, dtype=np.float64).max(axis=1)  # max column sum
            inf = np.abs(a).sum(axis=2, dtype=np.float64).max(axis=1)  # max row sum
            self._bound = np.minimum(fro, np.sqrt(one * inf)) * (1.0 + _BOUND_SLACK)
        return self._bound.copy()

    def take(self, idx):
        idx = self._indices(idx)
        if self.batch == 1:
            return self
        sl = _as_slice(idx)
        new = object.__new__(DenseOperator)
        BatchedOperator.__init__(new, len(idx), self.shape, self.dtype)
        new.A = self.A[sl] if sl is not None else self.A[idx]  # a view for a contiguous range
        new._bound = None if self._bound is None else self._bound[idx]
        return new

    def to_dense(self) -> np.ndarray:
        """The matrices, shape (B, m, n) (a view; do not modify)."""
        return self.A

