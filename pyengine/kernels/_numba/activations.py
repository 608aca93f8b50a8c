"""Numba kernels of the attention softmax, its JVP, and the MLP activations.

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference.activations`
(C-contiguous float32 or float64 arrays, preallocated outputs, ``out`` possibly the
input itself, the number of bad rows returned); the formulas are in its docstring.

Every batch kernel runs ``prange`` over rows only, so each row is computed by one
thread in an order fixed by the source and results do not depend on the number of
threads. Everything is computed in float64 and cast to the dtype of the output on
the store.

Vectorization: Numba calls the scalar libm ``exp`` / ``erfc`` (it has no vector math
library without Intel's SVML, and SVML would need fast-math). A loop that calls them
stays scalar at 10-20 ns per element, slower than NumPy's vectorized ``np.exp`` on
float32. The transcendental functions are therefore written here as branch-free
arithmetic that LLVM's loop vectorizer turns into AVX2 code (4 doubles at a time),
the same algorithms as the C++ backend (``csrc/activations.hpp``):

* :func:`_exp_neg`: e^x for x <= 0, Cody-Waite reduction to |r| <= ln2/2 and the
  degree-13 Taylor polynomial; 2^n is built from its exponent bits (a scalar
  ``view``, which Numba compiles to a bit cast). About 1 ulp; 0 below -708.
* :func:`_ndtr_lower`: Phi(-|x|) = exp(-x^2/2) erfcx(|x|/sqrt 2) / 2 with erfcx as a
  degree-24 polynomial in t = (z - 4)/(z + 4) (:data:`ERFCX_COEF`).

Fast-math stays off as in ``_jit.FASTMATH`` (the bad-row tests need NaN and Inf),
except for the one flag :data:`CONTRACT` (fused multiply-add), which assumes nothing
about NaN/Inf and reorders nothing. Without ``reassoc`` LLVM keeps float sums in
source order, so reductions (the softmax's max and sum, the JVP's dot product) use
``LANES`` partial results in a scratch array, as :mod:`pyengine.kernels._numba.layernorm`
does; the elementwise loops vectorize as they are. The bad-row flag of the
elementwise kernels is an integer OR over the row, which LLVM vectorizes without
reassociation. Choices between computed values are written as Python conditional
expressions in the small cores only: LLVM turns them into vector selects once the
cores are inlined.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ...backends import register
from ._jit import jit, pjit
from ._reduce import LANES, _fold

__all__ = [
    "ERFCX_COEF",
    "LANES",
    "gelu",
    "gelu_grad",
    "gelu_tanh",
    "gelu_tanh_grad",
    "relu",
    "relu_grad",
    "silu_gated",
    "silu_gated_grad",
    "softmax",
    "softmax_jvp",
]

_f64 = np.float64

#: The one fast-math flag of this module: ``contract`` lets LLVM fuse a * b + c into
#: one FMA, rounded once instead of twice. It assumes nothing about NaN or Inf and
#: reorders no sum, so the bad-row tests and the fixed summation order hold; the
#: polynomials below are chains of multiply-adds, and it makes them about 2x faster.
CONTRACT = {"contract"}

if numba.config.DISABLE_JIT:  # pragma: no cover - the NUMBA_DISABLE_JIT=1 CI job
    _core = _row = jit
    _kernel = pjit
else:
    #: Scalar cores: always inlined (at the Numba IR level), because LLVM's inliner
    #: leaves the larger ones (GELU) as calls, and a loop with a call does not vectorize.
    _core = jit(inline="always", fastmath=CONTRACT)
    #: Row helpers that call the cores (inlined cores take their caller's flags).
    _row = jit(fastmath=CONTRACT)
    #: Batch kernels: ``prange`` over rows.
    _kernel = jit(parallel=True, fastmath=CONTRACT)

# exp: below EXP_MIN the result is 0 (e^-708 is near the smallest normal double, and
# 2^n below 2^-1022 cannot be built from the exponent bits); -inf gives exactly 0.
EXP_MIN = -708.0
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693147180369123816490  # 11 trailing zero bits: n * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_ROUND_MAGIC = 6755399441055744.0  # 1.5 * 2^52: x + it rounds x to an integer in the low bits
_ROUND_MAGIC_BITS = int(np.float64(_ROUND_MAGIC).view(np.int64))

_SQRT_HALF = 0.70710678118654752440
_INV_SQRT_2PI = 0.39894228040143267794
_TWO_C = 2.0 * 0.79788456080286535588  # 2 sqrt(2/pi): gelu_tanh's y = 2z
_TANH_A = 0.044715

#: erfcx(z) = exp(z^2) erfc(z) on [0, inf) as sum_k c_k t^k, t = (z - 4)/(z + 4), lowest
#: degree first: a degree-24 Chebyshev fit (mpmath.chebyfit, 50 digits), max error
#: 1.5e-18. Identical to ``kErfcxCoef`` in csrc/activations.hpp.
ERFCX_COEF = (
    0.13699945762506138, -0.2590680487601717, 0.21871967891826488,
    -0.16425781669730535, 0.10896317739890565, -0.06310781563985407,
    0.03129905651866725, -0.012843946029675049, 0.0040602636242725075,
    -0.000799126826782696, -2.1761725024182422e-05, 7.898324123081687e-05,
    -2.2556012228505205e-05, -1.903368651468222e-06, 2.9444640041483267e-06,
    -4.0849834447721377e-07, -2.839284035743719e-07, 9.603707256798476e-08,
    2.5169413084967722e-08, -1.5266987447078356e-08, -2.241674032979439e-09,
    1.9641393113356918e-09, 2.024615076618673e-10, -1.54670475117171e-10,
    -1.3720135991580755e-11,
)
#: The Taylor coefficients 1/k! of e^r, k = 0 .. 13, lowest degree first.
EXP_COEF = tuple(1.0 / math.factorial(k) for k in range(14))


# --------------------------------------------------------------------------- #
# Scalar cores: branch-free, so that the loops calling them vectorize.
# --------------------------------------------------------------------------- #


@_core
def _poly_exp(r):
    """sum_k EXP_COEF[k] r^k by Estrin's scheme (exactly 1 at r = 0).

    Estrin's dependency chain is 5 multiply-adds long, Horner's 13: the loops are
    bound by latency, and this made them about 1.2x faster.
    """
    c = EXP_COEF
    r2 = r * r
    r4 = r2 * r2
    r8 = r4 * r4
    q0 = (c[0] + c[1] * r) + (c[2] + c[3] * r) * r2
    q1 = (c[4] + c[5] * r) + (c[6] + c[7] * r) * r2
    q2 = (c[8] + c[9] * r) + (c[10] + c[11] * r) * r2
    q3 = c[12] + c[13] * r
    return (q0 + q1 * r4) + (q2 + q3 * r4) * r8


@_core
def _exp_neg(x):
    """e^x for x <= 0 (about 1 ulp); 0 for x < EXP_MIN and -inf; NaN for NaN.

    Branch-free: lanes below EXP_MIN compute garbage (integer arithmetic wraps)
    that the final choice discards.
    """
    k = x * _LOG2E + _ROUND_MAGIC
    n = k - _ROUND_MAGIC  # round(x / ln 2)
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO  # x - n ln 2, |r| <= ln2/2
    p = _poly_exp(r)
    bits = (np.float64(k).view(np.uint64) - np.uint64(_ROUND_MAGIC_BITS) + np.uint64(1023)) << np.uint64(52)
    res = p * np.uint64(bits).view(np.float64)
    return 0.0 if x < EXP_MIN else res  # a NaN x keeps res, which is NaN


@_core
def _poly_erfcx(t):
    """sum_k ERFCX_COEF[k] t^k by Estrin's scheme."""
    c = ERFCX_COEF
    t2 = t * t
    t4 = t2 * t2
    t8 = t4 * t4
    t16 = t8 * t8
    q0 = (c[0] + c[1] * t) + (c[2] + c[3] * t) * t2
    q1 = (c[4] + c[5] * t) + (c[6] + c[7] * t) * t2
    q2 = (c[8] + c[9] * t) + (c[10] + c[11] * t) * t2
    q3 = (c[12] + c[13] * t) + (c[14] + c[15] * t) * t2
    q4 = (c[16] + c[17] * t) + (c[18] + c[19] * t) * t2
    q5 = (c[20] + c[21] * t) + (c[22] + c[23] * t) * t2
    s0 = (q0 + q1 * t4) + (q2 + q3 * t4) * t8
    s1 = (q4 + q5 * t4) + c[24] * t8
    return s0 + s1 * t16


