// Attention softmax (causally masked) and its JVP; the MLP activations GELU (exact and
// tanh), ReLU and gated SiLU, and their derivatives. Batched over rows.
//
// Pure C++17 on raw pointers, templated on T (float or double); the kernel contract is the
// one of pyengine/_reference/activations.py, which these kernels must match to rounding:
//   softmax:      x, out (n, tq, tk); row (b, i) sees keys j <= i + offset (offset >= 0),
//                 masked keys are never read and come out exactly 0;
//   softmax_jvp:  p (m, tq, tk), dx and out (r, m, tq, tk): p is shared by the r tangents;
//   elementwise:  x, out (n, d); gated: u (n, 2d) = [gate | up], outputs (n, d).
// Every kernel writes all of its outputs and returns the number of bad rows (NaN/Inf
// input; for the softmax also a row whose visible scores are all -inf), whose output
// is unspecified (here: NaN for the softmax and its JVP). `out` may be the input array
// itself (x, or dx for the JVP): each element (each row, for the softmax) is read before
// it is written. It must not overlap the input in any other way.
//
// Numerics: everything is computed in double, also for float input, and cast on the way
// out, so float results are the correctly rounded double results up to a few double ulp.
// The transcendental functions are written here, branch-free (see `select`), so that
// `omp simd` loops vectorize them (4 doubles per AVX2 register): GCC uses glibc's vector
// math library (libmvec) only under -ffast-math, which stays off (the bad-row tests need
// NaN and Inf), and a scalar libm exp costs about 10 ns here against about 1.5 ns per
// element for the vectorized one (in the softmax's exp pass). exp: Cody-Waite
// reduction to |r| <= ln2/2 and the degree-13 Taylor polynomial (truncation < 5e-18),
// about 1 ulp. Phi (the normal CDF): Phi(-|x|) = exp(-x^2/2) erfcx(|x|/sqrt 2) / 2,
// with erfcx(z) = exp(z^2) erfc(z) as a degree-24 polynomial in t = (z - 4)/(z + 4),
// which maps [0, inf) onto [-1, 1) (after Schonfelder); relative error below 3e-15.
// Reductions (the softmax's max and sum, the JVP's dot product) run in an order fixed by
// the row length and the build's vector width, so results do not depend on the thread or
// the number of threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.hpp"

