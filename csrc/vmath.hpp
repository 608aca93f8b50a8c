// Branch-free double-precision exp (of non-positive arguments), normal CDF and PDF, and
// sigmoid, for `omp simd` loops: the softmax and the activations (activations.hpp), and
// any other kernel that needs them vectorized in a loop over a row.
//
// GCC uses glibc's vector math library (libmvec) only under -ffast-math, which stays off
// (the bad-row tests need NaN and Inf), and a scalar libm exp costs about 10 ns here
// against about 1.5 ns per element for these (in the softmax's exp pass). Every
// data-dependent choice goes through `select` so that the loops that call them vectorize.
// exp: Cody-Waite reduction to |r| <= ln2/2 and the degree-13 Taylor polynomial
// (truncation < 5e-18), about 1 ulp. Phi (the normal CDF): Phi(-|x|) = exp(-x^2/2)
// erfcx(|x|/sqrt 2) / 2, with erfcx(z) = exp(z^2) erfc(z) as a degree-24 polynomial in
// t = (z - 4)/(z + 4), which maps [0, inf) onto [-1, 1) (after Schonfelder); relative
// error below 3e-15. Pure C++17, no pybind11.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "parallel.hpp"

namespace pyengine {
namespace vmath {


// ---------------------------------------------------------------------------------------
// exp for non-positive arguments

// Below this, exp_neg returns 0: e^-708 = 3.3e-308 is near the smallest normal double, and
// 2^n below 2^-1022 cannot be built from the exponent bits. A softmax term or a
// probability that small is 0 to every purpose (and -inf must give exactly 0).
inline constexpr double kExpMin = -708.0;
inline constexpr double kLog2e = 1.4426950408889634;
// ln 2 = kLn2Hi + kLn2Lo; kLn2Hi has 11 trailing zero bits, so n * kLn2Hi is exact.
inline constexpr double kLn2Hi = 0.693147180369123816490;
inline constexpr double kLn2Lo = 1.90821492927058770002e-10;
// 1.5 * 2^52: adding it rounds to an integer, which then sits in the low mantissa bits.
inline constexpr double kRoundMagic = 6755399441055744.0;

PYENGINE_ALWAYS_INLINE std::uint64_t to_bits(double x) {
    std::uint64_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

PYENGINE_ALWAYS_INLINE double from_bits(std::uint64_t b) {
    double x;
    std::memcpy(&x, &b, sizeof x);
    return x;
}

// c ? a : b, as bit masks. GCC compiles a plain ternary whose arms are computed values
// into a branch around the computation of the arm (and then does not vectorize the
// loop: "control flow in loop"), so every data-dependent choice below goes through this.
PYENGINE_ALWAYS_INLINE double select(bool c, double a, double b) {
    const std::uint64_t m = 0 - static_cast<std::uint64_t>(c);
    return from_bits((to_bits(a) & m) | (to_bits(b) & ~m));
}

// The Taylor series of e^r to degree 13 (the remainder is below 5e-18 for |r| <= ln2/2),
// by Estrin's scheme: a dependency chain of 5 multiply-adds instead of Horner's 13. The
// loops that call these polynomials have too few independent chains in flight to hide
// Horner's latency; Estrin made GELU about 1.2x faster. Exactly 1 at r = 0: a softmax
// row's largest term is exactly 1.
inline constexpr double kExpCoef[] = {
    1.0,           1.0,            1.0 / 2,          1.0 / 6,           1.0 / 24,
    1.0 / 120,     1.0 / 720,      1.0 / 5040,       1.0 / 40320,       1.0 / 362880,
    1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800.0,
};
PYENGINE_ALWAYS_INLINE double poly_exp(double r) {
    const auto& c = kExpCoef;
    const double r2 = r * r;
    const double r4 = r2 * r2;
    const double r8 = r4 * r4;
    const double q0 = (c[0] + c[1] * r) + (c[2] + c[3] * r) * r2;
    const double q1 = (c[4] + c[5] * r) + (c[6] + c[7] * r) * r2;
    const double q2 = (c[8] + c[9] * r) + (c[10] + c[11] * r) * r2;
    const double q3 = c[12] + c[13] * r;
    return (q0 + q1 * r4) + (q2 + q3 * r4) * r8;
}

// e^x for x <= 0, about 1 ulp; 0 for x < kExpMin (and -inf); NaN for NaN. Branch-free:
// the lanes below kExpMin compute garbage (unsigned bit arithmetic wraps, no UB; no
// floating-point traps) that the final select discards.
PYENGINE_ALWAYS_INLINE double exp_neg(double x) {
    const double k = x * kLog2e + kRoundMagic;
    const double n = k - kRoundMagic;  // round(x / ln 2)
    double r = x - n * kLn2Hi;
    r = r - n * kLn2Lo;  // x - n ln 2, |r| <= ln2/2
    const double p = poly_exp(r);
    // 2^n from its exponent bits: n is the low bits of k (n >= -1021 for x >= kExpMin).
    const double scale = from_bits((to_bits(k) - to_bits(kRoundMagic) + 1023) << 52);
    const double res = p * scale;
    return select(x < kExpMin, 0.0, res);  // a NaN x keeps res, which is NaN
}

// ---------------------------------------------------------------------------------------
// Normal CDF and sigmoid

inline constexpr double kSqrtHalf = 0.70710678118654752440;
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;
// erfcx(z) = exp(z^2) erfc(z) on [0, inf) as sum_k c_k t^k, t = (z - 4)/(z + 4), lowest
// degree first: a Chebyshev fit (mpmath.chebyfit, 50 digits) of degree 24, max error
// 1.5e-18 (erfcx is in (0, 1]). The coefficients sum to about 1 in absolute value, so
// rounding stays at a few ulp.
inline constexpr double kErfcxCoef[] = {
    0.13699945762506138,      -0.2590680487601717,      0.21871967891826488,
    -0.16425781669730535,     0.10896317739890565,      -0.06310781563985407,
    0.03129905651866725,      -0.012843946029675049,    0.0040602636242725075,
    -0.000799126826782696,    -2.1761725024182422e-05,  7.898324123081687e-05,
    -2.2556012228505205e-05,  -1.903368651468222e-06,   2.9444640041483267e-06,
    -4.0849834447721377e-07,  -2.839284035743719e-07,   9.603707256798476e-08,
    2.5169413084967722e-08,   -1.5266987447078356e-08,  -2.241674032979439e-09,
    1.9641393113356918e-09,   2.024615076618673e-10,    -1.54670475117171e-10,
    -1.3720135991580755e-11,
};

// sum_k kErfcxCoef[k] t^k by Estrin's scheme.
PYENGINE_ALWAYS_INLINE double poly_erfcx(double t) {
    const auto& c = kErfcxCoef;
    const double t2 = t * t;
    const double t4 = t2 * t2;
    const double t8 = t4 * t4;
    const double t16 = t8 * t8;
    const double q0 = (c[0] + c[1] * t) + (c[2] + c[3] * t) * t2;
    const double q1 = (c[4] + c[5] * t) + (c[6] + c[7] * t) * t2;
    const double q2 = (c[8] + c[9] * t) + (c[10] + c[11] * t) * t2;
    const double q3 = (c[12] + c[13] * t) + (c[14] + c[15] * t) * t2;
    const double q4 = (c[16] + c[17] * t) + (c[18] + c[19] * t) * t2;
    const double q5 = (c[20] + c[21] * t) + (c[22] + c[23] * t) * t2;
    const double s0 = (q0 + q1 * t4) + (q2 + q3 * t4) * t8;
    const double s1 = (q4 + q5 * t4) + c[24] * t8;
    return s0 + s1 * t16;
}

// Phi(-|x|) = erfc(|x|/sqrt 2) / 2, given e = exp(-x^2/2). Accurate in relative terms far
// into the tail (no 1 - erf cancellation); 0 where e underflows.
PYENGINE_ALWAYS_INLINE double ndtr_lower(double x, double e) {
    const double z = std::fabs(x) * kSqrtHalf;
    const double t = (z - 4.0) / (z + 4.0);
    const double q = poly_erfcx(t);
    return 0.5 * e * q;
}

// Phi(x) and phi(x) = exp(-x^2/2)/sqrt(2 pi).
struct NormalCdfPdf {
    double cdf;
    double pdf;
};

PYENGINE_ALWAYS_INLINE NormalCdfPdf normal_cdf_pdf(double x) {
    const double e = exp_neg(-0.5 * (x * x));  // x*x = inf for huge |x|: e = 0
    const double h = ndtr_lower(x, e);
    return {select(x > 0.0, 1.0 - h, h), kInvSqrt2Pi * e};
}

// (sigmoid(y), sigmoid(-y)) without overflow: e = exp(-|y|) <= 1.
struct SigmoidPair {
    double pos;
    double neg;
};

PYENGINE_ALWAYS_INLINE SigmoidPair sigmoid_pair(double y) {
    const double e = exp_neg(-std::fabs(y));
    const double a = 1.0 / (1.0 + e);  // sigmoid(|y|)
    const double b = e * a;            // sigmoid(-|y|)
    const bool nonneg = y >= 0.0;
    return {select(nonneg, a, b), select(nonneg, b, a)};
}

// ---------------------------------------------------------------------------------------
// float32 variants, for the forward kernels on float input (8 lanes per AVX2 register
// and polynomials of half the degree). The argument of an exponential is formed and
// reduced in double (a float32 x has an exact square in double, and exp amplifies an
// absolute error of its argument into the same relative error of its result: -x^2/2 or
// y = 2C x (1 + A x^2) rounded to float would cost |y| * 6e-8, 1.2e-6 at y = -20); only
// the reduced r (|r| <= ln2/2) is rounded to float, where its error is below 2e-8, and the
// polynomial, the erfcx part and the products run in float. Measured against the float64
// reference over every float32 in [-16, 16] step 2^-10 and the tails: relative error at
// most 2.7 float eps (GELU; tests/test_vmath_f32.py asks <= 4); results below 1e-35 may
// flush to 0 (exp_neg_f is 0 below e^-87). Derivatives stay in double: they cancel near their zeros
// (gelu'(-0.75) = 0.2266 - 0.2259), where float terms would lose the 1e-6 relative
// accuracy the special-value tests ask for.

// Below this, exp_neg_f returns 0: e^-87 = 1.6e-38 is near the smallest normal float.
inline constexpr double kExpMinF = -87.0;
inline constexpr float kRoundMagicF = 12582912.0f;  // 1.5 * 2^23

PYENGINE_ALWAYS_INLINE std::uint32_t to_bits(float x) {
    std::uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

PYENGINE_ALWAYS_INLINE float from_bits(std::uint32_t b) {
    float x;
    std::memcpy(&x, &b, sizeof x);
    return x;
}

PYENGINE_ALWAYS_INLINE float select(bool c, float a, float b) {
    const std::uint32_t m = 0u - static_cast<std::uint32_t>(c);
    return from_bits((to_bits(a) & m) | (to_bits(b) & ~m));
}

// e^r = 1 + r + r^2 P(r) on |r| <= ln2/2, P of degree 5 (Cephes expf, about 1 ulp); exactly
// 1 at r = 0.
PYENGINE_ALWAYS_INLINE float poly_exp_f(float r) {
    const float r2 = r * r;
    const float r4 = r2 * r2;
    const float p01 = 1.9875691500e-4f * r + 1.3981999507e-3f;
    const float p23 = 8.3334519073e-3f * r + 4.1665795894e-2f;
    const float p45 = 1.6666665459e-1f * r + 5.0000001201e-1f;
    const float p = (p01 * r4 + p23 * r2) + p45;
    return (1.0f + r) + r2 * p;
}

// e^a for a <= 0 given in double, as a float (about 1.5 ulp); 0 for a < kExpMinF and -inf,
// NaN for NaN. The reduction a = n ln2 + r is done in double, the rest in float.
PYENGINE_ALWAYS_INLINE float exp_neg_f(double a) {
    const double k = a * kLog2e + kRoundMagic;
    const double n = k - kRoundMagic;
    const double r = a - n * 0.69314718055994530942;  // |r| <= ln2/2, error ~1e-16
    const float p = poly_exp_f(static_cast<float>(r));
    // 2^n from float exponent bits (n >= -126 for a >= kExpMinF).
    const float kf = static_cast<float>(n) + kRoundMagicF;
    const float scale = from_bits((to_bits(kf) - to_bits(kRoundMagicF) + 127u) << 23);
    const float res = p * scale;
    return select(a < kExpMinF, 0.0f, res);  // a NaN a keeps res, which is NaN
}

// e^a for a float a <= 0 that is exact as given (gated SiLU's -|g|): the reduction in float
// (Cody-Waite, ln2 = 0.693359375 - 2.12194440e-4, the first part exact times n), about
// 1.5 ulp; no double arithmetic, which GCC vectorizes poorly next to float.
PYENGINE_ALWAYS_INLINE float exp_neg_f(float a) {
    const float k = a * 1.44269504088896341f + kRoundMagicF;
    const float n = k - kRoundMagicF;
    float r = a - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const float p = poly_exp_f(r);
    const float scale = from_bits((to_bits(k) - to_bits(kRoundMagicF) + 127u) << 23);
    const float res = p * scale;
    return select(a < static_cast<float>(kExpMinF), 0.0f, res);
}

// erfcx on z in [0, 9.4] (beyond it Phi(-|x|) underflows in float) as sum_k c_k t^k,
// t = (z - 4)/(z + 4) in [-1, 0.45]: a degree-11 Chebyshev fit on that interval
// (mpmath.chebyfit, 40 digits), max relative error 3e-10 before float rounding.
inline constexpr float kErfcxCoefF[] = {
    0.13699945762673144f,    -0.2590680494466127f,    0.21871968027274608f,
    -0.16425777990891793f,   0.10896312064219388f,    -0.06310840903386655f,
    0.031299594333153484f,   -0.012839561577756424f,  0.00405937153737316f,
    -0.0008149691795509706f, -2.8765935882777373e-05f, 0.00010122777161903319f,
};

PYENGINE_ALWAYS_INLINE float poly_erfcx_f(float t) {
    const auto& c = kErfcxCoefF;
    const float t2 = t * t;
    const float t4 = t2 * t2;
    const float t8 = t4 * t4;
    const float q0 = (c[0] + c[1] * t) + (c[2] + c[3] * t) * t2;
    const float q1 = (c[4] + c[5] * t) + (c[6] + c[7] * t) * t2;
    const float q2 = (c[8] + c[9] * t) + (c[10] + c[11] * t) * t2;
    return (q0 + q1 * t4) + q2 * t8;
}

// Phi(x) for float x.
PYENGINE_ALWAYS_INLINE float normal_cdf_f(float x) {
    const double xd = static_cast<double>(x);
    const float e = exp_neg_f(-0.5 * (xd * xd));  // exact square; inf for huge |x|: e = 0
    const float z = std::fabs(x) * static_cast<float>(kSqrtHalf);
    const float t = (z - 4.0f) / (z + 4.0f);
    const float h = 0.5f * e * poly_erfcx_f(t);
    return select(x > 0.0f, 1.0f - h, h);
}

// sigmoid(y) for a float y (exact as given), all in float.
PYENGINE_ALWAYS_INLINE float sigmoid_f(float y) {
    const float e = exp_neg_f(-std::fabs(y));
    const float a = 1.0f / (1.0f + e);
    const float b = e * a;
    return select(y >= 0.0f, a, b);
}

// sigmoid(y) for y given in double, as a float.
PYENGINE_ALWAYS_INLINE float sigmoid_f(double y) {
    const float e = exp_neg_f(-std::fabs(y));
    const float a = 1.0f / (1.0f + e);  // sigmoid(|y|)
    const float b = e * a;              // sigmoid(-|y|)
    return select(y >= 0.0, a, b);
}

}  // namespace vmath
}  // namespace pyengine
