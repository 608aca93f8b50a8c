"""Numba kernels of the MLP activations and their derivatives (the softmax is in :mod:`.softmax`).

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference.activations`
(C-contiguous float32 or float64 arrays, preallocated outputs, ``out`` possibly the
input itself, the number of bad rows returned); the formulas are in its docstring.

Every batch kernel runs ``prange`` over rows only, so each row is computed by one
thread in an order fixed by the source and results do not depend on the number of
threads. float64 input is computed in float64; float32 input of the forward GELUs
and gated SiLU in float32 by the ``*_f`` cores of :mod:`._vecmath` (dispatched on
the dtype at compile time: ``gelu_t`` ...), everything else in float64 and cast to
the dtype of the output on the store. The transcendental functions are the branch-free cores of
:mod:`._vecmath`, inlined, so the elementwise loops vectorize as they are. The
bad-row flag is a boolean OR over the row, which LLVM vectorizes without
reassociation. Numba options: :mod:`._jit` (``fma_pjit``: fast-math ``contract`` only,
as ``_jit.FASTMATH`` explains; the bad-row tests need NaN and Inf).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ...backends import ACTIVATION_KERNELS, register
from ._jit import fma_pjit
from ._vecmath import (
    _gelu_grad1,
    _gelu_tanh_grad1,
    _nonfinite,
    _relu1,
    _relu_grad1,
    _sigmoid_pair,
    gelu_t,
    gelu_tanh_t,
    silu_gated_t,
)

#: Every activation kernel id but the softmax pair (in softmax.py).
__all__ = [k for k in ACTIVATION_KERNELS if not k.startswith("softmax")]

_f64 = np.float64


# --------------------------------------------------------------------------- #
# Elementwise activations: one row per prange iteration.
# --------------------------------------------------------------------------- #


@register("gelu", "numba")
@fma_pjit
def gelu(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = False
        for j in range(xr.size):
            v = xr[j]
            bad |= _nonfinite(v)
            o[j] = gelu_t(v)
        nbad += 1 if bad else 0
    return nbad


@register("gelu_grad", "numba")
@fma_pjit
def gelu_grad(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = False
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _gelu_grad1(v)
        nbad += 1 if bad else 0
    return nbad


@register("gelu_tanh", "numba")
@fma_pjit
def gelu_tanh(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = False
        for j in range(xr.size):
            v = xr[j]
            bad |= _nonfinite(v)
            o[j] = gelu_tanh_t(v)
        nbad += 1 if bad else 0
    return nbad


@register("gelu_tanh_grad", "numba")
@fma_pjit
def gelu_tanh_grad(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = False
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _gelu_tanh_grad1(v)
        nbad += 1 if bad else 0
    return nbad


@register("relu", "numba")
@fma_pjit
def relu(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = False
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _relu1(v)
        nbad += 1 if bad else 0
    return nbad


@register("relu_grad", "numba")
@fma_pjit
def relu_grad(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = False
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _relu_grad1(v)
        nbad += 1 if bad else 0
    return nbad


@register("silu_gated", "numba")
@fma_pjit
def silu_gated(u, out):
    """u : (N, 2n) = [gate | up]; out : (N, n). Returns the number of rows with NaN/Inf."""
    n = out.shape[1]
    nbad = 0
    for r in prange(u.shape[0]):
        ur, o = u[r], out[r]
        bad = False
        for j in range(n):
            g = ur[j]
            up = ur[n + j]
            bad |= _nonfinite(g) | _nonfinite(up)
            o[j] = silu_gated_t(g, up)
        nbad += 1 if bad else 0
    return nbad


@register("silu_gated_grad", "numba")
@fma_pjit
def silu_gated_grad(u, out_a, out_b):
    """u : (N, 2n); out_a = silu'(gate) * up, out_b = silu(gate) : (N, n). Returns the bad-row count."""
    n = out_a.shape[1]
    nbad = 0
    for r in prange(u.shape[0]):
        ur, oa, ob = u[r], out_a[r], out_b[r]
        bad = False
        for j in range(n):
            g = _f64(ur[j])
            up = _f64(ur[n + j])
            bad |= _nonfinite(g) | _nonfinite(up)
            s, sn = _sigmoid_pair(g)
            oa[j] = s * (1.0 + g * sn) * up
            ob[j] = g * s
        nbad += 1 if bad else 0
    return nbad
