// LayerNorm: forward, JVP, VJP and dense Jacobian, batched over rows (RMSNorm: rmsnorm.hpp).
//
// Pure C++17 on raw pointers, templated on T (float or double); the kernel contract is
// the one of pyengine/kernels/_reference/layernorm.py, which these kernels must match
// to rounding:
//   x, v, u, out: (n, d) C-contiguous; gamma, beta: (d,); Jacobians write (n, d, d);
//   `frozen` holds the scale s (resp. r) constant; every kernel writes all of `out` and
//   returns the number of bad rows, whose output is unspecified (here: NaN).
// A row is bad iff its sums are not finite (NaN/Inf in x or in the tangent) or its
// scale is not positive: var + eps <= 0 (LayerNorm), mean(x^2) + eps <= 0 (RMSNorm).
//
// Numerics: everything is computed in double, also for float input, and cast on the
// way out (two exceptions, both in LayerNorm's forward pass on float rows: the output
// pass, see f32_output_pass_ok, and pass 2, the squared deviations from float(mu), see
// centred_var_f32; the sums and the statistics are still double). The variance is two-pass (mean first, then the mean of squared deviations)
// because E[x^2] - E[x]^2 cancels catastrophically when |mean| >> std. Reductions are
// vectorized by explicit lanes (rows.hpp), not by -ffast-math, which stays off
// because the bad-row test needs std::isfinite. Each row is reduced in an order fixed
// by d, so results do not depend on the thread or the number of threads.
//
// Passes: the kernels are memory-bound, and a row (d values of x and of the tangent)
// stays in L1/L2 between passes, so extra passes over it cost little next to its one
// trip to memory. LayerNorm: pass 1 sums x (and the tangent w: JVP/VJP); pass 2 sums
// (x - mu)^2 (and (x - mu) w); pass 3 writes. RMSNorm: pass 1 sums x^2 (and x w); pass 2
// writes. Each thread pipelines its rows: the writing pass of row i also runs pass 1 of
// row i + 1 (count_bad_rows_pipelined), and writes with streaming stores when the
// output is too large for the cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel.hpp"
#include "rows.hpp"
#include "rows_f32.hpp"

