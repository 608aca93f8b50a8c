"""Matrix-free spectra of whole-block Jacobians: :class:`BlockJacobian` and :func:`block_jacobian_norm`.

Block k of a stack maps its input stream h (T, d) to its output (T, d); its Jacobian
J (T*d x T*d) couples every token to every other (block lower-triangular with a causal
mask). :class:`BlockJacobian` is the batch of these Jacobians at B prompts as a
:class:`~pyengine.linalg.BatchedOperator`: ``matvec`` is :meth:`pyengine.Stack.block_jvp`
and ``rmatvec`` :meth:`pyengine.Stack.block_vjp` (its exact transpose), so the
spectral solvers of :mod:`pyengine.linalg` (power iteration, Lanczos on J^T J) give
sigma_max of all T*d inputs without forming J: each iteration costs one block JVP and
one block VJP per prompt. Vectors are the flattened streams, index ``t * d + i``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from ..linalg import BatchedOperator, SpectralResult, spectral_norm

__all__ = ["BlockJacobian", "block_jacobian_norm"]


class BlockJacobian(BatchedOperator):
    """The Jacobians of block ``k`` of ``stack`` at B prompts, each (T*d, T*d), matrix-free.

    Parameters
    ----------
    stack : Stack
    h : array_like, (T, d_model) or (B, T, d_model), float32 or float64
        Block k's inputs (e.g. ``stack.hidden_states(ids)[k]``), one per prompt; their
        dtype is the operator's.
    k : int
        Block index (negative counts from the end).
    mode : {"full", "frozen_scale"}
        As :meth:`pyengine.Stack.block_jvp`.

    The block's forward runs once per prompt here (its cache is kept); ``take`` shares
    the caches.
    """

    def __init__(self, stack: Any, h: Any, k: int, mode: str = "full") -> None:
        if not hasattr(stack, "block_vjp"):
            raise TypeError(f"stack must be a pyengine Stack; got {type(stack).__name__}")
        _v.frozen(mode)
        k = stack.block_index(k)
        x, _ = stack.as_stream(h)
        self._init(stack, k, mode, [stack.block_forward(k, x[b], return_cache=True)[1] for b in range(x.shape[0])])

    def _init(self, stack: Any, k: int, mode: str, caches: list[Any]) -> None:
        T, d = caches[0].h.shape
        super().__init__(len(caches), (T * d, T * d), caches[0].h.dtype)
        self.stack, self.block, self.mode, self.caches = stack, k, mode, caches

    def _apply(self, method: str, V: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        T, d = self.caches[0].h.shape
        res = np.empty(V.shape, self.dtype) if out is None else out
        shared = len(self.caches) != V.shape[0]  # batch 1: one Jacobian applied to each of the k rows
        for r in range(V.shape[0]):
            c = self.caches[0 if shared else r]
            res[r] = getattr(self.stack, method)(self.block, c.h, V[r].reshape(T, d), self.mode, c).reshape(-1)
        return res

    def _matvec(self, V: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        return self._apply("block_jvp", V, out)

    def _rmatvec(self, U: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        return self._apply("block_vjp", U, out)

    def take(self, idx: Any) -> BlockJacobian:
        idx = self._indices(idx)
        if len(idx) == 0:
            raise ValueError("idx must select at least one operator")
        new = BlockJacobian.__new__(BlockJacobian)
        new._init(self.stack, self.block, self.mode, [self.caches[i] for i in idx])
        return new


def block_jacobian_norm(stack: Any, input_ids: Any, k: int, *, method: str = "lanczos", mode: str = "full",
                        tol: float = 1e-6, max_iter: int = 1000, seed: int | None = 0) -> SpectralResult:
    """sigma_max of the whole Jacobian of block ``k`` (all T*d inputs) at each prompt.

    Parameters
    ----------
    stack : Stack
    input_ids : array_like
        Prompts of equal length: ids (T,) or (B, T), or float streams (T, d_model) or
        (B, T, d_model) in place of the embeddings (as :meth:`pyengine.Stack.hidden_states`);
        the stack runs up to block k and the Jacobian is taken at block k's input.
    k : int
        Block index (negative counts from the end).
    method : {"lanczos", "power"}
        The solver of :func:`pyengine.spectral_norm` (Lanczos on J^T J by default).
    mode : {"full", "frozen_scale"}
        As :meth:`pyengine.Stack.block_jvp`.
    tol, max_iter, seed
        As :func:`pyengine.spectral_norm`.

    Returns
    -------
    SpectralResult
        Arrays of shape (B,) (one prompt: (1,)); ``upper`` is inf (no cheap bound).
    """
    if not hasattr(stack, "hidden_states"):
        raise TypeError(f"stack must be a pyengine Stack; got {type(stack).__name__}")
    _v.choice("method", method, ("lanczos", "power"))
    k = stack.block_index(k)
    _v.frozen(mode)
    hidden = stack.hidden_states(input_ids)
    h = hidden[k]
    return spectral_norm(BlockJacobian(stack, h, k, mode), method=method, tol=tol, max_iter=max_iter, seed=seed)