@_core
def _ndtr_lower(x, e):
    """Phi(-|x|) = erfc(|x|/sqrt 2)/2, given e = exp(-x^2/2): accurate far into the tail."""
    z = abs(x) * _SQRT_HALF
    return 0.5 * e * _poly_erfcx((z - 4.0) / (z + 4.0))


@_core
def _normal_cdf_pdf(x):
    """(Phi(x), phi(x)); both exact limits for huge |x| (x*x = inf gives e = 0)."""
    e = _exp_neg(-0.5 * (x * x))
    h = _ndtr_lower(x, e)
    return (1.0 - h if x > 0.0 else h), _INV_SQRT_2PI * e


@_core
def _sigmoid_pair(y):
    """(sigmoid(y), sigmoid(-y)) without overflow: e = exp(-|y|) <= 1."""
    e = _exp_neg(-abs(y))
    a = 1.0 / (1.0 + e)  # sigmoid(|y|)
    b = e * a  # sigmoid(-|y|)
    nonneg = y >= 0.0
    return (a if nonneg else b), (b if nonneg else a)


@_core
def _nonfinite(v):
    """1 for NaN or +-Inf, else 0 (an integer, for a vectorizable OR over a row)."""
    return 0 if v - v == 0.0 else 1


@_core
def _gelu1(x):
    return x * _normal_cdf_pdf(x)[0]


