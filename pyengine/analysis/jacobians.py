"""Dense per-token Jacobian blocks of one transformer block: :func:`token_jacobians`.

Built column by column from :meth:`pyengine.Stack.block_jvp_diagonal`: a chunk of
basis vectors goes through one batched JVP.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from .propagate import resolve_positions

__all__ = ["token_jacobians"]


def token_jacobians(
    model: Any, h: Any, block: int, tokens: Any, *, mode: str = "full", chunk: int = 256
) -> np.ndarray:
    """Dense per-token diagonal blocks d out_t / d h_t of block ``block`` at its input ``h``.

    With a causal mask the Jacobian of a block over all T tokens is block
    lower-triangular, so its eigenvalues are those of these (d, d) blocks.

    Parameters
    ----------
    model : Stack
    h : array_like, (T, d_model), float32 or float64
        The block's input (e.g. ``model.hidden_states(ids)[block]``); its dtype is
        the compute dtype.
    block : int
        Block index (0-based: block k maps hidden state k to k + 1).
    tokens : "all", "last", int, slice or sequence of ints
        Positions t (negative count from the end); used sorted and without repeats.
    mode : {"full", "frozen_scale"}
    chunk : int
        Basis vectors pushed through one batched JVP.

    Returns
    -------
    ndarray, (R, d_model, d_model), h's dtype: ``A[r] @ u`` is the change of the
    block output at the r-th selected token per change u of the input at that token.
    """
    k = model.block_index(block)
    _v.frozen(mode)
    chunk = _v.count("chunk", chunk)
    x, batched = model.as_stream(h)
    if batched:
        raise ValueError(f"h must have shape (T, d_model); got {x.shape}")
    T, d = x.shape[1:]
    rows = resolve_positions(tokens, T)
    _, cache = model.block_forward(k, x[0], return_cache=True)
    out = np.empty((rows.size, d, d), x.dtype)
    for i0 in range(0, d, chunk):
        i1 = min(d, i0 + chunk)
        basis = np.zeros((i1 - i0, rows.size, d), x.dtype)
        basis[np.arange(i1 - i0), :, np.arange(i0, i1)] = 1.0
        cols = model.block_jvp_diagonal(k, cache.h, basis, rows, mode, cache)  # (n, R, d): columns i0..i1 of each A_r
        out[:, :, i0:i1] = cols.transpose(1, 2, 0)
    return out
