// Attention softmax (causally masked) and its JVP; the MLP activations GELU (exact and
// tanh), ReLU and gated SiLU, and their derivatives. Batched over rows.
//
// Pure C++17 on raw pointers, templated on T (float or double); the kernel contract is the
// one of pyengine/kernels/_reference/activations.py, which these kernels must match to
// rounding:
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
// Numerics: float64 input is computed in double. float32 input: the softmax and the
// forward GELU (both), and gated SiLU compute in float with the float functions of
// vmath.hpp (exp arguments formed and reduced in double, so the tails keep their relative
// accuracy; a few float ulp, see vmath.hpp), the softmax's sum in double. The derivatives
// and the softmax JVP compute in double and are cast on the way out (they cancel).
// The transcendental functions (exp, Phi, sigmoid) are those of vmath.hpp, branch-free,
// so that `omp simd` loops vectorize them (4 doubles per AVX2 register); its header
// gives their accuracy and why they are not libm's.
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
#include "rows.hpp"
#include "vmath.hpp"

namespace pyengine {
namespace activations_detail {

// exp_neg, normal_cdf_pdf, sigmoid_pair, select.
using namespace vmath;

// GELU tanh approximation: 0.5 x (1 + tanh(z)) = x sigmoid(y), y = 2z = 2C x (1 + A x^2).
inline constexpr double kTwoC = 2.0 * 0.79788456080286535588;  // 2 sqrt(2/pi)
inline constexpr double kTanhA = 0.044715;

// ---------------------------------------------------------------------------------------
// The activations and their derivatives, elementwise, in double.

struct Gelu {
    static double f(double x) { return x * normal_cdf_pdf(x).cdf; }
    static float f32(float x) { return x * normal_cdf_f(x); }
};
struct GeluGrad {
    static double f(double x) {
        const auto n = normal_cdf_pdf(x);
        return n.cdf + x * n.pdf;
    }
};
struct GeluTanh {
    static double f(double x) { return x * sigmoid_pair(kTwoC * x * (1.0 + kTanhA * (x * x))).pos; }
    static float f32(float x) {
        const double xd = static_cast<double>(x);
        return x * sigmoid_f(kTwoC * xd * (1.0 + kTanhA * (xd * xd)));
    }
};
// gelu_tanh with its argument y and exponential in float: relative error about 2e-7 |y|
// (the float argument's rounding; up to 1e-5 in the far negative tail, where gelu_tanh is
// below 1e-20) against GeluTanh's ~1e-7, at about half its cost; for the epilogue of the
// bf16 products (linear_bf16.hpp), whose operands carry 2^-8.
struct GeluTanhFloat {
    static constexpr float kTwoCf = static_cast<float>(kTwoC), kTanhAf = static_cast<float>(kTanhA);
    static double f(double x) { return GeluTanh::f(x); }
    static float f32(float x) { return x * sigmoid_f(kTwoCf * x * (1.0f + kTanhAf * (x * x))); }
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

// Whether F has a float32 variant f32 (vmath.hpp's float functions), used for float input.
template <class F, class = void>
struct has_f32 : std::false_type {};
template <class F>
struct has_f32<F, std::void_t<decltype(F::f32(0.0f))>> : std::true_type {};

// 1 for NaN or +-Inf, else 0, for an integer OR-reduction (vectorizes without fast-math).
template <class V>
PYENGINE_ALWAYS_INLINE int nonfinite(V v) {
    return (v - v == V(0)) ? 0 : 1;
}

// The largest of x[0..n) (-inf for n = 0; NaNs are skipped, as by std::max(m, x)). Written
// as x > m ? x : m: GCC vectorizes that reduction, but not `m = std::max(m, x)` under `omp
// simd reduction(max)`, which ran as a chain of scalar maxes (about 13x slower); any order
// gives the same maximum.
template <class T>
PYENGINE_ALWAYS_INLINE T row_max(const T* x, index_t n) {
    T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
    for (index_t j = 0; j < n; ++j) {
        m = x[j] > m ? x[j] : m;
    }
    return m;
}

// float input: the terms in float (exp_neg_f, argument x - m formed exactly in double),
// kept in o itself, their sum in double; the output is the term times the rounded 1/s.
inline bool softmax_row_f32(const float* xr, index_t vis, index_t tk, float* o) {
    const float mt = row_max(xr, vis);
    const double m = static_cast<double>(mt);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (index_t j = 0; j < vis; ++j) {
        const float t = exp_neg_f(static_cast<double>(xr[j]) - m);
        o[j] = t;  // xr[j] is read before: out may be x itself
        s += static_cast<double>(t);
    }
    if (!(s >= 1.0)) {
        std::fill_n(o, tk, static_cast<float>(kNaN));
        return true;
    }
    const float inv = static_cast<float>(1.0 / s);
#pragma omp simd
    for (index_t j = 0; j < vis; ++j) {
        o[j] = o[j] * inv;
    }
    std::fill(o + vis, o + tk, 0.0f);
    return false;
}

template <class T>
bool softmax_row(const T* xr, index_t vis, index_t tk, double* e, T* o) {
    if constexpr (std::is_same_v<T, float>) {
        (void)e;
        return softmax_row_f32(xr, vis, tk, o);
    }
    // Pass 1: the max over the visible keys, in T (exact).
    const T mt = row_max(xr, vis);
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
        } else if constexpr (std::is_same_v<T, float> && has_f32<F>::value) {
#pragma omp simd reduction(| : bad)
            for (index_t j = 0; j < d; ++j) {
                const float v = xr[j];
                bad |= nonfinite(v);
                o[j] = F::f32(v);
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
        if constexpr (std::is_same_v<T, float>) {
#pragma omp simd reduction(| : bad)
            for (index_t j = 0; j < d; ++j) {
                const float gj = g[j];
                const float uj = up[j];
                bad |= nonfinite(gj) | nonfinite(uj);
                o[j] = gj * sigmoid_f(gj) * uj;  // -|g| is exact in float
            }
        } else {
#pragma omp simd reduction(| : bad)
            for (index_t j = 0; j < d; ++j) {
                const double gj = static_cast<double>(g[j]);
                const double uj = static_cast<double>(up[j]);
                bad |= nonfinite(gj) | nonfinite(uj);
                o[j] = static_cast<T>(gj * sigmoid_pair(gj).pos * uj);
            }
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
