"""Branch-free scalar cores of the activation and softmax kernels: exp, the normal CDF, sigmoid.

Numba calls the scalar libm ``exp`` / ``erfc`` (it has no vector math library
without Intel's SVML, and SVML would need fast-math). A loop that calls them stays
scalar at 10-20 ns per element, slower than NumPy's vectorized ``np.exp`` on
float32. The transcendental functions are therefore written here as branch-free
arithmetic that LLVM's loop vectorizer turns into AVX2 code (4 doubles at a time),
the same algorithms as the C++ backend (``csrc/activations.hpp``):

* :func:`_exp_neg`: e^x for x <= 0, Cody-Waite reduction to |r| <= ln2/2 and the
  degree-13 Taylor polynomial; 2^n is built from its exponent bits (a scalar
  ``view``, which Numba compiles to a bit cast). About 1 ulp; 0 below -708.
* :func:`_ndtr_lower`: Phi(-|x|) = exp(-x^2/2) erfcx(|x|/sqrt 2) / 2 with erfcx as a
  degree-24 polynomial in t = (z - 4)/(z + 4) (:data:`ERFCX_COEF`).

Every core is compiled with :data:`._jit.fma_inline`: inlined into its caller, so the
caller's loop vectorizes, with the one fast-math flag ``contract``
(:data:`._jit.CONTRACT`). Choices between computed values are written as Python
conditional expressions: LLVM turns them into vector selects once the cores are
inlined. Numba's disk cache does not notice edits here in the modules that inline
these cores: after changing this file, delete ``kernels/_numba/__pycache__``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import types
from numba.extending import overload

from ._jit import CONTRACT, fma_inline

__all__ = ["ERFCX_COEF", "EXP_COEF", "EXP_MIN"]


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
#: 1.5e-18. Identical to ``kErfcxCoef`` in csrc/vmath.hpp (tests/test_vmath_tables.py).
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


@fma_inline
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


@fma_inline
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


@fma_inline
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


@fma_inline
def _ndtr_lower(x, e):
    """Phi(-|x|) = erfc(|x|/sqrt 2)/2, given e = exp(-x^2/2): accurate far into the tail."""
    z = abs(x) * _SQRT_HALF
    return 0.5 * e * _poly_erfcx((z - 4.0) / (z + 4.0))


@fma_inline
def _normal_cdf_pdf(x):
    """(Phi(x), phi(x)); both exact limits for huge |x| (x*x = inf gives e = 0)."""
    e = _exp_neg(-0.5 * (x * x))
    h = _ndtr_lower(x, e)
    return (1.0 - h if x > 0.0 else h), _INV_SQRT_2PI * e


@fma_inline
def _sigmoid_pair(y):
    """(sigmoid(y), sigmoid(-y)) without overflow: e = exp(-|y|) <= 1."""
    e = _exp_neg(-abs(y))
    a = 1.0 / (1.0 + e)  # sigmoid(|y|)
    b = e * a  # sigmoid(-|y|)
    nonneg = y >= 0.0
    return (a if nonneg else b), (b if nonneg else a)


@fma_inline
def _nonfinite(v):
    """True for NaN or +-Inf (v - v is NaN), in v's precision; for ``bad |= ...`` over a row.

    A bool, not the integer 0/1 it was: an OR of int64 flags next to float32 arithmetic made
    LLVM vectorize the gated SiLU's loop at half the width (float32 silu_gated 3.1 -> 2.2 ms
    at (2048, 2 x 3072))."""
    z = v - v
    return z != z


@fma_inline
def _gelu1(x):
    return x * _normal_cdf_pdf(x)[0]


@fma_inline
def _gelu_grad1(x):
    cdf, pdf = _normal_cdf_pdf(x)
    return cdf + x * pdf


@fma_inline
def _gelu_tanh1(x):
    return x * _sigmoid_pair(_TWO_C * x * (1.0 + _TANH_A * (x * x)))[0]


@fma_inline
def _gelu_tanh_grad1(x):
    x2 = x * x
    s, sn = _sigmoid_pair(_TWO_C * x * (1.0 + _TANH_A * x2))
    ss = s * sn  # 0 where |y| is huge, where the factor below may be inf
    term = x * ss * (_TWO_C * (1.0 + 3.0 * _TANH_A * x2))
    return s + (term if ss > 0.0 else 0.0)


@fma_inline
def _relu1(x):
    return x if x > 0.0 else 0.0


@fma_inline
def _relu_grad1(x):
    return 1.0 if x > 0.0 else 0.0


# --------------------------------------------------------------------------- #
# float32 variants (the forward kernels on float32 input), as csrc/vmath.hpp:
# the exp argument is formed and reduced in float64, the polynomials and products
# run in float32 (8 lanes, half the degree). A few float32 ulp; the derivatives
# stay in float64 (they cancel near their zeros).
# --------------------------------------------------------------------------- #

_f32 = np.float32
EXP_MIN_F = -87.0  # e^-87 = 1.6e-38 is near the smallest normal float32
_LN2 = 0.69314718055994530942
_ROUND_MAGIC_F = np.float32(12582912.0)  # 1.5 * 2^23
_ROUND_MAGIC_F_BITS = int(np.float32(12582912.0).view(np.uint32))
#: e^r = 1 + r + r^2 P(r), P of degree 5 (Cephes expf), highest degree first.
EXP_COEF_F = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                           4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
#: erfcx(z) for z in [0, 9.4] as sum_k c_k t^k, t = (z - 4)/(z + 4) in [-1, 0.45], lowest
#: degree first: a degree-11 Chebyshev fit on that interval (mpmath.chebyfit), relative
#: error 3e-10 before float32 rounding. Identical to ``kErfcxCoefF`` in csrc/vmath.hpp.
ERFCX_COEF_F = tuple(np.float32(c) for c in (
    0.13699945762673144, -0.2590680494466127, 0.21871968027274608,
    -0.16425777990891793, 0.10896312064219388, -0.06310840903386655,
    0.031299594333153484, -0.012839561577756424, 0.00405937153737316,
    -0.0008149691795509706, -2.8765935882777373e-05, 0.00010122777161903319,
))
_SQRT_HALF_F = np.float32(_SQRT_HALF)
_LOG2E_F = np.float32(1.44269504088896341)
_LN2_HI_F = np.float32(0.693359375)  # exact times n
_LN2_LO_F = np.float32(-2.12194440e-4)
_EXP_MIN_F32 = np.float32(EXP_MIN_F)


@fma_inline
def _poly_exp_f(r):
    """e^r on |r| <= ln2/2 for float32 r (about 1 ulp, exactly 1 at r = 0)."""
    c = EXP_COEF_F
    r2 = r * r
    r4 = r2 * r2
    p01 = c[0] * r + c[1]
    p23 = c[2] * r + c[3]
    p45 = c[4] * r + c[5]
    p = (p01 * r4 + p23 * r2) + p45
    return (_f32(1.0) + r) + r2 * p


@fma_inline
def _exp_neg_f(a):
    """e^a for float64 a <= 0, as float32 (about 1.5 ulp); 0 below EXP_MIN_F and -inf."""
    k = a * _LOG2E + _ROUND_MAGIC
    n = k - _ROUND_MAGIC
    r = a - n * _LN2
    p = _poly_exp_f(_f32(r))
    kf = _f32(n) + _ROUND_MAGIC_F
    bits = (np.float32(kf).view(np.uint32) - np.uint32(_ROUND_MAGIC_F_BITS) + np.uint32(127)) << np.uint32(23)
    res = p * np.uint32(bits).view(np.float32)
    return _f32(0.0) if a < EXP_MIN_F else res


@fma_inline
def _exp_neg_ff(a):
    """e^a for a float32 a <= 0 exact as given (gated SiLU's -|g|), reduced in float32 (Cody-Waite)."""
    k = a * _LOG2E_F + _ROUND_MAGIC_F
    n = k - _ROUND_MAGIC_F
    r = a - n * _LN2_HI_F
    r = r - n * _LN2_LO_F
    p = _poly_exp_f(r)
    bits = (np.float32(k).view(np.uint32) - np.uint32(_ROUND_MAGIC_F_BITS) + np.uint32(127)) << np.uint32(23)
    res = p * np.uint32(bits).view(np.float32)
    return _f32(0.0) if a < _EXP_MIN_F32 else res


@fma_inline
def _sigmoid_ff(y):
    """sigmoid(y) for float32 y, all in float32."""
    e = _exp_neg_ff(-abs(y))
    a = _f32(1.0) / (_f32(1.0) + e)
    b = e * a
    return a if y >= _f32(0.0) else b


@fma_inline
def _poly_erfcx_f(t):
    c = ERFCX_COEF_F
    t2 = t * t
    t4 = t2 * t2
    t8 = t4 * t4
    q0 = (c[0] + c[1] * t) + (c[2] + c[3] * t) * t2
    q1 = (c[4] + c[5] * t) + (c[6] + c[7] * t) * t2
    q2 = (c[8] + c[9] * t) + (c[10] + c[11] * t) * t2
    return (q0 + q1 * t4) + q2 * t8


@fma_inline
def _normal_cdf_f(x):
    """Phi(x) for float32 x."""
    xd = np.float64(x)
    e = _exp_neg_f(-0.5 * (xd * xd))
    z = abs(x) * _SQRT_HALF_F
    t = (z - _f32(4.0)) / (z + _f32(4.0))
    h = _f32(0.5) * e * _poly_erfcx_f(t)
    return (_f32(1.0) - h) if x > _f32(0.0) else h


@fma_inline
def _sigmoid_f(y):
    """sigmoid(y) for float64 y, as float32."""
    e = _exp_neg_f(-abs(y))
    a = _f32(1.0) / (_f32(1.0) + e)
    b = e * a
    return a if y >= 0.0 else b


@fma_inline
def _gelu1_f(x):
    return x * _normal_cdf_f(x)


@fma_inline
def _gelu_tanh1_f(x):
    xd = np.float64(x)
    return x * _sigmoid_f(_TWO_C * xd * (1.0 + _TANH_A * (xd * xd)))


# --------------------------------------------------------------------------- #
# Dtype dispatch at compile time: the float32 cores for float32 elements, the
# float64 ones otherwise (overloads, inlined like the cores).
# --------------------------------------------------------------------------- #


def _by_dtype(f32_impl, f64_impl, nargs):
    """A function whose Numba overload picks ``f32_impl`` when its first argument is float32."""
    if nargs == 1:
        def dispatch(x):  # plain Python under NUMBA_DISABLE_JIT=1
            return (f32_impl if isinstance(x, np.float32) else f64_impl)(x)

        def _ov(x):
            return f32_impl if x == types.float32 else f64_impl
    else:
        def dispatch(x, y):
            return (f32_impl if isinstance(x, np.float32) else f64_impl)(x, y)

        def _ov(x, y):
            return f32_impl if x == types.float32 else f64_impl
    if not numba.config.DISABLE_JIT:
        overload(dispatch, inline="always", jit_options={"fastmath": CONTRACT})(_ov)
    return dispatch


#: e^(x - m) (x an element, m the float64 row max), in x's precision.
exp_term = _by_dtype(lambda x, y: _exp_neg_f(np.float64(x) - y), lambda x, y: _exp_neg(np.float64(x) - y), 2)
#: e^x for x <= 0 in x's own dtype, float32 reduced in float32 (:func:`_exp_neg_ff`): the
#: attention BLAS kernels' probabilities of float32 heads (as the C++ fused head's exp_negf).
exp_own = _by_dtype(lambda x: _exp_neg_ff(x), lambda x: _exp_neg(x), 1)
#: y (a float) rounded to x's dtype.
like = _by_dtype(lambda x, y: np.float32(y), lambda x, y: np.float64(y), 2)
#: The lowest finite value of x's dtype.
_LOWEST_F32 = np.finfo(np.float32).min
_LOWEST_F64 = float(np.finfo(np.float64).min)
lowest_like = _by_dtype(lambda x: _LOWEST_F32, lambda x: _LOWEST_F64, 1)
gelu_t = _by_dtype(lambda x: _gelu1_f(x), lambda x: _gelu1(np.float64(x)), 1)
gelu_tanh_t = _by_dtype(lambda x: _gelu_tanh1_f(x), lambda x: _gelu_tanh1(np.float64(x)), 1)
#: silu(g) * up.
silu_gated_t = _by_dtype(lambda x, y: x * _sigmoid_ff(x) * y,
                         lambda x, y: np.float64(x) * _sigmoid_pair(np.float64(x))[0] * np.float64(y), 2)
