"""Numba attention heads of the block engine (``linear_attention_forward``, ``linear_attention_jvp``);
the contract is the reference's (:mod:`pyengine.kernels._reference.linear_attention`).

``prange`` over the tasks (sequence or tangent, query head), as ``csrc/linear_attention.hpp``;
each task copies its head's slices into contiguous arrays and makes its products with
``np.dot`` (SciPy's BLAS, single-threaded in each Numba thread under
:func:`~pyengine.backends.one_blas_thread`); the softmax and the softmax JVP run on the
task's (tq, tk) rows with float64 sums. A task's result does not depend on the thread
count. Unlike the C++ kernels, every row multiplies all tk keys (no row blocks over the
keys a block sees): masked keys have probability 0 and add exact zeros.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg  # noqa: F401  (np.dot's BLAS: loaded before one_blas_thread() limits it)
from numba import prange

from ...backends import one_blas_thread, register
from ._jit import pjit
from ._vecmath import like

__all__ = ["linear_attention_forward", "linear_attention_jvp"]


@pjit
def _forward(qkv, kp, vp, H, offset, scale, out):
    B, tq, _, dh = qkv.shape
    Hkv, s = kp.shape[0], kp.shape[1]
    g, tk = H // Hkv, s + tq
    nbad = 0
    for task in prange(B * H):
        b, h = task // H, task % H
        j = h // g
        keys = np.empty((tk, dh), qkv.dtype)
        values = np.empty((tk, dh), qkv.dtype)
        keys[:s] = kp[j]
        values[:s] = vp[j]
        keys[s:] = qkv[b, :, H + j]
        values[s:] = qkv[b, :, H + Hkv + j]
        sc = np.dot(np.ascontiguousarray(qkv[b, :, h]), keys.T)  # (tq, tk)
        bad = 0
        for t in range(tq):
            row = sc[t]
            n = min(tk, offset + t + 1)
            m = -np.inf
            for c in range(n):
                x = scale * np.float64(row[c])
                if x > m:
                    m = x
            total = 0.0
            for c in range(n):
                e = np.exp(scale * np.float64(row[c]) - m)
                row[c] = e
                total += e
            if not total >= 1.0:  # NaN or +Inf among the visible scores, or none finite
                row[:] = np.nan
                bad += 1
                continue
            inv = 1.0 / total
            for c in range(n):
                row[c] = np.float64(row[c]) * inv
            row[n:] = 0
        out[b, :, h] = np.dot(sc, values)
        nbad += bad
    return nbad


@pjit
def _jvp(dqkv, q, k, v, p, start, scale, out):
    K, tq, _, dh = dqkv.shape
    Hkv, g = q.shape[0], q.shape[1]
    H, tk = Hkv * g, k.shape[1]
    nbad = 0
    for task in prange(K * H):
        r, h = task // H, task % H
        j, i = h // g, h % g
        dk = np.ascontiguousarray(dqkv[r, :, H + j])
        dv = np.ascontiguousarray(dqkv[r, :, H + Hkv + j])
        ds = np.dot(np.ascontiguousarray(dqkv[r, :, h]), k[j].T)  # (tq, tk)
        qdk = np.dot(q[j, i], dk.T)  # (tq, tq): the moved keys start..
        ph = p[j, i]
        bad = 0
        for t in range(tq):
            row, pr = ds[t], ph[t]
            for c in range(tk):
                row[c] *= scale
            for c in range(tq):
                row[start + c] += qdk[t, c]
            total = 0.0
            for c in range(tk):
                total += np.float64(pr[c]) * np.float64(row[c])
            if not np.isfinite(total):
                bad += 1
            st = like(row[0], total)  # the sum rounded to the dtype once, as the C++ kernel
            for c in range(tk):
                row[c] = pr[c] * (row[c] - st)
        out[r, :, h] = np.dot(ds, v[j]) + np.dot(np.ascontiguousarray(ph[:, start:]), dv)
        nbad += bad
    return nbad


@register("linear_attention_forward", "numba")
def linear_attention_forward(qkv, kp, vp, n_heads, offset, scale, out):
    """out = softmax(scale q k^T, keys j <= offset + t) v per sequence and head; the bad rows."""
    if out.size == 0:
        return 0
    with one_blas_thread():
        return _forward(qkv, kp, vp, int(n_heads), int(offset), float(scale), out)


@register("linear_attention_jvp", "numba")
def linear_attention_jvp(dqkv, q, k, v, p, start, scale, out):
    """out = dP V + P[:, start:] dV per tangent and head; the bad rows."""
    if out.size == 0:
        return 0
    with one_blas_thread():
        return _jvp(dqkv, q, k, v, p, int(start), float(scale), out)
