"""The bridge between pyengine's batched operators and :class:`scipy.sparse.linalg.LinearOperator`.

:func:`as_linear_operator` (one operator of a batch as a LinearOperator) and
:func:`from_linear_operator` (a LinearOperator, sparse matrix or 2-D array as a batch
of one). Both are re-exported by :mod:`pyengine`; :func:`as_batched_operator` coerces any of them (or an array) to a batch; scipy
is imported on the first call only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from .dense import DenseOperator
from .operators import BatchedOperator, _check_op

__all__ = ["as_batched_operator", "as_linear_operator", "from_linear_operator"]


class _FromLinearOperator(BatchedOperator):
    def __init__(self, L: Any) -> None:
        dt = np.dtype(L.dtype) if L.dtype is not None else np.dtype(np.float64)
        if dt.kind == "c":
            raise TypeError(f"L must be a real operator; got dtype {dt}")
        super().__init__(1, tuple(int(s) for s in L.shape), np.float32 if dt == np.float32 else np.float64)
        self.L = L

    def _matvec(self, V, out):
        res = np.asarray(self.L.matmat(V.T)).T
        if out is None:
            return np.ascontiguousarray(res, dtype=self.dtype)
        out[...] = res
        return out

    def _rmatvec(self, U, out):
        try:
            res = np.asarray(self.L.rmatmat(U.T)).T
        except (NotImplementedError, TypeError) as exc:  # scipy's message for a missing rmatvec is obscure
            raise TypeError(
                f"the LinearOperator could not multiply by A^T ({exc}); rmatvec and spectral_norm need it: "
                "give it an rmatvec"
            ) from None
        if out is None:
            return np.ascontiguousarray(res, dtype=self.dtype)
        out[...] = res
        return out


def from_linear_operator(L: Any) -> BatchedOperator:
    """A :class:`scipy.sparse.linalg.LinearOperator` (or matrix) as a batch of one operator.

    Parameters
    ----------
    L : LinearOperator, sparse matrix or 2-D array
        Real, float32 or float64 (anything else is computed in float64). Must
        support ``rmatvec``/``rmatmat`` for ``rmatvec`` and the spectral norm.

    Returns
    -------
    BatchedOperator
        ``batch == 1``, ``upper_bound()`` is ``inf`` (unknown).
    """
    from scipy.sparse.linalg import LinearOperator, aslinearoperator

    if isinstance(L, BatchedOperator):
        raise TypeError("L is already a pyengine BatchedOperator")
    if not isinstance(L, LinearOperator):
        try:
            L = aslinearoperator(L)
        except TypeError as exc:
            raise TypeError(f"L must be a scipy LinearOperator, sparse matrix or 2-D array; got {type(L).__name__}") from exc
    return _FromLinearOperator(L)


def as_linear_operator(op: BatchedOperator, i: int = 0) -> Any:
    """Operator ``i`` of the batch as a :class:`scipy.sparse.linalg.LinearOperator`.

    Parameters
    ----------
    op : BatchedOperator
    i : int, default 0
        Index into the batch, 0 <= i < op.batch.

    Returns
    -------
    scipy.sparse.linalg.LinearOperator
        Shape ``op.shape``, dtype ``op.dtype``; ``matvec``, ``rmatvec``,
        ``matmat`` and ``rmatmat`` call the batched products.
    """
    from scipy.sparse.linalg import LinearOperator

    op = _check_op("op", op)
    i = _v.index("i", i, op.batch)
    one = op.take(np.array([i]))
    m, n = op.shape

    def mv(v):
        return one.matvec(np.reshape(v, (1, n)))[0]

    def rmv(u):
        return one.rmatvec(np.reshape(u, (1, m)))[0]

    def mm(X):  # a batch-1 operator multiplies any number of rows
        return one.matvec(np.asarray(X).T).T

    def rmm(Y):
        return one.rmatvec(np.asarray(Y).T).T

    return LinearOperator(op.shape, matvec=mv, rmatvec=rmv, matmat=mm, rmatmat=rmm, dtype=op.dtype)


def as_batched_operator(a: Any) -> BatchedOperator:
    """A BatchedOperator as is; an array (m, n) / (B, m, n) as :class:`DenseOperator`;
    a scipy LinearOperator or sparse matrix via :func:`from_linear_operator`."""
    if isinstance(a, BatchedOperator):
        return a
    if isinstance(a, (np.ndarray, list, tuple)):
        return DenseOperator(a)
    try:
        return from_linear_operator(a)
    except TypeError:
        raise TypeError(
            f"op must be a pyengine BatchedOperator, an array of shape (m, n) or (B, m, n), or a "
            f"scipy LinearOperator; got {type(a).__name__}"
        ) from None
