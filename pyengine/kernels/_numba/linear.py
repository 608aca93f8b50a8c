"""Numba dense-layer kernels (``linear``, ``linear_act``, ``linear_mul``); the contract is the
reference's (:mod:`pyengine.kernels._reference.linear`).

The product is NumPy's BLAS (``np.matmul`` into the destination); the epilogue (bias,
residual, activation or coefficient, and the bad-row count) is one ``prange`` pass over
the rows, with the activation cores of :mod:`._vecmath` that the Numba activation kernels
use, so the results equal theirs element for element.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ...backends import register
from ._jit import fma_pjit
from ._vecmath import _nonfinite, _relu1, gelu_t, gelu_tanh_t

__all__ = ["linear", "linear_act", "linear_mul"]

_CODES = {"none": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


@fma_pjit
def _epilogue(p, b, has_b, r, has_r, act, coef, has_coef, out):
    """p += b, p += r; out = act(p) or p * coef; the rows of p with NaN/Inf."""
    nbad = 0
    n = p.shape[1]
    for i in prange(p.shape[0]):
        pr, o = p[i], out[i]
        bad = 0
        for j in range(n):
            v = pr[j]
            if has_b:
                v = v + b[j]
            if has_r:
                v = v + r[i, j]
            pr[j] = v
            bad |= _nonfinite(v)
            if has_coef:
                o[j] = v * coef[i % coef.shape[0], j]
            elif act == 1:
                o[j] = gelu_t(v)
            elif act == 2:
                o[j] = gelu_tanh_t(v)
            elif act == 3:
                o[j] = _relu1(v)
            else:
                o[j] = v
        nbad += bad
    return nbad


def _dummy(x: np.ndarray) -> np.ndarray:
    return np.empty((1, 1), x.dtype)


def _run(p, b, r, act, coef, out) -> int:
    d = _dummy(p)
    return int(_epilogue(p, d[0] if b is None else b, b is not None, d if r is None else r, r is not None, act,
                         d if coef is None else coef, coef is not None, out))


@register("linear", "numba")
def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, r: np.ndarray | None, out: np.ndarray) -> int:
    """out = x @ w (+ b) (+ r); the rows of the result with NaN/Inf."""
    if r is out:
        p = x @ w
        return _run(p, b, r, 0, None, out)
    np.matmul(x, w, out=out)
    return _run(out, b, r, 0, None, out)


@register("linear_act", "numba")
def linear_act(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, activation: str, u: np.ndarray | None,
               out: np.ndarray) -> int:
    """u = x @ w (+ b) (kept in u unless None), out = activation(u); the rows of u with NaN/Inf."""
    if activation not in _CODES:
        raise ValueError(f"activation must be one of {', '.join(map(repr, _CODES))}, got {activation!r}")
    p = out if u is None else u
    np.matmul(x, w, out=p)
    return _run(p, b, None, _CODES[activation], None, out)


@register("linear_mul", "numba")
def linear_mul(x: np.ndarray, w: np.ndarray, coef: np.ndarray, out: np.ndarray) -> int:
    """out = (x @ w) * coef; the rows of x @ w with NaN/Inf."""
    np.matmul(x, w, out=out)
    return _run(out, None, None, 0, coef, out)
