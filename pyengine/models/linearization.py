"""Linearization of a stack's blocks: :class:`BlockCache` and the JVP methods of a Stack.

:class:`Linearization` holds the methods :meth:`~pyengine.Stack.block_jvp` and
:meth:`~pyengine.Stack.block_jvp_diagonal`; :class:`~pyengine.models.stack.Stack`
inherits them (it is not used on its own). A :class:`BlockCache` is one block's
forward at one sequence, the point a JVP linearizes at: made by
``Stack.block_forward(..., return_cache=True)`` and ``Stack.forward(..., cache_from=)``.
The checks happen here, once per call; the block code (``_blocks.py``) then runs the
kernels directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _blocks, _fast
from .. import _validate as _v
from ._stacklike import StackLike

__all__ = ["BlockCache", "Linearization"]


class BlockCache:
    """One block's forward activations at one sequence: the point a JVP linearizes at.

    Made by :meth:`Stack.block_forward` (``return_cache=True``) and :meth:`Stack.forward`
    (``cache_from=``); taken by :meth:`Stack.block_jvp`, :meth:`Stack.block_jvp_diagonal`
    and, as ``past``, by :meth:`Stack.block_forward`. ``block``: the block index;
    ``h``: the block's input, (T, d_model), read-only, in the compute dtype. Activation
    derivatives and the row selections of ``start=`` and diagonal JVPs are computed once
    and kept in it.
    """

    __slots__ = ("_views", "block", "ctx", "data", "h", "stack")

    def __init__(self, stack: StackLike, block: int, h: np.ndarray, ctx: Any, data: dict[str, Any]) -> None:
        self.stack, self.block, self.h, self.ctx, self.data = stack, block, h, ctx, data
        self._views: dict[tuple[str, Any], tuple[Any, dict[str, Any]]] = {}

    def __repr__(self) -> str:
        return f"BlockCache(block={self.block}, h={self.h.shape} {self.h.dtype})"

    def _rows(self, start: int = 0, tokens: np.ndarray | None = None) -> tuple[Any, dict[str, Any]]:
        """(context, cache) of a JVP on rows start.. or on the diagonal blocks of ``tokens``; kept."""
        if tokens is None and not start:
            return self.ctx, self.data
        key = ("start", start) if tokens is None else ("tokens", tokens.tobytes())
        if key not in self._views:
            if len(self._views) >= 8:
                self._views.clear()
            self._views[key] = (_blocks.suffix(self.ctx, self.data, start) if tokens is None
                                else _blocks.diagonal(self.ctx, self.data, tokens))
        return self._views[key]


class Linearization:
    """The block-JVP methods of :class:`~pyengine.models.stack.Stack` (a base class of it)."""

    def _owns(self: StackLike, cache: Any, k: int, name: str = "cache") -> None:
        if not isinstance(cache, BlockCache):
            raise TypeError(f"{name} must be a BlockCache from block_forward(..., return_cache=True) or "
                            f"forward(..., cache_from=...); got {type(cache).__name__}")
        if cache.stack is not self or cache.block != k:
            owner = "this stack" if cache.stack is self else "another stack"
            raise ValueError(f"{name} belongs to block {cache.block} of {owner}, not to block {k} of this stack")

    def _linearize(self: StackLike, k: Any, h: Any, dh: Any, rows: Callable[[int], int], mode: str,
                   cache: BlockCache | None, arg: str = "dh") -> tuple[int, np.ndarray, bool, BlockCache]:
        """Checked block index, tangents (K, R, d) in h's dtype, whether dh had K, and the cache.

        ``rows(T)`` checks the row selection against h's T and returns the R dh must have;
        ``arg`` is dh's name in the messages (``"g"`` for the cotangents of a VJP).
        """
        k = self.block_index(k)
        _v.frozen(mode)
        if isinstance(cache, BlockCache) and h is cache.h:  # the cache's own point: checked when it was made
            x = h
        else:
            x3, batched = self.as_stream(h)
            if batched:
                raise ValueError(f"h must have shape (T, d_model) = (T, {self._config.d_model}); got {x3.shape}")
            x = x3[0]
        shape = (rows(x.shape[0]), x.shape[1])
        t = _v.float_array(arg, dh)
        if t.ndim not in (2, 3) or t.shape[-2:] != shape or t.shape[0] < 1:
            raise ValueError(f"{arg} must have shape {shape} or (K,) + {shape}; got {t.shape}")
        t = np.ascontiguousarray(t, dtype=x.dtype)
        _v.finite(arg, t)
        if cache is None:
            cache = self.block_forward(k, x, return_cache=True)[1]
        else:
            self._owns(cache, k)
            if x is not cache.h and (cache.h.shape != x.shape or cache.h.dtype != x.dtype
                                     or not np.array_equal(cache.h, x)):
                raise ValueError("cache was computed at a different h (or dtype) than the one given")
        return k, (t if t.ndim == 3 else t[None]), t.ndim == 3, cache

    def block_jvp(self: StackLike, k: int, h: Any, dh: Any, mode: str = "full", cache: BlockCache | None = None,
                  *, start: int = 0) -> np.ndarray:
        """Exact directional derivative of block k at ``h`` in direction(s) ``dh``.

        Parameters
        ----------
        k : int
            Block index.
        h : array_like, (T, d_model), float32 or float64
            Point of linearization (the block's input).
        dh : array_like, (T, d_model) or (K, T, d_model)
            One tangent or K tangents (computed together: one GEMM per weight);
            converted to h's dtype.
        mode : {"full", "frozen_scale"}
            Norm linearization: the true derivative, or every norm's scale held fixed.
        cache : BlockCache, optional
            Block k at the same h (from ``block_forward(k, h, return_cache=True)`` or
            :meth:`forward`); reused, also across calls. Passing ``h=cache.h`` skips
            comparing h with it.
        start : int in [0, T), optional
            The tangent is zero on the rows before ``start``, and dh holds only rows
            start .. T-1: (T - start, d_model) or (K, T - start, d_model). The result
            holds the same rows (with a causal mask the earlier rows of the output
            tangent are exactly zero). start > 0 needs a causal stack.

        Returns
        -------
        ndarray, dh's shape, h's dtype
        """
        def rows(T: int) -> int:
            nonlocal start
            start = _v.index_of("start", start, T, "a row of h")
            if start and not self._config.causal:
                raise ValueError("start > 0 needs a causal stack: without the mask every row of the "
                                 "output depends on every row of the input")
            return T - start

        k, t, many, cache = self._linearize(k, h, dh, rows, mode, cache)
        out = self.jvp_rows(cache, t, mode, start)
        return out if many else out[0]

    def jvp_rows(self: StackLike, cache: BlockCache, t: np.ndarray, mode: str, start: int = 0) -> np.ndarray:
        """:meth:`block_jvp` of block ``cache.block`` at ``cache.h`` without its checks.

        The caller guarantees what block_jvp checks: ``t`` (K, T - start, d_model),
        C-contiguous, in the cache's dtype, finite; ``mode`` valid; ``start`` in [0, T),
        > 0 only for a causal stack. Returns (K, T - start, d_model).
        """
        ctx, data = cache._rows(start=start)
        return _blocks.block_jvp(self._params(t.dtype)[0][cache.block], ctx, t, data, mode)

    def forward_rows(self: StackLike, past: BlockCache, x: np.ndarray) -> np.ndarray:
        """:meth:`block_forward` ``(past.block, x, past=past)`` without its checks.

        The caller guarantees what block_forward checks: ``x`` (B, T', d_model),
        C-contiguous, in past's dtype, finite, T' <= T (T' < T only for a causal stack).
        Returns (B, T', d_model): the block's output on the last T' rows.
        """
        T, n = past.h.shape[0], x.shape[1]
        ctx = _blocks.make_context(self._config, T, x.dtype, T - n, block=past.block)
        data = {_fast.DISCARD: True, "attn.past": past.data}
        return _blocks.block_forward(self._params(x.dtype)[0][past.block], ctx, x, data)

    def block_jvp_diagonal(self: StackLike, k: int, h: Any, dh: Any, tokens: Any, mode: str = "full",
                           cache: BlockCache | None = None) -> np.ndarray:
        """The per-token diagonal blocks of block k's Jacobian at ``h``, applied to ``dh``.

        A_t = d out_t / d h_t (d_model x d_model) maps a change of the block input at
        token t to the change of its output at the same token; ``out[..., r, :] =
        A_{tokens[r]} @ dh[..., r, :]``. With a causal mask the Jacobian over all T
        tokens is block lower-triangular, so its eigenvalues are those of the A_t.

        Parameters
        ----------
        k : int
            Block index.
        h : array_like, (T, d_model), float32 or float64
        dh : array_like, (R, d_model) or (K, R, d_model)
            Row r of a tangent perturbs token ``tokens[r]`` only; converted to h's dtype.
        tokens : array_like of int, (R,), R >= 1
            Token positions in [0, T), in any order (TypeError if not integers,
            IndexError if out of range).
        mode, cache
            As :meth:`block_jvp`.

        Returns
        -------
        ndarray, dh's shape, h's dtype
        """
        sel = []

        def rows(T: int) -> int:
            sel.append(_v.indices("tokens", tokens, T))
            if sel[0].size == 0:
                raise ValueError("tokens selects no token")
            return sel[0].size

        k, t, many, cache = self._linearize(k, h, dh, rows, mode, cache)
        rows = sel[0]
        ctx, data = cache._rows(tokens=rows)
        out = _blocks.block_jvp(self._params(t.dtype)[0][k], ctx, t, data, mode)
        return out if many else out[0]
