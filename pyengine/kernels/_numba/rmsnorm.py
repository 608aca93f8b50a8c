"""Numba kernels of RMSNorm: forward, JVP, VJP and dense Jacobian.

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference`, and
the same layout as :mod:`.layernorm` (whose docstring explains it): a per-token core
``_<kernel id>_row``, run by the registered batch kernel under ``prange`` over chunks of
rows only; reductions in float64 in a fixed order (:mod:`._reduce`), a single
pass over the row for the sums (RMSNorm has centre 0), and the writing pass
prefetching the next row in blocks of ``layernorm._BLOCK`` (and streaming long rows of large
outputs, ``layernorm.STREAM_SHORT_ROW_MIN_BYTES``). The dense Jacobian shares
LayerNorm's writer (:func:`.layernorm._dense_jacobian`, centre 0).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ...backends import register
from ._formula import block_writer
from ._intrinsics import store_fence
from ._jit import inline, jit, pjit
from ._reduce import _f64, _rms_slow, _safe, _scale, _sum_sq, _sum_sq_dot, _sum_sq_dot_gu
from .layernorm import (
    STREAM_SHORT_ROW_MIN_BYTES,
    _BLOCK,
    _CHUNKS,
    _dense_jacobian,
    _prefetch_block,
    _prefetch_out,
    _prefetch_out_head,
    _stream_rows,
    _tangent_batch,
)

__all__ = ["rms_norm", "rms_norm_jacobian", "rms_norm_jvp", "rms_norm_vjp"]


# --------------------------------------------------------------------------- #
# Per-token cores, as in layernorm.py. Each returns True for a bad row.
# --------------------------------------------------------------------------- #

# The writing passes (layernorm.py's, with centre 0).
_write_rms = block_writer(lambda g, x, inv: g * (x * inv))
_write_rms_jvp = block_writer(lambda g, v, x, c, inv: g * ((v - x * c) * inv))
_write_rms_vjp = block_writer(lambda g, u, x, c, inv: (g * u - x * c) * inv)


@inline
def _rms_scale(x, eps):
    """(r, bad) of one row; a row of extreme magnitude is rescaled (:func:`._reduce._rms_slow`)."""
    ms = _sum_sq(x, 0.0) / x.size
    if _safe(ms, eps, 0.0):
        return _scale(ms, eps)
    r, _, bad = _rms_slow(x, eps, x, x, False, False)
    return r, bad


@jit
def _rms_norm_row(x, gamma, eps, out, x_next, stream):
    """out = gamma * x / r, r = sqrt(mean(x^2) + eps)."""
    d = x.size
    _prefetch_out_head(out, stream)
    r, bad = _rms_scale(x, eps)
    inv = 1.0 / r
    nb = d // _BLOCK
    for j in range(nb):
        o = j * _BLOCK
        _prefetch_block(x_next, o)
        _prefetch_out(out, o, stream)
        _write_rms(out, o, _BLOCK, stream, (gamma, x), (inv,))
    _write_rms(out, nb * _BLOCK, d - nb * _BLOCK, stream, (gamma, x), (inv,))
    return bad


@jit
def _rms_norm_jvp_row(x, v, gamma, eps, frozen, out, x_next, v_next, stream):
    """out = gamma/r * (v - x mean(x v)/r^2); frozen: gamma * v / r."""
    d = x.size
    _prefetch_out_head(out, stream)
    # sum(x v) is needed for frozen=True too: it is non-finite iff v has NaN/Inf.
    q, dot = _sum_sq_dot(x, 0.0, v)
    if _safe(q / d, eps, 0.0):
        r, bad = _scale(q / d, eps)
        c = 0.0 if frozen else (dot / d) / (r * r)  # mean(x w) / r^2
        bad = bad or not np.isfinite(dot)
    else:  # a row of extreme magnitude: its statistics, rescaled
        r, c, bad = _rms_slow(x, eps, v, gamma, False, True)
        c = 0.0 if frozen else c
    inv = 1.0 / r
    nb = d // _BLOCK
    for j in range(nb):
        o = j * _BLOCK
        _prefetch_block(x_next, o)
        _prefetch_block(v_next, o)
        _prefetch_out(out, o, stream)
        _write_rms_jvp(out, o, _BLOCK, stream, (gamma, v, x), (c, inv))
    _write_rms_jvp(out, nb * _BLOCK, d - nb * _BLOCK, stream, (gamma, v, x), (c, inv))
    return bad


@jit
def _rms_norm_vjp_row(x, u, gamma, eps, frozen, out, x_next, u_next, stream):
    """out = (g - x mean(x g)/r^2) / r with g = gamma * u; frozen: g / r."""
    d = x.size
    _prefetch_out_head(out, stream)
    q, dot = _sum_sq_dot_gu(x, 0.0, gamma, u)
    if _safe(q / d, eps, 0.0):
        r, bad = _scale(q / d, eps)
        c = 0.0 if frozen else (dot / d) / (r * r)  # mean(x w) / r^2
        bad = bad or not np.isfinite(dot)
    else:  # a row of extreme magnitude: its statistics, rescaled
        r, c, bad = _rms_slow(x, eps, u, gamma, True, True)
        c = 0.0 if frozen else c
    inv = 1.0 / r
    nb = d // _BLOCK
    for j in range(nb):
        o = j * _BLOCK
        _prefetch_block(x_next, o)
        _prefetch_block(u_next, o)
        _prefetch_out(out, o, stream)
        _write_rms_vjp(out, o, _BLOCK, stream, (gamma, u, x), (c, inv))
    _write_rms_vjp(out, nb * _BLOCK, d - nb * _BLOCK, stream, (gamma, u, x), (c, inv))
    return bad


# --------------------------------------------------------------------------- #
# Registered batch kernels: prange over rows (tokens) only; row r prefetches row
# nx = min(r + 1, n - 1).
# --------------------------------------------------------------------------- #


@register("rms_norm", "numba")
@pjit
def rms_norm(x, gamma, eps, out):
    """x, out : (n, d); gamma : (d,). Returns the number of bad rows."""
    n = x.shape[0]
    nbad = 0
    nc = min(n, _CHUNKS)
    stream = _stream_rows(out, STREAM_SHORT_ROW_MIN_BYTES)
    for c in prange(nc):
        for r in range(c * n // nc, (c + 1) * n // nc):
            nx = min(r + 1, n - 1)
            if _rms_norm_row(x[r], gamma, eps, out[r], x[nx], stream):
                nbad += 1
        if stream:
            store_fence()
    return nbad


_rms_norm_jvp_batch = _tangent_batch(_rms_norm_jvp_row)
_rms_norm_vjp_batch = _tangent_batch(_rms_norm_vjp_row)


@register("rms_norm_jvp", "numba")
@jit
def rms_norm_jvp(x, v, gamma, eps, frozen, out):
    """x, v, out : (n, d); gamma : (d,). Returns the number of bad rows."""
    return _rms_norm_jvp_batch(x, v, gamma, eps, frozen, out)


@register("rms_norm_vjp", "numba")
@jit
def rms_norm_vjp(x, u, gamma, eps, frozen, out):
    """x, u, out : (n, d); gamma : (d,). Returns the number of bad rows."""
    return _rms_norm_vjp_batch(x, u, gamma, eps, frozen, out)


@register("rms_norm_jacobian", "numba")
@pjit
def rms_norm_jacobian(x, gamma, eps, frozen, out):
    """x : (n, d); gamma : (d,); out : (n, d, d). Returns the number of bad rows."""
    n = x.shape[0]
    r = np.empty(n, dtype=np.float64)
    bad = np.empty(n, dtype=np.bool_)
    for t in prange(n):
        r[t], bad[t] = _rms_scale(x[t], eps)
    _dense_jacobian(x, gamma, np.zeros(n), r, 0.0, frozen, out)
    return np.count_nonzero(bad)