namespace pyengine {
namespace activations_detail {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

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

// GELU tanh approximation: 0.5 x (1 + tanh(z)) = x sigmoid(y), y = 2z = 2C x (1 + A x^2).
inline constexpr double kTwoC = 2.0 * 0.79788456080286535588;  // 2 sqrt(2/pi)
inline constexpr double kTanhA = 0.044715;

// ---------------------------------------------------------------------------------------
// The activations and their derivatives, elementwise, in double.

struct Gelu {
    static double f(double x) { return x * normal_cdf_pdf(x).cdf; }
};
struct GeluGrad {
    static double f(double x) {
        const auto n = normal_cdf_pdf(x);
        return n.cdf + x * n.pdf;
    }
};
struct GeluTanh {
    static double f(double x) { return x * sigmoid_pair(kTwoC * x * (1.0 + kTanhA * (x * x))).pos; }
};
struct GeluTanhGrad {
    static double f(double x) {
        const double x2 = x * x;
        const auto s = sigmoid_pair(kTwoC * x * (1.0 + kTanhA * x2));
        const double ss = s.pos * s.neg;  // 0 where |y| is huge, and kTwoC (...) may be inf
        const double term = x * ss * (kTwoC * (1.0 + 3.0 * kTanhA * x2));
        return s.pos + select(ss > 0.0, term, 0.0);
    }
};
// ReLU and its derivative are exact in any precision: computed in T (kInT), which spares
// the conversions to double and back (they cost more than the rest of this memory-bound
// loop). The ternaries on plain operands are if-converted to vector max/blend.
struct Relu {
    static constexpr bool kInT = true;
    template <class V>
    static V f(V x) {
        return x > V(0) ? x : V(0);
    }
};
struct ReluGrad {
    static constexpr bool kInT = true;
    template <class V>
    static V f(V x) {
        return x > V(0) ? V(1) : V(0);
    }
};

// Whether F computes in the storage type T instead of double.
template <class F, class = void>
struct in_storage_type : std::false_type {};
template <class F>
struct in_storage_type<F, std::void_t<decltype(F::kInT)>> : std::bool_constant<F::kInT> {};

// 1 for NaN or +-Inf, else 0, for an integer OR-reduction (vectorizes without fast-math).
template <class V>
PYENGINE_ALWAYS_INLINE int nonfinite(V v) {
    return (v - v == V(0)) ? 0 : 1;
}

template <class T>
bool softmax_row(const T* xr, index_t vis, index_t tk, double* e, T* o) {
    // Pass 1: the max over the visible keys, in T (exact).
    T mt = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : mt)
    for (index_t j = 0; j < vis; ++j) {
        mt = std::max(mt, xr[j]);
    }
    const double m = static_cast<double>(mt);
    // Pass 2: the terms, kept in double, and their sum. NaN or +inf among the visible
    // scores, or all of them -inf, make s NaN (inf - inf, NaN - m), so the test below
    // catches every bad row; a good row has s >= 1 (its largest term is exp(0) = 1).
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (index_t j = 0; j < vis; ++j) {
        const double t = exp_neg(static_cast<double>(xr[j]) - m);
        e[j] = t;
        s += t;
    }
    if (!(s >= 1.0)) {
        std::fill_n(o, tk, static_cast<T>(kNaN));
        return true;
    }
    // Pass 3: the output, written once; the masked keys are exactly 0.
    const double inv = 1.0 / s;
#pragma omp simd
    for (index_t j = 0; j < vis; ++j) {
        o[j] = static_cast<T>(e[j] * inv);
    }
    std::fill(o + vis, o + tk, T(0));
    return false;
}

}  // namespace activations_detail

// ---------------------------------------------------------------------------------------
// Softmax

/// Row softmax of x (n, tq, tk) over keys j <= i + offset (offset >= 0) into out; masked
/// keys are never read and written as 0. Returns the number of bad rows.
template <class T>
std::int64_t softmax(const T* x, index_t offset, index_t n, index_t tq, index_t tk, T* out) {
    using namespace activations_detail;
    const index_t rows = n * tq;
    std::int64_t nbad = 0;
#pragma omp parallel num_threads(threads_for(rows, tk)) reduction(+ : nbad)
    {
        std::vector<double> scratch(static_cast<std::size_t>(tk));  // one row's terms
        double* e = scratch.data();
#pragma omp for schedule(static)
        for (index_t row = 0; row < rows; ++row) {
            const index_t i = row % tq;
            // Keys 0 .. i + offset are visible (written so that a huge offset cannot overflow).
            const index_t vis = offset >= tk - i ? tk : i + offset + 1;
            nbad += softmax_row(x + row * tk, vis, tk, e, out + row * tk) ? 1 : 0;
        }
    }
    return nbad;
}

/// out = p * (dx - sum_j p dx) per row; p (m, tq, tk) shared by the r tangents dx (r, m,
/// tq, tk). Returns the number of rows whose sum is not finite (NaN/Inf in p or dx).
template <class T>
std::int64_t softmax_jvp(const T* p, const T* dx, index_t r, index_t m, index_t tq, index_t tk,
                         T* out) {
    using namespace activations_detail;
    const index_t p_rows = m * tq;
    return count_bad_rows(r * p_rows, tk, [=](index_t row) {
        const T* pr = p + (row % p_rows) * tk;
        const T* dr = dx + row * tk;
        T* o = out + row * tk;
        double dot = 0.0;
#pragma omp simd reduction(+ : dot)
        for (index_t j = 0; j < tk; ++j) {
            dot += static_cast<double>(pr[j]) * static_cast<double>(dr[j]);
        }
        if (!std::isfinite(dot)) {
            std::fill_n(o, tk, static_cast<T>(kNaN));
            return true;
        }
#pragma omp simd
        for (index_t j = 0; j < tk; ++j) {
            o[j] = static_cast<T>(static_cast<double>(pr[j]) * (static_cast<double>(dr[j]) - dot));
        }
        return false;
    });
}

