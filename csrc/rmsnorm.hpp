// RMSNorm: forward, JVP, VJP and dense Jacobian, batched over rows.
//
// The kernel contract, numerics and passes are those stated at the top of layernorm.hpp,
// whose row helpers (layernorm_detail) these kernels share; split from it to keep each
// header one family of kernels.
#pragma once

#include "layernorm.hpp"

namespace pyengine {

// ---------------------------------------------------------------------------------------
// RMSNorm: no centring, so one reduction pass and one writing pass per row.

/// y = gamma * x / sqrt(mean(x^2) + eps), per row.
template <class T>
std::int64_t rms_norm(const T* x, const T* gamma, double eps, index_t n, index_t d, T* out) {
    using namespace layernorm_detail;
    const bool stream = use_streaming_stores<T>(n * d);
    return count_bad_rows_pipelined(
        n, d, rms_first_pass(x, d), [=](index_t row, auto sums, auto* next) {
            const T* xr = x + row * d;
            T* o = out + row * d;
            const double sq = sums.first / static_cast<double>(d) + eps;
            double inv_r = 1.0 / std::sqrt(sq);
            // A NaN/Inf in x makes the sum of squares NaN/Inf.
            bool bad = !good_scale(sq);
            if (!safe_scale(sq, 0.0)) {  // a row of extreme magnitude: its statistics, rescaled
                const auto slow = slow_stats(xr, d, eps, false, false, no_tangent);
                inv_r = 1.0 / slow.scale;
                bad = slow.bad;
            }
            if (bad) {
                write_nan_row(o, d);
                return true;
            }
            write_row(
                o, d, stream,
                [=](auto lane, index_t j) {
                    using L = decltype(lane);
                    return L::load(gamma + j) * (L::load(xr + j) * inv_r);
                },
                next);
            return false;
        });
}

namespace layernorm_detail {

// The shared core of the RMSNorm JVP and VJP, tangent w and scale as in ln_tangent:
//   out_j = scale_j * (w_j - x_j mean(x w) / r^2) / r;  `frozen` drops the x term.
template <bool kVjp, class T>
std::int64_t rms_tangent(const T* x, const T* t, const T* gamma, double eps, bool frozen,
                         index_t n, index_t d, T* out) {
    const double inv_d = 1.0 / static_cast<double>(d);
    const bool stream = use_streaming_stores<T>(n * d);
    auto first_pass = [=](index_t row) {  // sums of x^2 and x w
        const T* xr = x + row * d;
        const T* tr = t + row * d;
        const auto xj = element(xr);
        const auto w = tangent<kVjp>(tr, gamma);
        return RowSums(
                   d, [=](auto lane, index_t j) { return xj(lane, j) * xj(lane, j); },
                   [=](auto lane, index_t j) { return xj(lane, j) * w(lane, j); })
            .prefetch_from(xr, tr);
    };
    return count_bad_rows_pipelined(n, 2 * d, first_pass, [=](index_t row, auto sums,
                                                               auto* next) {
        const T* xr = x + row * d;
        T* o = out + row * d;
        const auto w = tangent<kVjp>(t + row * d, gamma);
        const double sq = sums.first * inv_d + eps;
        const double sxw = sums.second;
        // NaN/Inf in x makes sum x^2 non-finite; in w, sum x w (x_j Inf is Inf, or NaN
        // if x_j = 0).
        bool bad = !(std::isfinite(sxw) && good_scale(sq));
        double inv_r = 1.0 / std::sqrt(sq);
        double k = frozen ? 0.0 : sxw * inv_d / sq;  // mean(x w) / r^2
        if (!safe_scale(sq, 0.0)) {  // a row of extreme magnitude: its statistics, rescaled
            const auto slow = slow_stats(xr, d, eps, false, true,
                                         [=](index_t j) { return w(Scalar{}, j); });
            inv_r = 1.0 / slow.scale;
            k = frozen ? 0.0 : slow.k;
            bad = slow.bad;
        }
        if (bad) {
            write_nan_row(o, d);
            return true;
        }
        write_row(
            o, d, stream,
            [=](auto lane, index_t j) {
                const auto r = (w(lane, j) - element(xr)(lane, j) * k) * inv_r;
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

/// J v = gamma/r * (v - x mean(x v)/r^2); frozen: gamma * v / r.
template <class T>
std::int64_t rms_norm_jvp(const T* x, const T* v, const T* gamma, double eps, bool frozen,
                          index_t n, index_t d, T* out) {
    return layernorm_detail::rms_tangent<false>(x, v, gamma, eps, frozen, n, d, out);
}

/// J^T u = (g - x mean(x g)/r^2) / r with g = gamma * u; frozen: g / r.
template <class T>
std::int64_t rms_norm_vjp(const T* x, const T* u, const T* gamma, double eps, bool frozen,
                          index_t n, index_t d, T* out) {
    return layernorm_detail::rms_tangent<true>(x, u, gamma, eps, frozen, n, d, out);
}

/// Dense J per row, out: (n, d, d), J[i, j] = gamma_i/r (delta_ij - x_i x_j/(d r^2)).
template <class T>
std::int64_t rms_norm_jacobian(const T* x, const T* gamma, double eps, bool frozen, index_t n,
                               index_t d, T* out) {
    using namespace layernorm_detail;
    std::vector<RowStats> stats(static_cast<std::size_t>(n));
    std::vector<char> bad(static_cast<std::size_t>(n));
    count_bad_rows(n, d, [&, first_pass = rms_first_pass(x, d)](index_t row) {
        const double sq = first_pass(row).finish().first / static_cast<double>(d) + eps;
        double r = std::sqrt(sq);
        bool is_bad = !good_scale(sq);
        if (!safe_scale(sq, 0.0)) {  // a row of extreme magnitude: its statistics, rescaled
            const auto slow = slow_stats(x + row * d, d, eps, false, false, no_tangent);
            r = slow.scale;
            is_bad = slow.bad;
        }
        stats[static_cast<std::size_t>(row)] = {0.0, is_bad ? kNaN : 1.0 / r};
        bad[static_cast<std::size_t>(row)] = is_bad;
        return is_bad;
    });
    return dense_jacobian(x, gamma, n, d, 0.0, frozen, stats, bad, out);
}

}  // namespace pyengine
