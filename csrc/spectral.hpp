// Spectral kernels of the normalization Jacobians: the exact largest singular value
// (secular equation, secular.hpp) and a fused per-token power iteration.
//
// Pure C++17 on raw pointers, templated on T (float or double); the kernel contract and
// the mathematics are those of pyengine/kernels/_reference/spectral.py, the solver is the
// one of pyengine/kernels/_numba/_secular.py (its docstring explains every step):
//   x, v0: (n, d) C-contiguous T; gamma: (d,) T; every output is double (iterations
//   int64) of shape (n,); a bad row (non-finite statistics, NaN/Inf in v0, zero scale)
//   gets NaN outputs (0 iterations) and is counted in the return value.
//
// sigma_max: per token, sqrt(lambda_max / s^2) with lambda_max from secular.hpp; frozen
// LayerNorm and constant rows depend on gamma alone and take one solve per call.
//
// Power iteration: a float64 scratch row v per thread; two passes over d per product J^T J
// (u = J v on the fly with |u|^2 and the VJP sums; w = J^T u with |w - rho v|^2 summed
// directly, not expanded, the sums of the next product, and w stored over v).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "parallel.hpp"
#include "rows.hpp"
#include "secular.hpp"

namespace pyengine {
namespace spectral_detail {

// Two-pass row statistics in double: (centre, mean square about it).
template <class T>
std::pair<double, double> row_stats(const T* xr, index_t d, bool centre) {
    const double inv_d = 1.0 / static_cast<double>(d);
    const double mu =
        centre ? row_sums(d, [=](auto lane, index_t j) { return decltype(lane)::load(xr + j); })
                         .first *
                     inv_d
               : 0.0;
    const double ms = row_sums(d, [=](auto lane, index_t j) {
                          const auto c = decltype(lane)::load(xr + j) - mu;
                          return c * c;
                      }).first *
                      inv_d;
    return {mu, ms};
}

// ---------------------------------------------------------------------------------------
// Power iteration: two passes per product J^T J. v holds the last w, unnormalized, and
// alpha = 1/|w| is carried along; pass C also sums w and xh w, the first sums of the next
// product. xh = (x - mu) inv is formed on the fly from x (reading x and gamma in their own
// dtype keeps the three streams of a row in L1/L2).

// u = g inv (alpha v - mv - xh m2) on the fly: (|u|^2, sum g u, sum xh g u).
struct PassB {
    double uu, sg, sxg;
};

template <class T>
PassB pass_b(const T* x, const T* g, const double* v, double mu, double inv, double alpha,
             double mv, double m2, index_t d) {
    double uu = 0.0, sg = 0.0, sxg = 0.0;
    index_t j = 0;
#ifdef __AVX__
    {
        __m256d a = _mm256_setzero_pd(), b = a, c = a;
        for (; j + 4 <= d; j += 4) {
            const __m256d gj = Lanes4::load(g + j);
            const __m256d xj = (Lanes4::load(x + j) - mu) * inv;
            const __m256d u = gj * (inv * ((alpha * _mm256_loadu_pd(v + j) - mv) - xj * m2));
            const __m256d gu = gj * u;
            a += u * u;
            b += gu;
            c += xj * gu;
        }
        uu = sum_lanes(a), sg = sum_lanes(b), sxg = sum_lanes(c);
    }
#endif
    for (; j < d; ++j) {
        const double gj = static_cast<double>(g[j]);
        const double xj = (static_cast<double>(x[j]) - mu) * inv;
        const double u = gj * (inv * ((alpha * v[j] - mv) - xj * m2));
        const double gu = gj * u;
        uu += u * u;
        sg += gu;
        sxg += xj * gu;
    }
    return {uu, sg, sxg};
}

// w = inv (g u - mg - xh m2g) (u recomputed); v <- w.
struct PassC {
    double rr, ww, sw, sxw;  // |w - rho alpha v|^2, |w|^2, sum w, sum xh w
};

template <class T>
PassC pass_c(const T* x, const T* g, double* v, double mu, double inv, double alpha, double mv,
             double m2, double mg, double m2g, double rho, index_t d) {
    double rr = 0.0, ww = 0.0, sw = 0.0, sxw = 0.0;
    index_t j = 0;
#ifdef __AVX__
    {
        __m256d a = _mm256_setzero_pd(), b = a, c = a, e = a;
        for (; j + 4 <= d; j += 4) {
            const __m256d gj = Lanes4::load(g + j);
            const __m256d xj = (Lanes4::load(x + j) - mu) * inv;
            const __m256d vj = alpha * _mm256_loadu_pd(v + j);
            const __m256d u = gj * (inv * ((vj - mv) - xj * m2));
            const __m256d wj = inv * ((gj * u - mg) - xj * m2g);
            const __m256d t = wj - rho * vj;
            a += t * t;
            b += wj * wj;
            c += wj;
            e += xj * wj;
            _mm256_storeu_pd(v + j, wj);
        }
        rr = sum_lanes(a), ww = sum_lanes(b), sw = sum_lanes(c), sxw = sum_lanes(e);
    }
#endif
    for (; j < d; ++j) {
        const double gj = static_cast<double>(g[j]);
        const double xj = (static_cast<double>(x[j]) - mu) * inv;
        const double vj = alpha * v[j];
        const double u = gj * (inv * ((vj - mv) - xj * m2));
        const double wj = inv * ((gj * u - mg) - xj * m2g);
        const double t = wj - rho * vj;
        rr += t * t;
        ww += wj * wj;
        sw += wj;
        sxw += xj * wj;
        v[j] = wj;
    }
    return {rr, ww, sw, sxw};
}

struct PowerOut {
    bool bad;
    double sigma, residual;
    std::int64_t iterations;
};

template <class T>
PowerOut power_row(bool centre, const T* x, const T* g, double eps, bool frozen, const T* v0,
                   double tol, std::int64_t max_iter, double* v, index_t d) {
    const double inv_d = 1.0 / static_cast<double>(d);
    const auto [mu, ms] = row_stats(x, d, centre);
    const double sq = ms + eps;
    if (!(std::isfinite(mu) && good_scale(sq))) {
        return {true, kNaN, kNaN, 0};
    }
    const double inv = 1.0 / std::sqrt(sq);
    double vv = 0.0, sv = 0.0, sxv = 0.0;
    for (index_t i = 0; i < d; ++i) {
        const double t = static_cast<double>(v0[i]);
        v[i] = t;
        vv += t * t;
        sv += t;
        sxv += (static_cast<double>(x[i]) - mu) * inv * t;
    }
    if (!std::isfinite(vv)) {
        return {true, kNaN, kNaN, 0};
    }
    // LayerNorm with eps = 0 and d = 2 (full mode): J = 0 exactly; sigma 0, residual 0, 0 iterations
    if (centre && !frozen && eps == 0.0 && d == 2) {
        return {false, 0.0, 0.0, 0};
    }
    if (vv == 0.0) {
        return {false, 0.0, kInf, 0};
    }
    double alpha = 1.0 / std::sqrt(vv);
    double sigma = 0.0, res = kInf;
    std::int64_t k = 0;
    while (k < max_iter) {
        ++k;
        const double mv = centre ? alpha * sv * inv_d : 0.0;
        const double m2 = frozen ? 0.0 : alpha * sxv * inv_d;
        const PassB b = pass_b(x, g, v, mu, inv, alpha, mv, m2, d);
        const double mg = centre ? b.sg * inv_d : 0.0;
        const double m2g = frozen ? 0.0 : b.sxg * inv_d;
        const double rho = b.uu;
        const PassC c = pass_c(x, g, v, mu, inv, alpha, mv, m2, mg, m2g, rho, d);
        sigma = std::sqrt(rho);
        if (rho == 0.0) {
            res = kInf;
            break;
        }
        res = std::sqrt(c.rr) / rho;
        if (res <= tol || c.ww == 0.0) {  // J^T J v = 0 exactly: no next vector (not converged)
            break;
        }
        alpha = 1.0 / std::sqrt(c.ww);
        sv = c.sw, sxv = c.sxw;
    }
    return {false, sigma, res, k};
}

}  // namespace spectral_detail

// ---------------------------------------------------------------------------------------
// Exact sigma_max

/// Exact largest singular value of each token's LayerNorm Jacobian; out: (n,) double.
template <class T>
std::int64_t layer_norm_sigma_max(const T* x, const T* gamma, double eps, bool frozen, index_t n,
                                  index_t d, double* out) {
    using namespace spectral_detail;
    const Poles p = make_poles(gamma, d);
    const double ca = 1.0 / std::sqrt(static_cast<double>(d));
    // Frozen LayerNorm (and a constant row, whose Jacobian is the same) depends on gamma
    // alone: one solve per call.
    double lam_frozen;
    if (d == 2) {
        lam_frozen = p.mean_delta;
    } else {
        const Row<T> c{Cols::kLN1, nullptr, 0.0, ca, 0.0};
        lam_frozen = lambda_max(c, 0.0, 1.0, p, d);
    }
    return rows_with_scratch(
        n, 8 * d, [] { return 0; },
        [&](index_t row, int) {
            const T* xr = x + row * d;
            const auto [mu, var] = row_stats(xr, d, true);
            const double s2 = var + eps;
            if (!(std::isfinite(mu) && good_scale(s2))) {
                out[row] = kNaN;
                return true;
            }
            double lam;
            if (frozen || var == 0.0) {
                lam = lam_frozen;
            } else if (d == 2) {
                const double omc = eps / s2;  // 1 - c
                lam = omc * omc * p.mean_delta;
            } else {
                const double c = var / s2;
                const double cb = std::sqrt((2.0 - c) / (static_cast<double>(d) * s2));
                const double kb = (eps / s2) * (eps / s2);
                lam = lambda_max(Row<T>{Cols::kLN2, xr, mu, ca, cb}, 0.0, kb, p, d);
            }
            out[row] = std::sqrt(lam / s2);
            return false;
        });
}

/// Exact largest singular value of each token's RMSNorm Jacobian; out: (n,) double.
template <class T>
std::int64_t rms_norm_sigma_max(const T* x, const T* gamma, double eps, bool frozen, index_t n,
                                index_t d, double* out) {
    using namespace spectral_detail;
    const Poles p = make_poles(gamma, d);
    return rows_with_scratch(
        n, 8 * d, [] { return 0; },
        [&](index_t row, int) {
            const T* xr = x + row * d;
            const double ms = row_stats(xr, d, false).second;
            const double s2 = ms + eps;
            if (!good_scale(s2)) {
                out[row] = kNaN;
                return true;
            }
            double lam;
            if (frozen || ms == 0.0) {
                lam = p.top[0];
            } else {
                const double c = ms / s2;
                const double ca = std::sqrt((2.0 - c) / (static_cast<double>(d) * s2));
                const double ka = (eps / s2) * (eps / s2);
                lam = lambda_max(Row<T>{Cols::kRMS1, xr, 0.0, ca, 0.0}, ka, 1.0, p, d);
            }
            out[row] = std::sqrt(lam / s2);
            return false;
        });
}

// ---------------------------------------------------------------------------------------
// Power iteration

namespace spectral_detail {

template <class T>
std::int64_t power_iteration(bool centre, const T* x, const T* gamma, double eps, bool frozen,
                             const T* v0, double tol, std::int64_t max_iter, index_t n, index_t d,
                             double* sigma, double* residual, std::int64_t* iterations) {
    const index_t work = 2 * d + 4 * d * std::clamp<index_t>(max_iter, 1, 64);
    return rows_with_scratch(
        n, work, [d] { return std::vector<double>(static_cast<std::size_t>(d)); },
        [&](index_t row, std::vector<double>& v) {
            const PowerOut o = power_row(centre, x + row * d, gamma, eps, frozen, v0 + row * d,
                                         tol, max_iter, v.data(), d);
            sigma[row] = o.sigma;
            residual[row] = o.residual;
            iterations[row] = o.iterations;
            return o.bad;
        });
}

}  // namespace spectral_detail

/// Power iteration on J^T J per token of LayerNorm (see pyengine/_reference/spectral.py).
template <class T>
std::int64_t layer_norm_power_iteration(const T* x, const T* gamma, double eps, bool frozen,
                                        const T* v0, double tol, std::int64_t max_iter, index_t n,
                                        index_t d, double* sigma, double* residual,
                                        std::int64_t* iterations) {
    return spectral_detail::power_iteration(true, x, gamma, eps, frozen, v0, tol, max_iter, n, d,
                                            sigma, residual, iterations);
}

/// Power iteration on J^T J per token of RMSNorm.
template <class T>
std::int64_t rms_norm_power_iteration(const T* x, const T* gamma, double eps, bool frozen,
                                      const T* v0, double tol, std::int64_t max_iter, index_t n,
                                      index_t d, double* sigma, double* residual,
                                      std::int64_t* iterations) {
    return spectral_detail::power_iteration(false, x, gamma, eps, frozen, v0, tol, max_iter, n, d,
                                            sigma, residual, iterations);
}

}  // namespace pyengine