// ---------------------------------------------------------------------------------------
// Elementwise activations

/// out = F(x) elementwise, x and out (n, d); returns the number of rows with NaN/Inf in x.
template <class F, class T>
std::int64_t elementwise(const T* x, index_t n, index_t d, T* out) {
    using namespace activations_detail;
    return count_bad_rows(n, d, [=](index_t row) {
        const T* xr = x + row * d;
        T* o = out + row * d;
        int bad = 0;
        if constexpr (in_storage_type<F>::value) {
#pragma omp simd reduction(| : bad)
            for (index_t j = 0; j < d; ++j) {
                const T v = xr[j];
                bad |= nonfinite(v);
                o[j] = F::f(v);
            }
        } else {
#pragma omp simd reduction(| : bad)
            for (index_t j = 0; j < d; ++j) {
                const double v = static_cast<double>(xr[j]);
                bad |= nonfinite(v);
                o[j] = static_cast<T>(F::f(v));
            }
        }
        return bad != 0;
    });
}

template <class T>
std::int64_t gelu(const T* x, index_t n, index_t d, T* out) {
    return elementwise<activations_detail::Gelu>(x, n, d, out);
}
template <class T>
std::int64_t gelu_grad(const T* x, index_t n, index_t d, T* out) {
    return elementwise<activations_detail::GeluGrad>(x, n, d, out);
}
template <class T>
std::int64_t gelu_tanh(const T* x, index_t n, index_t d, T* out) {
    return elementwise<activations_detail::GeluTanh>(x, n, d, out);
}
template <class T>
std::int64_t gelu_tanh_grad(const T* x, index_t n, index_t d, T* out) {
    return elementwise<activations_detail::GeluTanhGrad>(x, n, d, out);
}
template <class T>
std::int64_t relu(const T* x, index_t n, index_t d, T* out) {
    return elementwise<activations_detail::Relu>(x, n, d, out);
}
template <class T>
std::int64_t relu_grad(const T* x, index_t n, index_t d, T* out) {
    return elementwise<activations_detail::ReluGrad>(x, n, d, out);
}

/// out = silu(gate) * up, silu(g) = g sigmoid(g); u (n, 2d) = [gate | up], out (n, d).
template <class T>
std::int64_t silu_gated(const T* u, index_t n, index_t d, T* out) {
    using namespace activations_detail;
    return count_bad_rows(n, 2 * d, [=](index_t row) {
        const T* g = u + row * 2 * d;
        const T* up = g + d;
        T* o = out + row * d;
        int bad = 0;
#pragma omp simd reduction(| : bad)
        for (index_t j = 0; j < d; ++j) {
            const double gj = static_cast<double>(g[j]);
            const double uj = static_cast<double>(up[j]);
            bad |= nonfinite(gj) | nonfinite(uj);
            o[j] = static_cast<T>(gj * sigmoid_pair(gj).pos * uj);
        }
        return bad != 0;
    });
}

/// out_a = silu'(gate) * up, out_b = silu(gate); u (n, 2d), out_a and out_b (n, d).
template <class T>
std::int64_t silu_gated_grad(const T* u, index_t n, index_t d, T* out_a, T* out_b) {
    using namespace activations_detail;
    return count_bad_rows(n, 2 * d, [=](index_t row) {
        const T* g = u + row * 2 * d;
        const T* up = g + d;
        T* oa = out_a + row * d;
        T* ob = out_b + row * d;
        int bad = 0;
#pragma omp simd reduction(| : bad)
        for (index_t j = 0; j < d; ++j) {
            const double gj = static_cast<double>(g[j]);
            const double uj = static_cast<double>(up[j]);
            bad |= nonfinite(gj) | nonfinite(uj);
            const auto s = sigmoid_pair(gj);
            oa[j] = static_cast<T>(s.pos * (1.0 + gj * s.neg) * uj);
            ob[j] = static_cast<T>(gj * s.pos);
        }
        return bad != 0;
    });
}

}  // namespace pyengine
