"""Numba Newton–Schulz orthogonalization (``newton_schulz``); the contract is the reference's
(:mod:`pyengine.kernels._reference.orthogonalize`).

The products go to BLAS through ``np.dot`` (Numba calls SciPy's BLAS); the norm is a
float64 loop in a fixed order, and the scalings and sums are fused loops, so a step is
three BLAS calls (two for c = 0) and two passes over the s x s and m x n arrays.
"""

from __future__ import annotations

import numpy as np

from ...backends import register
from ._jit import jit

__all__ = ["newton_schulz"]


@jit
def _frobenius(x):
    acc = 0.0
    flat = x.ravel()
    for i in range(flat.size):
        v = np.float64(flat[i])
        acc += v * v
    return np.sqrt(acc)


@jit
def _poly(gram, b, c):
    """b A + c A² (a new array); A² skipped when c = 0."""
    if c != 0:
        res = np.dot(gram, gram)
        fl, gl = res.ravel(), gram.ravel()
        for i in range(fl.size):
            fl[i] = b * gl[i] + c * fl[i]
        return res
    res = gram.copy()
    fl = res.ravel()
    for i in range(fl.size):
        fl[i] *= b
    return res


@jit
def _newton_schulz(g, cf, out):
    bad = 0
    m, n = g.shape[1], g.shape[2]
    wide = m <= n
    for k in range(g.shape[0]):
        nrm = _frobenius(g[k])
        if not np.isfinite(nrm):
            bad += 1
            continue
        if nrm == 0.0:
            out[k] = 0
            continue
        x = np.empty((m, n), g.dtype)
        inv = 1.0 / nrm
        for i in range(m):
            for j in range(n):
                x[i, j] = g[k, i, j] * inv
        for s in range(cf.shape[0]):
            a, b, c = cf[s, 0], cf[s, 1], cf[s, 2]
            if wide:
                y = np.dot(_poly(np.dot(x, x.T), b, c), x)
            else:
                y = np.dot(x, _poly(np.dot(x.T, x), b, c))
            fy, fx = y.ravel(), x.ravel()
            for i in range(fy.size):
                fy[i] += a * fx[i]
            x = y
        out[k] = x
    return bad


@register("newton_schulz", "numba")
def newton_schulz(g: np.ndarray, coeffs: np.ndarray, out: np.ndarray) -> int:
    """Newton–Schulz steps ``coeffs`` (S, 3) on each G = g[k] / ||g[k]||_F into ``out``; bad matrices."""
    return int(_newton_schulz(g, coeffs.astype(g.dtype), out))