@_core
def _gelu_grad1(x):
    cdf, pdf = _normal_cdf_pdf(x)
    return cdf + x * pdf


@_core
def _gelu_tanh1(x):
    return x * _sigmoid_pair(_TWO_C * x * (1.0 + _TANH_A * (x * x)))[0]


@_core
def _gelu_tanh_grad1(x):
    x2 = x * x
    s, sn = _sigmoid_pair(_TWO_C * x * (1.0 + _TANH_A * x2))
    ss = s * sn  # 0 where |y| is huge, where the factor below may be inf
    term = x * ss * (_TWO_C * (1.0 + 3.0 * _TANH_A * x2))
    return s + (term if ss > 0.0 else 0.0)


@_core
def _relu1(x):
    return x if x > 0.0 else 0.0


@_core
def _relu_grad1(x):
    return 1.0 if x > 0.0 else 0.0


# --------------------------------------------------------------------------- #
# Row reductions in a fixed order: LANES partial results in acc (LANES,).
# --------------------------------------------------------------------------- #


@jit
def _max(x, n, acc):
    """max(x[:n]) over the non-NaN values (-inf if none), in float64."""
    for k in range(LANES):
        acc[k] = -np.inf
    nb = n // LANES
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            v = _f64(x[o + k])
            acc[k] = v if v > acc[k] else acc[k]
    m = -np.inf
    for k in range(LANES):
        m = acc[k] if acc[k] > m else m
    for i in range(nb * LANES, n):
        v = _f64(x[i])
        m = v if v > m else m
    return m


@jit
def _sum(e, n, acc):
    """sum(e[:n]) of a float64 row."""
    for k in range(LANES):
        acc[k] = 0.0
    nb = n // LANES
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            acc[k] += e[o + k]
    s = _fold(acc)
    for i in range(nb * LANES, n):
        s += e[i]
    return s


@jit
def _dot(p, dx, acc):
    """sum(p * dx) in float64. p, dx : (d,)."""
    d = p.size
    for k in range(LANES):
        acc[k] = 0.0
    nb = d // LANES
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            acc[k] += _f64(p[o + k]) * _f64(dx[o + k])
    s = _fold(acc)
    for i in range(nb * LANES, d):
        s += _f64(p[i]) * _f64(dx[i])
    return s


# --------------------------------------------------------------------------- #
# Softmax and its JVP
# --------------------------------------------------------------------------- #


@_row
def _softmax_row(x, vis, out, e, acc):
    """out[:vis] = softmax of x[:vis], out[vis:] = 0; True for a bad row. e : (Tk,) float64."""
    m = _max(x, vis, acc)
    for j in range(vis):
        e[j] = _exp_neg(_f64(x[j]) - m)
    # NaN or +inf among x[:vis], or all of it -inf, make s NaN; a good row has s >= 1.
    s = _sum(e, vis, acc)
    if not s >= 1.0:
        for j in range(out.size):
            out[j] = np.nan
        return True
    inv = 1.0 / s
    for j in range(vis):
        out[j] = e[j] * inv
    for j in range(vis, out.size):
        out[j] = 0.0
    return False


