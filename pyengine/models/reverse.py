"""Reverse mode of a stack: :meth:`Stack.block_vjp` (with weight gradients) and :meth:`Stack.vjp`.

:class:`ReverseMode` holds the methods; :class:`~pyengine.models.stack.Stack` inherits
them (it is not used on its own). A VJP pulls cotangents (gradients of a scalar with
respect to a block's output) back through the block, at the same linearization point
as :meth:`Stack.block_jvp` and as its exact transpose: for every u, v,
``<u, block_jvp(k, h, v)> = <block_vjp(k, h, u), v>`` (to rounding), in every
architecture a :class:`~pyengine.models.config.StackConfig` describes. The checks
happen here, once per call; the block code (``_blocks_vjp.py``) runs BLAS GEMMs and
the raw kernels (norm VJPs, activation derivatives, the attention score gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _blocks_vjp
from .. import _validate as _v
from ._stacklike import StackLike
from .linearization import BlockCache

__all__ = ["ReverseMode"]


class ReverseMode:
    """The VJP methods of :class:`~pyengine.models.stack.Stack` (a base class of it)."""

    def block_vjp(self: StackLike, k: int, h: Any, g: Any, mode: str = "full", cache: BlockCache | None = None,
                  *, weights: bool = False) -> Any:
        """Vector-Jacobian product of block k at ``h``: ``J^T g``, the transpose of :meth:`block_jvp`.

        Parameters
        ----------
        k : int
            Block index (negative counts from the end).
        h : array_like, (T, d_model), float32 or float64
            Point of linearization (the block's input).
        g : array_like, (T, d_model) or (R, T, d_model)
            One cotangent of the block's output, or R of them (computed together: one GEMM
            per weight); converted to h's dtype.
        mode : {"full", "frozen_scale"}
            As :meth:`block_jvp`: this is the transpose of that linearization.
        cache : BlockCache, optional
            Block k at the same h (from ``block_forward(k, h, return_cache=True)`` or
            :meth:`forward`), shared with :meth:`block_jvp`; reused, also across calls.
        weights : bool
            Also return the gradients of ``L = sum_r <g[r], block_k(h)>`` with respect to
            every array of block k (needs mode "full"). The weights' VJP is linear in the
            cotangent, so R cotangent rows give the gradient of their sum.

        Returns
        -------
        ndarray, g's shape, h's dtype
            ``dL/dh`` per cotangent row.
        (ndarray, dict str -> ndarray), if ``weights``
            And the weight gradients, keyed by the Stack's names (``blocks.<k>.attn.w_qkv``,
            ...; the keys of :attr:`weights` that start with ``blocks.<k>.``), each of its
            array's shape, in h's dtype. Gradients of ``*.gamma`` are with respect to the
            stored gamma (the block computes with ``gamma_scale * gamma``).

        Raises
        ------
        TypeError, ValueError
            Bad k, h, g (naming the argument), mode, cache, or weights with mode
            "frozen_scale".
        """
        if not isinstance(weights, (bool, np.bool_)):
            raise TypeError(f"weights must be True or False; got {weights!r}")
        if weights and _v.frozen(mode):
            raise ValueError("weights=True needs mode='full' (weight gradients of the true block)")
        k, t, many, cache = self._linearize(k, h, g, lambda T: T, mode, cache, arg="g")
        grads: dict[str, np.ndarray] | None = {} if weights else None
        out = self.vjp_rows(cache, t, mode, grads)
        out = out if many else out[0]
        if grads is None:
            return out
        prefix, gs = f"blocks.{k}.", self._config.gamma_scale
        named = {}
        for name in self._weights:
            if name.startswith(prefix):
                a = grads[name[len(prefix):]]
                named[name] = a * a.dtype.type(gs) if name.endswith(".gamma") and gs != 1.0 else a
        return out, named

    def vjp_rows(self: StackLike, cache: BlockCache, t: np.ndarray, mode: str,
                  grads: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """:meth:`block_vjp` of block ``cache.block`` at ``cache.h`` without its checks.

        The caller guarantees what block_vjp checks: ``t`` (K, T, d_model), C-contiguous,
        in the cache's dtype, finite; ``mode`` valid (and "full" with ``grads``, a dict
        the weight gradients are written to). Returns (K, T, d_model).
        """
        return _blocks_vjp.block_vjp(self._params(t.dtype)[0][cache.block], cache.ctx, t, cache.data, mode, grads)

    def vjp(self: StackLike, input_ids: Any, g: Any, from_layer: int = -1, to_layer: int = 0, mode: str = "full",
            *, caches: Sequence[BlockCache] | None = None) -> np.ndarray:
        """Pull cotangents of hidden state ``from_layer`` back to hidden state ``to_layer``.

        With ``hidden = hidden_states(input_ids)`` (index i: the stream before block i;
        n_layers: after the last block), this is ``(d hidden[from_layer] / d hidden[to_layer])^T g``:
        the block VJPs of blocks from_layer - 1 down to to_layer, chained. Positions,
        the embedding norm and the final norm are outside it.

        Parameters
        ----------
        input_ids : array_like or None
            One sequence: ids (T,) or a float stream (T, d_model) (as :meth:`forward`;
            the forward runs once here). None when ``caches`` are given.
        g : array_like, (T, d_model) or (R, T, d_model)
            Cotangent(s) of ``hidden[from_layer]``; converted to the compute dtype (the
            stream's dtype, or the stack's for ids).
        from_layer, to_layer : int
            Hidden-state indices in [0, n_layers] (negative counts from the end, -1 is the
            last), ``to_layer <= from_layer``; equal indices return g.
        mode : {"full", "frozen_scale"}
            As :meth:`block_jvp`.
        caches : sequence of BlockCache, optional
            From :meth:`forward` (``cache_from <= to_layer``) of this stack: the blocks
            to_layer .. from_layer - 1 are taken from them and no forward runs.

        Returns
        -------
        ndarray, g's shape, the compute dtype
            ``dL/d hidden[to_layer]`` per cotangent row.
        """
        n = self._config.n_layers
        hi = _v.index_of("from_layer", from_layer, n + 1, "a hidden-state index", negative=True)
        lo = _v.index_of("to_layer", to_layer, n + 1, "a hidden-state index", negative=True)
        if lo > hi:
            raise ValueError(f"to_layer = {lo} must be <= from_layer = {hi}: a VJP pulls back to an earlier "
                             "hidden state")
        _v.frozen(mode)
        if caches is None:
            if input_ids is None:
                raise ValueError("input_ids is None: pass one sequence, or caches from forward(cache_from=...)")
            hidden, kept = self.forward(input_ids, cache_from=min(lo, n - 1))
            T, dtype = hidden.shape[1], hidden.dtype
            by_block = {c.block: c for c in kept}
        else:
            if input_ids is not None:
                raise ValueError("pass input_ids or caches, not both (the caches fix the sequence)")
            by_block = {}
            for c in caches:
                if not isinstance(c, BlockCache) or c.stack is not self:
                    raise TypeError("caches must be BlockCaches of this stack (from forward(..., cache_from=...))")
                by_block[c.block] = c
            missing = [b for b in range(lo, hi) if b not in by_block]
            if missing or not by_block:
                raise ValueError(f"caches lack block(s) {missing}: they must cover blocks {lo} .. {hi - 1}")
            first = by_block[min(by_block)].h
            T, dtype = first.shape[0], first.dtype
        shape = (T, self._config.d_model)
        t = _v.float_array("g", g)
        if t.ndim not in (2, 3) or t.shape[-2:] != shape or t.shape[0] < 1:
            raise ValueError(f"g must have shape {shape} or (R,) + {shape}; got {t.shape}")
        t = np.array(t, dtype=dtype, order="C")  # a copy: g is never modified, also when lo == hi
        _v.finite("g", t)
        many, t = t.ndim == 3, (t if t.ndim == 3 else t[None])
        blocks = self._params(dtype)[0]
        for b in range(hi - 1, lo - 1, -1):
            c = by_block[b]
            if c.h.shape != shape or c.h.dtype != dtype:
                raise ValueError(f"caches must come from one forward: block {b}'s is at {c.h.shape} {c.h.dtype}")
            t = _blocks_vjp.block_vjp(blocks[b], c.ctx, t, c.data, mode)
        return t if many else t[0]