namespace pyengine {
namespace layernorm_detail {

// The tangent w_j in double: v_j for a JVP, gamma_j u_j for a VJP (exact for float).
template <bool kVjp, class T>
auto tangent(const T* t_row, const T* gamma) {
    return [=](auto lane, index_t j) {
        using L = decltype(lane);
        if constexpr (kVjp) {
            return L::load(gamma + j) * L::load(t_row + j);
        } else {
            return L::load(t_row + j);
        }
    };
}

// The tangent of slow_stats when there is none.
inline constexpr auto no_tangent = [](index_t) { return 0.0; };

template <class V>
V square(V a) {
    return a * a;
}

// Pass 2 of LayerNorm: var = mean((x - mu)^2).
template <class T>
double centred_var(const T* xr, index_t d, double mu) {
    return row_sums(d, [=](auto lane, index_t j) {
               const auto c = element(xr)(lane, j) - mu;
               return c * c;
           }).first /
           static_cast<double>(d);
}

// An exactly constant row has mean x[0] and variance 0 (the kernel contract): the
// rounded mean would leave it a variance of ~1e-34 or 0 depending on summation order,
// and so on the backend. The scan runs only when var is tiny next to mu^2, that is for
// (nearly) constant rows; rounding leaves a constant row far below this threshold.
inline constexpr double kNearConstant = 1e-16;
template <class T>
bool constant_row(const T* xr, index_t d, double mu, double var) {
    if (!(var <= kNearConstant * mu * mu)) return false;
    for (index_t i = 1; i < d; ++i) {
        if (xr[i] != xr[0]) return false;
    }
    return true;
}

#ifdef PYENGINE_HAVE_F32_ROWS
// Pass 2 of a float LayerNorm row in float lanes: c_j = x_j - m with m = float(mu) (one
// rounding, relative to c_j), sum c_j^2 (sum_sq_dev_f32), and var = mean(c^2) - (mu - m)^2,
// the identity sum (x - m)^2 = sum (x - mu)^2 + d (mu - m)^2 (sum (x - mu) = 0). Rows whose
// float squares may overflow or underflow (var outside [2^-60, 2^100]) take the double pass.
// Within a few float roundings of the double pass, relative; 16 floats a vector and no
// conversions: the (2048, 768) float32 forward 15-20 % faster per core (Zen 4).
inline double centred_var_f32(const float* xr, index_t d, double mu) {
    const float m = static_cast<float>(mu);
    const double shift = mu - static_cast<double>(m);
    const double var = sum_sq_dev_f32(xr, d, m) / static_cast<double>(d) - shift * shift;
    return var >= 0x1p-60 && var <= 0x1p100 ? var : centred_var(xr, d, mu);
}
#endif

// Mean and two-pass variance of a LayerNorm row, given the row's sum; an exactly
// constant row gets mean x[0] and variance 0 (see constant_row). kF32Var: pass 2 of a
// float row in float (centred_var_f32; LayerNorm's forward only), where it is built.
template <bool kF32Var = false, class T>
std::pair<double, double> ln_mean_var(const T* xr, index_t d, double sum) {
    const double mu = sum / static_cast<double>(d);
    const double var = [&] {
#ifdef PYENGINE_HAVE_F32_ROWS
        if constexpr (kF32Var && std::is_same_v<T, float>) return centred_var_f32(xr, d, mu);
#endif
        return centred_var(xr, d, mu);
    }();
    if (constant_row(xr, d, mu, var)) return {static_cast<double>(xr[0]), 0.0};
    return {mu, var};
}

// Per-row statistics the dense Jacobians need: the centre (mu, or 0 for RMSNorm) and
// 1/scale; computed in a first parallel pass so that the d x d writing can then be
// spread over all output rows, even when there is a single token.
struct RowStats {
    double centre;
    double inv_scale;
};

// J[i, j] = gamma_i / s * (delta_ij - c0 - xh_i xh_j / d) with xh = (x - centre) / s:
// c0 = 1/d for LayerNorm (the mean removal), 0 for RMSNorm; `frozen` drops the xh term.
template <class T>
std::int64_t dense_jacobian(const T* x, const T* gamma, index_t n, index_t d, double c0,
                            bool frozen, const std::vector<RowStats>& stats,
                            const std::vector<char>& bad, T* out) {
    const double inv_d = 1.0 / static_cast<double>(d);
    const bool stream = use_streaming_stores<T>(n * d * d);
    parallel_for(n * d, d, [&](index_t k) {
        const index_t row = k / d;
        const index_t i = k % d;
        T* o = out + k * d;  // (row, i, :) of out
        if (bad[static_cast<std::size_t>(row)]) {
            write_nan_row(o, d);
            return;
        }
        const T* xr = x + row * d;
        const double mu = stats[static_cast<std::size_t>(row)].centre;
        const double inv_s = stats[static_cast<std::size_t>(row)].inv_scale;
        const double a = static_cast<double>(gamma[i]) * inv_s;
        const double ci = frozen ? 0.0 : (static_cast<double>(xr[i]) - mu) * inv_s * inv_d;
        // Off the diagonal delta_ij = 0: write [0, i) and (i, d), then the diagonal.
        auto off_diagonal = [=](auto lane, index_t j) {
            return a * (-c0 - ci * ((element(xr)(lane, j) - mu) * inv_s));
        };
        write_row(o, i, stream, off_diagonal);
        write_row(o + i + 1, d - i - 1, stream,
                  [=](auto lane, index_t j) { return off_diagonal(lane, j + i + 1); });
        const double xh_i = (static_cast<double>(xr[i]) - mu) * inv_s;
        o[i] = static_cast<T>(a * ((1.0 - c0) - ci * xh_i));
    });
    std::int64_t nbad = 0;
    for (char b : bad) {
        nbad += b ? 1 : 0;
    }
    return nbad;
}

// Whether LayerNorm's float32 output pass may run in float (rows_f32.hpp): the float32
// result gamma * (x - mu) / s + beta is then within a few float ulps of the double pass,
// inside the float32 tolerance. Only for scales and means well inside float's range:
// 1/s must not overflow and (x - mu) must not be subnormal where it matters; other rows
// (the slow path's, rows like 1e-38) keep the double pass.
inline bool f32_output_pass_ok(double mu, double inv_s) {
    return inv_s >= 0x1p-100 && inv_s <= 0x1p100 && std::fabs(mu) <= 0x1p100;
}

// LayerNorm pass 1 of row `row`: the sum of x (first_pass objects for the pipeline).
template <class T>
auto ln_first_pass(const T* x, index_t d) {
    return [=](index_t row) {
        const T* xr = x + row * d;
        return RowSums(d, element(xr)).prefetch_from(xr);
    };
}

// RMSNorm pass 1 of row `row`: the sum of x^2.
template <class T>
auto rms_first_pass(const T* x, index_t d) {
    return [=](index_t row) {
        const T* xr = x + row * d;
        auto square = [xr](auto lane, index_t j) {
            const auto xj = element(xr)(lane, j);
            return xj * xj;
        };
        // 4-double accumulators (kWideSingle = false): measured faster for this sum.
        return RowSums<decltype(square), NoTerm, false>(d, square).prefetch_from(xr);
    };
}

}  // namespace layernorm_detail

// ---------------------------------------------------------------------------------------
// LayerNorm

/// y = gamma * (x - mu) / sqrt(var + eps) + beta, per row. x, out: (n, d); gamma, beta: (d,).
template <class T>
std::int64_t layer_norm(const T* x, const T* gamma, const T* beta, double eps, index_t n,
                        index_t d, T* out) {
    using namespace layernorm_detail;
    const bool stream = use_streaming_stores<T>(n * d);
    return count_bad_rows_pipelined(
        n, d, ln_first_pass(x, d), [=](index_t row, auto sums, auto* next) {
            const T* xr = x + row * d;
            T* o = out + row * d;
            const auto stats = ln_mean_var<true>(xr, d, sums.first);
            double mu = stats.first;  // a plain local: the row writer captures it
            const double sq = stats.second + eps;
            double inv_s = 1.0 / std::sqrt(sq);
            bool bad = !(std::isfinite(mu) && good_scale(sq));
            if (!safe_scale(sq, mu)) {  // a row of extreme magnitude: its statistics, rescaled
                const auto slow = slow_stats(xr, d, eps, true, false, no_tangent);
                mu = slow.mu;
                inv_s = 1.0 / slow.scale;
                bad = slow.bad;
            }
            if (bad) {
                write_nan_row(o, d);
                return true;
            }
#ifdef PYENGINE_HAVE_F32_ROWS
            if constexpr (std::is_same_v<T, float>) {
                if (f32_output_pass_ok(mu, inv_s)) {
                    // In float: (x - mu_hi) - mu_lo, with mu = mu_hi + mu_lo to ~2^-48
                    // relative, keeps the centring exact enough for rows of large mean.
                    const float mu_hi = static_cast<float>(mu);
                    const float mu_lo = static_cast<float>(mu - static_cast<double>(mu_hi));
                    const float inv_f = static_cast<float>(inv_s);
                    write_row_f32(
                        o, d, stream,
                        [=](auto lane, index_t j) {
                            using L = decltype(lane);
                            const auto c = L::sub(L::sub(L::load(xr + j), L::set1(mu_hi)),
                                                  L::set1(mu_lo));
                            return L::fma(L::load(gamma + j), L::mul(c, L::set1(inv_f)),
                                          L::load(beta + j));
                        },
                        next);
                    return false;
                }
            }
#endif
            write_row(
                o, d, stream,
                [=](auto lane, index_t j) {
                    using L = decltype(lane);
                    return L::load(gamma + j) * ((L::load(xr + j) - mu) * inv_s) +
                           L::load(beta + j);
                },
                next);
            return false;
        });
}

namespace layernorm_detail {

// The shared core of the LayerNorm JVP (kVjp = false: w = v, scale = gamma) and VJP
// (kVjp = true: w = gamma * u, scale = 1), with t the tangent array (v or u):
//   out_j = scale_j * (w_j - mean w - xh_j mean(xh w)) / s;  `frozen` drops the xh term.
template <bool kVjp, class T>
std::int64_t ln_tangent(const T* x, const T* t, const T* gamma, double eps, bool frozen,
                        index_t n, index_t d, T* out) {
    const double inv_d = 1.0 / static_cast<double>(d);
    const bool stream = use_streaming_stores<T>(n * d);
    auto first_pass = [=](index_t row) {  // sums of x and w
        const T* xr = x + row * d;
        const T* tr = t + row * d;
        return RowSums(d, element(xr), tangent<kVjp>(tr, gamma)).prefetch_from(xr, tr);
    };
    return count_bad_rows_pipelined(n, 2 * d, first_pass, [=](index_t row, auto sums,
                                                               auto* next) {
        const T* xr = x + row * d;
        T* o = out + row * d;
        const auto w = tangent<kVjp>(t + row * d, gamma);
        const double mw = sums.second * inv_d;
        // Pass 2: sums of (x - mu)^2 and (x - mu) w.
        double mu = sums.first * inv_d;
        auto [sxx, sxw] = row_sums(
            d, [=](auto lane, index_t j) { return square(element(xr)(lane, j) - mu); },
            [=](auto lane, index_t j) { return (element(xr)(lane, j) - mu) * w(lane, j); });
        if (constant_row(xr, d, mu, sxx * inv_d)) {
            mu = static_cast<double>(xr[0]);
            sxx = sxw = 0.0;
        }
        const double sq = sxx * inv_d + eps;
        double inv_s = 1.0 / std::sqrt(sq);
        // xh_j mean(xh w) = (x_j - mu) * k with k = mean((x - mu) w) / s^2.
        double k = frozen ? 0.0 : sxw * inv_d / sq;
        bool bad = !good_scale(sq);
        if (!safe_scale(sq, mu)) {  // a row of extreme magnitude: its statistics, rescaled
            const auto slow = slow_stats(xr, d, eps, true, !frozen,
                                         [=](index_t j) { return w(Scalar{}, j); });
            mu = slow.mu;
            inv_s = 1.0 / slow.scale;
            k = frozen ? 0.0 : slow.k;
            bad = slow.bad;
        }
        auto xc = [=](auto lane, index_t j) { return element(xr)(lane, j) - mu; };
        // Non-finite sums flag NaN/Inf anywhere in x (mu) or in the tangent (mw), or
        // sums of the tangent that overflowed (mw, k).
        if (bad || !(std::isfinite(mu) && std::isfinite(mw) && std::isfinite(k))) {
            write_nan_row(o, d);
            return true;
        }
        write_row(
            o, d, stream,
            [=](auto lane, index_t j) {
                const auto r = ((w(lane, j) - mw) - xc(lane, j) * k) * inv_s;
                if constexpr (kVjp) {
                    return r;
                } else {
                    return decltype(lane)::load(gamma + j) * r;
                }
            },
            next);
        return false;
    });
}

}  // namespace layernorm_detail

/// J v = gamma/s * (v - mean v - xh mean(xh v)); frozen: gamma/s * (v - mean v).
template <class T>
std::int64_t layer_norm_jvp(const T* x, const T* v, const T* gamma, double eps, bool frozen,
                            index_t n, index_t d, T* out) {
    return layernorm_detail::ln_tangent<false>(x, v, gamma, eps, frozen, n, d, out);
}

/// J^T u = (g - mean g - xh mean(xh g)) / s with g = gamma * u; frozen drops the xh term.
template <class T>
std::int64_t layer_norm_vjp(const T* x, const T* u, const T* gamma, double eps, bool frozen,
                            index_t n, index_t d, T* out) {
    return layernorm_detail::ln_tangent<true>(x, u, gamma, eps, frozen, n, d, out);
}

/// Dense J per row, out: (n, d, d), J[i, j] = gamma_i/s (delta_ij - 1/d - xh_i xh_j/d).
template <class T>
std::int64_t layer_norm_jacobian(const T* x, const T* gamma, double eps, bool frozen,
                                 index_t n, index_t d, T* out) {
    using namespace layernorm_detail;
    std::vector<RowStats> stats(static_cast<std::size_t>(n));
    std::vector<char> bad(static_cast<std::size_t>(n));
    count_bad_rows(n, d, [&, first_pass = ln_first_pass(x, d)](index_t row) {
        const auto mean_var = ln_mean_var(x + row * d, d, first_pass(row).finish().first);
        double mu = mean_var.first;
        const double sq = mean_var.second + eps;
        double s = std::sqrt(sq);
        bool is_bad = !(std::isfinite(mu) && good_scale(sq));
        if (!safe_scale(sq, mu)) {  // a row of extreme magnitude: its statistics, rescaled
            const auto slow = slow_stats(x + row * d, d, eps, true, false, no_tangent);
            mu = slow.mu;
            s = slow.scale;
            is_bad = slow.bad;
        }
        stats[static_cast<std::size_t>(row)] = {mu, is_bad ? kNaN : 1.0 / s};
        bad[static_cast<std::size_t>(row)] = is_bad;
        return is_bad;
    });
    return dense_jacobian(x, gamma, n, d, 1.0 / static_cast<double>(d), frozen, stats, bad,
                          out);
}

}  // namespace pyengine
