"""Numba Newton–Schulz orthogonalization (``newton_schulz``); the contract is the reference's
(:mod:`pyengine.kernels._reference.orthogonalize`).

The products are NumPy's (threaded OpenBLAS): ``x @ x.T`` and ``A @ A.T`` are the symmetric
products NumPy computes with syrk (half a gemm's flops, as the C++ kernel's syrk), so a
step costs 4 n³ for a square n x n matrix, not 6 n³. The norm is a float64 loop in a fixed
order and the scalings and sums are Numba loops, so a step is three BLAS calls (two for
c = 0) and two passes over the s x s and m x n arrays.
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
def _scaled(g, inv, x):
    """x = g * inv, elementwise (g may be any dtype; x is the output's)."""
    fg, fx = g.ravel(), x.ravel()
    for i in range(fx.size):
        fx[i] = fg[i] * inv


@jit
def _axpby(y, a, x, b):
    """y = a x + b y in place (c = 0 folds P = b A; the A² term is y)."""
    fy, fx = y.ravel(), x.ravel()
    for i in range(fy.size):
        fy[i] = a * fx[i] + b * fy[i]


@register("newton_schulz", "numba")
def newton_schulz(g: np.ndarray, coeffs: np.ndarray, out: np.ndarray) -> int:
    """Newton–Schulz steps ``coeffs`` (S, 3) on each G = g[k] / ||g[k]||_F into ``out``; bad matrices."""
    cf = coeffs.astype(g.dtype)
    bad = 0
    wide = g.shape[1] <= g.shape[2]
    for k in range(g.shape[0]):
        nrm = _frobenius(g[k])
        if not np.isfinite(nrm):
            bad += 1
            continue
        if nrm == 0.0:
            out[k] = 0
            continue
        x = np.empty(g.shape[1:], g.dtype)
        _scaled(g[k], 1.0 / nrm, x)
        for a, b, c in cf:
            gram = x @ x.T if wide else x.T @ x  # syrk: NumPy sees a matrix times its own transpose
            if c != 0:
                poly = gram @ gram.T  # A² = A Aᵀ (A is symmetric): syrk again
                _axpby(poly, b, gram, c)
            else:
                poly = gram * b
            y = poly @ x if wide else x @ poly
            _axpby(y, a, x, 1.0)
            x = y
        out[k] = x
    return bad
