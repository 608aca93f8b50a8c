"""NumPy reference of the attention softmax and the MLP activations, with their JVPs.

The kernel contract is that of :mod:`pyengine.kernels._reference.layernorm` (C-contiguous
arrays of one dtype, float32 or float64, validated by the public layer
:mod:`pyengine.kernels.activations`; ``out`` preallocated and written in full; the return
value is the number of *bad rows*, whose output is unspecified), with one addition:
``out`` may be the input array itself (``x`` of the softmax and of the elementwise
activations, ``dx`` of the softmax JVP), for in-place use. Every backend reads an
element before it writes it; ``out`` must not overlap an input in any other way.

Everything is computed in float64 and cast to the dtype of ``out`` on the way out;
the compiled backends must match this to rounding.

Softmax, ``softmax(x, offset, out)``: ``x``, ``out`` of shape (N, Tq, Tk); ``offset``
an int >= 0. Row (n, i) is the softmax over the *visible* keys j <= i + offset:

    p_j = exp(x_j - m) / sum_{visible k} exp(x_k - m),   m = max_{visible} x_j,

and entries j > i + offset are *masked*: never read (any value, NaN included) and
written as exactly 0. ``offset >= Tk - 1`` masks nothing (non-causal attention);
``offset = 0`` with Tq = Tk is the causal mask; ``offset = Tk - Tq`` is a causal
suffix (queries at absolute positions Tk - Tq .. Tk - 1). Key 0 is always visible.
A visible entry may be ``-inf``: masked by the caller (a padding mask, say), it
comes out exactly 0. A row is bad if a visible entry is NaN or +inf, or if every
visible entry is -inf (nothing to normalize). With m subtracted, each term is in
[0, 1] and the largest is exactly 1, so for a good row the sum s is in [1, Tk]:
``s >= 1`` is the test, and it fails (NaN) exactly for the bad rows.

Softmax JVP, ``softmax_jvp(p, dx, out)``: ``p`` (M, Tq, Tk) a softmax output, ``dx``
and ``out`` (R, M, Tq, Tk): p is shared by the R tangents (R = 1: one tangent). Per
row, ``out = p * (dx - sum_j p_j dx_j)``, the derivative of the softmax at the
scores that produced p in the direction dx. Where p = 0 (masked entries) the output
is exactly 0. A row is bad if sum_j p_j dx_j is not finite, that is if the row of p
or of dx holds a NaN or an Inf (0 * Inf counts), or if the sum overflows.

Elementwise activations, ``<name>(x, out)`` and ``<name>_grad(x, out)``: ``x``,
``out`` (N, n); the forward value and the derivative (the coefficient c of the JVP
dz = c * dx), elementwise. A row is bad if it holds a NaN or an Inf.

- gelu: x Phi(x), Phi the standard normal CDF; grad Phi(x) + x phi(x).
- gelu_tanh: 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3); computed as
  x sigmoid(2 z), the same function (1 + tanh z = 2 sigmoid(2z)) without the
  cancellation of 1 + tanh z for negative z;
  grad sigmoid(2z) + x sigmoid(2z) sigmoid(-2z) 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2).
- relu: x if x > 0 else 0; grad 1 if x > 0 else 0 (0 at x = 0).

Gated (Llama) MLP, ``silu_gated(u, out)``: ``u`` (N, 2n) = [gate | up], ``out`` (N, n) =
silu(gate) * up with silu(g) = g sigmoid(g). ``silu_gated_grad(u, out_a, out_b)``:
``out_a`` = silu'(gate) * up and ``out_b`` = silu(gate), both (N, n), so that the JVP
is dz = out_a * dgate + out_b * dup; silu'(g) = sigmoid(g) (1 + g sigmoid(-g)).
A row is bad if its 2n values hold a NaN or an Inf.

Every function is finite for every finite input, however large: sigmoid is
``scipy.special.expit`` (no overflow), and the derivative terms that would be
0 * inf for huge |x| are 0.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from ...backends import ACTIVATION_KERNELS, register

__all__ = list(ACTIVATION_KERNELS)  # one reference per kernel id of the family

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
#: GELU tanh approximation (Hendrycks & Gimpel): z = C (x + A x^3).
GELU_TANH_C = math.sqrt(2.0 / math.pi)
GELU_TANH_A = 0.044715


def _bad_rows(*arrays):
    """Rows (over the last axis) that hold a NaN or an Inf in any of ``arrays``."""
    bad = np.zeros(arrays[0].shape[:-1], dtype=bool)
    for a in arrays:
        bad |= ~np.isfinite(a).all(axis=-1)
    return int(bad.sum())


@register("softmax", "numpy")
def softmax(x, offset, out):
    """Masked row softmax, keys j <= i + offset visible; x, out : (N, Tq, Tk)."""
    _, tq, tk = x.shape
    visible = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset  # (Tq, Tk)
    with np.errstate(invalid="ignore", over="ignore"):
        xd = np.where(visible, x.astype(np.float64), -np.inf)  # masked entries are not read
        m = xd.max(axis=-1, keepdims=True)
        e = np.exp(xd - m)
        s = e.sum(axis=-1, keepdims=True)
        bad = ~(s[..., 0] >= 1.0)  # NaN: a visible NaN or +inf, or no finite visible entry
        out[...] = e / s
    return int(bad.sum())


@register("softmax_jvp", "numpy")
def softmax_jvp(p, dx, out):
    """out = p * (dx - sum_j p dx) per row; p : (M, Tq, Tk), dx, out : (R, M, Tq, Tk)."""
    pd = p.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        dxd = dx.astype(np.float64)
        dot = (pd * dxd).sum(axis=-1, keepdims=True)
        out[...] = pd * (dxd - dot)
    return int((~np.isfinite(dot)).sum())


def _elementwise(fn, x, out):
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        out[...] = fn(x.astype(np.float64))
    return _bad_rows(x)


def _gelu(x):
    return x * special.ndtr(x)


def _gelu_grad(x):
    return special.ndtr(x) + x * (_INV_SQRT_2PI * np.exp(-0.5 * x * x))


def _gelu_tanh_y(x):
    """2z = 2 C (x + A x^3), the argument of the sigmoid."""
    return (2.0 * GELU_TANH_C) * (x + GELU_TANH_A * x**3)


def _gelu_tanh(x):
    return x * special.expit(_gelu_tanh_y(x))


def _gelu_tanh_grad(x):
    y = _gelu_tanh_y(x)
    s, sn = special.expit(y), special.expit(-y)
    k = (2.0 * GELU_TANH_C) * (1.0 + 3.0 * GELU_TANH_A * x * x)
    # sigmoid(y) sigmoid(-y) = 0 for |y| > ~745, where k may be inf: the term is 0.
    return s + np.where(s * sn > 0.0, x * (s * sn) * k, 0.0)


@register("gelu", "numpy")
def gelu(x, out):
    """x Phi(x) elementwise; x, out : (N, n)."""
    return _elementwise(_gelu, x, out)


@register("gelu_grad", "numpy")
def gelu_grad(x, out):
    """d/dx gelu = Phi(x) + x phi(x); x, out : (N, n)."""
    return _elementwise(_gelu_grad, x, out)


@register("gelu_tanh", "numpy")
def gelu_tanh(x, out):
    """0.5 x (1 + tanh(z)) = x sigmoid(2z), z = C (x + A x^3); x, out : (N, n)."""
    return _elementwise(_gelu_tanh, x, out)


@register("gelu_tanh_grad", "numpy")
def gelu_tanh_grad(x, out):
    """sigmoid(2z) + x sigmoid(2z) sigmoid(-2z) 2C (1 + 3A x^2); x, out : (N, n)."""
    return _elementwise(_gelu_tanh_grad, x, out)


@register("relu", "numpy")
def relu(x, out):
    """x if x > 0 else 0; x, out : (N, n)."""
    return _elementwise(lambda a: np.where(a > 0.0, a, 0.0), x, out)


@register("relu_grad", "numpy")
def relu_grad(x, out):
    """1 if x > 0 else 0 (0 at x = 0); x, out : (N, n)."""
    return _elementwise(lambda a: (a > 0.0).astype(np.float64), x, out)


def _gate_up(u):
    n = u.shape[-1] // 2
    ud = u.astype(np.float64)
    return ud[:, :n], ud[:, n:]


@register("silu_gated", "numpy")
def silu_gated(u, out):
    """silu(gate) * up, silu(g) = g sigmoid(g); u : (N, 2n) = [gate | up], out : (N, n)."""
    g, up = _gate_up(u)
    with np.errstate(invalid="ignore", over="ignore"):
        out[...] = g * special.expit(g) * up
    return _bad_rows(u)


@register("silu_gated_grad", "numpy")
def silu_gated_grad(u, out_a, out_b):
    """out_a = silu'(gate) * up, out_b = silu(gate); u : (N, 2n), out_a, out_b : (N, n)."""
    g, up = _gate_up(u)
    with np.errstate(invalid="ignore", over="ignore"):
        s = special.expit(g)
        out_a[...] = s * (1.0 + g * special.expit(-g)) * up
        out_b[...] = g * s
    return _bad_rows(u)