@register("softmax", "numba")
@_kernel
def softmax(x, offset, out):
    """x, out : (N, Tq, Tk); keys j <= i + offset visible. Returns the number of bad rows."""
    n, tq, tk = x.shape
    x2 = x.reshape((n * tq, tk))
    out2 = out.reshape((n * tq, tk))
    nbad = 0
    for row in prange(n * tq):
        e = np.empty(tk, dtype=np.float64)  # hoisted: once per thread
        acc = np.empty(LANES, dtype=np.float64)
        i = row % tq
        vis = tk if offset >= tk - i else i + offset + 1
        if _softmax_row(x2[row], vis, out2[row], e, acc):
            nbad += 1
    return nbad


@_row
def _softmax_jvp_row(p, dx, out, acc):
    dot = _dot(p, dx, acc)
    if not np.isfinite(dot):
        for j in range(out.size):
            out[j] = np.nan
        return True
    for j in range(out.size):
        out[j] = _f64(p[j]) * (_f64(dx[j]) - dot)
    return False


@register("softmax_jvp", "numba")
@_kernel
def softmax_jvp(p, dx, out):
    """p : (M, Tq, Tk); dx, out : (R, M, Tq, Tk). Returns the number of bad rows."""
    r, m, tq, tk = dx.shape
    prow = m * tq
    p2 = p.reshape((prow, tk))
    dx2 = dx.reshape((r * prow, tk))
    out2 = out.reshape((r * prow, tk))
    nbad = 0
    for row in prange(r * prow):
        acc = np.empty(LANES, dtype=np.float64)  # hoisted: once per thread
        if _softmax_jvp_row(p2[row % prow], dx2[row], out2[row], acc):
            nbad += 1
    return nbad


# --------------------------------------------------------------------------- #
# Elementwise activations: one row per prange iteration.
# --------------------------------------------------------------------------- #


@register("gelu", "numba")
@_kernel
def gelu(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = 0
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _gelu1(v)
        nbad += bad
    return nbad


@register("gelu_grad", "numba")
@_kernel
def gelu_grad(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = 0
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _gelu_grad1(v)
        nbad += bad
    return nbad


@register("gelu_tanh", "numba")
@_kernel
def gelu_tanh(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = 0
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _gelu_tanh1(v)
        nbad += bad
    return nbad


@register("gelu_tanh_grad", "numba")
@_kernel
def gelu_tanh_grad(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = 0
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _gelu_tanh_grad1(v)
        nbad += bad
    return nbad


@register("relu", "numba")
@_kernel
def relu(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = 0
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _relu1(v)
        nbad += bad
    return nbad


@register("relu_grad", "numba")
@_kernel
def relu_grad(x, out):
    """x, out : (N, n). Returns the number of rows with NaN/Inf."""
    nbad = 0
    for r in prange(x.shape[0]):
        xr, o = x[r], out[r]
        bad = 0
        for j in range(xr.size):
            v = _f64(xr[j])
            bad |= _nonfinite(v)
            o[j] = _relu_grad1(v)
        nbad += bad
    return nbad


@register("silu_gated", "numba")
@_kernel
def silu_gated(u, out):
    """u : (N, 2n) = [gate | up]; out : (N, n). Returns the number of rows with NaN/Inf."""
    n = out.shape[1]
    nbad = 0
    for r in prange(u.shape[0]):
        ur, o = u[r], out[r]
        bad = 0
        for j in range(n):
            g = _f64(ur[j])
            up = _f64(ur[n + j])
            bad |= _nonfinite(g) | _nonfinite(up)
            o[j] = g * _sigmoid_pair(g)[0] * up
        nbad += bad
    return nbad


@register("silu_gated_grad", "numba")
@_kernel
def silu_gated_grad(u, out_a, out_b):
    """u : (N, 2n); out_a = silu'(gate) * up, out_b = silu(gate) : (N, n). Returns the bad-row count."""
    n = out_a.shape[1]
    nbad = 0
    for r in prange(u.shape[0]):
        ur, oa, ob = u[r], out_a[r], out_b[r]
        bad = 0
        for j in range(n):
            g = _f64(ur[j])
            up = _f64(ur[n + j])
            bad |= _nonfinite(g) | _nonfinite(up)
            s, sn = _sigmoid_pair(g)
            oa[j] = s * (1.0 + g * sn) * up
            ob[j] = g * s
        nbad += bad
    return nbad
