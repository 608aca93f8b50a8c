// Fused per-token Lanczos for sigma_max of the LayerNorm / RMSNorm Jacobians.
//
// A single algorithm, longer than ~400 lines by exception. The contract and the mathematics are
// those of pyengine/kernels/_numba/spectral_lanczos.py (its docstring, the specification,
// explains every step; the two are kept line for line alike):
//   x: (n, d) C-contiguous T; gamma: (d,) T; v0: (n, d) double (the generic solver's
//   start vectors); sigma, residual: (n,) double; iterations: (n,) int64. A bad row
//   (non-finite statistics, NaN/Inf in v0, zero scale) gets NaN outputs (0 iterations) and
//   is counted in the return value.
//
// Per token, in double: symmetric Lanczos on K^T K, K = s J = diag(gamma) P, P = I - 11^T/d
// - xh xh^T/d (LayerNorm; no 11^T/d for RMSNorm, no xh term frozen), with xh formed from the
// row scaled by a power of two (rows of 2^+-500 neither overflow nor underflow); full
// reorthogonalization (classical Gram-Schmidt, DGKS second pass) against the token's basis,
// which stays in the thread's cache; the top Ritz pair of the tridiagonal T by Sturm
// bisection and inverse iteration; the Ritz vector verified with one explicit product.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "parallel.hpp"
#include "rows.hpp"

namespace pyengine {
namespace lanczos_detail {

inline constexpr index_t kMaxBasis = 160;     // LANCZOS_NORM_MAX_BASIS in the Numba module
inline constexpr double kBreakdown = 1e-14;   // BREAKDOWN of linalg/_solvers.py
inline constexpr double kDgks = 0.7071067811865476;

inline double dot(const double* a, const double* b, index_t d) {
    index_t i = 0;
    double s = 0.0;
#ifdef __AVX__
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
    for (; i + 16 <= d; i += 16) {
        s0 += _mm256_loadu_pd(a + i) * _mm256_loadu_pd(b + i);
        s1 += _mm256_loadu_pd(a + i + 4) * _mm256_loadu_pd(b + i + 4);
        s2 += _mm256_loadu_pd(a + i + 8) * _mm256_loadu_pd(b + i + 8);
        s3 += _mm256_loadu_pd(a + i + 12) * _mm256_loadu_pd(b + i + 12);
    }
    for (; i + 4 <= d; i += 4) s0 += _mm256_loadu_pd(a + i) * _mm256_loadu_pd(b + i);
    s = sum_lanes((s0 + s1) + (s2 + s3));
#endif
    for (; i < d; ++i) s += a[i] * b[i];
    return s;
}

inline void axpy(double c, const double* q, double* w, index_t d) {
#pragma omp simd
    for (index_t i = 0; i < d; ++i) w[i] -= c * q[i];
}

// One token's operator: K v = g (P v), K^T u = P (g u).
struct Op {
    const double* xh;
    const double* g;
    const double* g2;
    index_t d;
    bool centre, full;
    // out = P v (out may be v).
    void proj(const double* v, double* out) const {
        double s1 = 0.0, s2 = 0.0;
        if (centre) s1 = dot_one(v);
        if (full) s2 = dot(xh, v, d);
        const double m1 = s1 / static_cast<double>(d), m2 = s2 / static_cast<double>(d);
#pragma omp simd
        for (index_t i = 0; i < d; ++i) out[i] = (v[i] - m1) - xh[i] * m2;
    }
    double dot_one(const double* v) const {
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
        index_t i = 0;
        for (; i + 4 <= d; i += 4) {
            s0 += v[i];
            s1 += v[i + 1];
            s2 += v[i + 2];
            s3 += v[i + 3];
        }
        for (; i < d; ++i) s0 += v[i];
        return (s0 + s1) + (s2 + s3);
    }
    // w = K^T K v = P G^2 P v.
    void ata(const double* v, double* w) const {
        proj(v, w);
#pragma omp simd
        for (index_t i = 0; i < d; ++i) w[i] *= g2[i];
        proj(w, w);
    }
};

// Number of eigenvalues of the tridiagonal (a, b) above x (Sturm count on T - x I).
inline index_t count_above(const double* a, const double* b, index_t m, double x, double pivmin) {
    index_t neg = 0;
    double q = a[0] - x;
    if (std::fabs(q) < pivmin) q = -pivmin;
    if (q < 0) ++neg;
    for (index_t i = 1; i < m; ++i) {
        q = (a[i] - x) - b[i - 1] * b[i - 1] / q;
        if (std::fabs(q) < pivmin) q = -pivmin;
        if (q < 0) ++neg;
    }
    return m - neg;
}

// Top eigenpair of the m x m tridiagonal (a diagonal, b off-diagonal): theta by bisection to
// a few ulps, z (unit, m) by two steps of inverse iteration; work: 4 m doubles.
inline double top_eigenpair(const double* a, const double* b, index_t m, double* z, double* work) {
    double lo = a[0], hi = a[0], tmax = 0.0;
    for (index_t i = 0; i < m; ++i) {
        const double r = (i > 0 ? std::fabs(b[i - 1]) : 0.0) + (i + 1 < m ? std::fabs(b[i]) : 0.0);
        lo = std::min(lo, a[i] - r);
        hi = std::max(hi, a[i] + r);
        tmax = std::max(tmax, std::fabs(a[i]) + r);
    }
    const double pivmin = std::max(tmax * DBL_EPSILON * DBL_EPSILON, DBL_MIN);
    for (int it = 0; it < 200 && hi - lo > 2.0 * DBL_EPSILON * std::max(std::fabs(lo), std::fabs(hi));
         ++it) {
        const double mid = 0.5 * (lo + hi);
        if (mid <= lo || mid >= hi) break;
        if (count_above(a, b, m, mid, pivmin) >= 1) lo = mid; else hi = mid;
    }
    const double theta = 0.5 * (lo + hi);
    if (m == 1) {
        z[0] = 1.0;
        return theta;
    }
    // Inverse iteration on T - theta I: Gaussian elimination with partial pivoting (dgtsv).
    double *dd = work, *du = work + m, *dl = work + 2 * m, *du2 = work + 3 * m;
    for (index_t i = 0; i < m; ++i) z[i] = 1.0;
    for (int rep = 0; rep < 2; ++rep) {
        for (index_t i = 0; i < m; ++i) {
            dd[i] = a[i] - theta;
            du[i] = i + 1 < m ? b[i] : 0.0;
            dl[i] = i + 1 < m ? b[i] : 0.0;
            du2[i] = 0.0;
        }
        for (index_t i = 0; i + 1 < m; ++i) {
            if (std::fabs(dd[i]) >= std::fabs(dl[i])) {
                if (dd[i] == 0.0) dd[i] = pivmin;
                const double f = dl[i] / dd[i];
                dd[i + 1] -= f * du[i];
                z[i + 1] -= f * z[i];
            } else {
                const double f = dd[i] / dl[i];
                dd[i] = dl[i];
                const double t = dd[i + 1];
                dd[i + 1] = du[i] - f * t;
                if (i + 2 < m) {
                    du2[i] = du[i + 1];
                    du[i + 1] = -f * du2[i];
                }
                du[i] = t;
                const double zt = z[i];
                z[i] = z[i + 1];
                z[i + 1] = zt - f * z[i + 1];
            }
        }
        if (dd[m - 1] == 0.0) dd[m - 1] = pivmin;
        z[m - 1] /= dd[m - 1];
        z[m - 2] = (z[m - 2] - du[m - 2] * z[m - 1]) / dd[m - 2];
        for (index_t i = m - 3; i >= 0; --i) {
            z[i] = (z[i] - du[i] * z[i + 1] - du2[i] * z[i + 2]) / dd[i];
        }
        double top = 0.0;
        for (index_t i = 0; i < m; ++i) top = std::max(top, std::fabs(z[i]));
        if (!(top > 0.0 && std::isfinite(top))) {  // cannot happen for finite T; be safe
            for (index_t i = 0; i < m; ++i) z[i] = i == 0 ? 1.0 : 0.0;
            return theta;
        }
        double nn = 0.0;
        for (index_t i = 0; i < m; ++i) {
            z[i] /= top;
            nn += z[i] * z[i];
        }
        const double inv = 1.0 / std::sqrt(nn);
        for (index_t i = 0; i < m; ++i) z[i] *= inv;
    }
    return theta;
}

// w -= Q Q^T w against rows 0..j-1 of Q, after the three-term step w -= h0 q_{j-1} + b q_{j-2}
// (h0 = q_{j-1} . w, b = beta_{j-2}): one classical Gram-Schmidt pass over the basis, and a
// second one where the norm dropped below DGKS_ETA of its value (cancellation). Returns the
// coefficient of q_{j-1} (alpha), all passes summed.
// h[i] = Q_i . w for rows 0..j-1: four rows per sweep over w (w in L1, each row of Q read once
// from L2); then w -= sum_i h[i] Q_i in column blocks of 16 held in registers.
inline void project_out(const double* Q, index_t j, double* w, double* h, index_t d) {
    index_t i = 0;
#ifdef __AVX__
    if (d % 4 == 0) {
        for (; i + 4 <= j; i += 4) {
            const double *q0 = Q + i * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
            __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
            for (index_t k = 0; k < d; k += 4) {
                const __m256d wk = _mm256_loadu_pd(w + k);
                a0 += _mm256_loadu_pd(q0 + k) * wk;
                a1 += _mm256_loadu_pd(q1 + k) * wk;
                a2 += _mm256_loadu_pd(q2 + k) * wk;
                a3 += _mm256_loadu_pd(q3 + k) * wk;
            }
            h[i] = sum_lanes(a0), h[i + 1] = sum_lanes(a1), h[i + 2] = sum_lanes(a2),
            h[i + 3] = sum_lanes(a3);
        }
    }
#endif
    for (; i < j; ++i) h[i] = dot(Q + i * d, w, d);
    index_t k = 0;
#ifdef __AVX__
    for (; k + 16 <= d; k += 16) {
        __m256d w0 = _mm256_loadu_pd(w + k), w1 = _mm256_loadu_pd(w + k + 4),
                w2 = _mm256_loadu_pd(w + k + 8), w3 = _mm256_loadu_pd(w + k + 12);
        for (index_t r = 0; r < j; ++r) {
            const double* q = Q + r * d + k;
            const __m256d c = _mm256_set1_pd(h[r]);
            w0 -= c * _mm256_loadu_pd(q);
            w1 -= c * _mm256_loadu_pd(q + 4);
            w2 -= c * _mm256_loadu_pd(q + 8);
            w3 -= c * _mm256_loadu_pd(q + 12);
        }
        _mm256_storeu_pd(w + k, w0), _mm256_storeu_pd(w + k + 4, w1);
        _mm256_storeu_pd(w + k + 8, w2), _mm256_storeu_pd(w + k + 12, w3);
    }
#endif
    for (; k < d; ++k) {
        double t = w[k];
        for (index_t r = 0; r < j; ++r) t -= h[r] * Q[r * d + k];
        w[k] = t;
    }
}

inline double orthogonalize(const double* Q, index_t j, double bprev, double* w, double* h,
                            index_t d) {
    const double* qa = Q + (j - 1) * d;
    double alpha = dot(qa, w, d);
    axpy(alpha, qa, w, d);
    if (j >= 2) axpy(bprev, Q + (j - 2) * d, w, d);
    for (int pass = 0; pass < 2; ++pass) {
        const double before = dot(w, w, d);
        project_out(Q, j, w, h, d);
        alpha += h[j - 1];
        if (!(dot(w, w, d) < kDgks * kDgks * before)) break;
    }
    return alpha;
}

// Ritz tests (an O(m) eigenpair each, but a long dependent chain) only when due: the first
// after kFirstTest products, then halfway to where the estimate's observed rate of decrease
// predicts tol, at most kTestGap products apart (the generic solver's schedule).
inline constexpr std::int64_t kFirstTest = 4;  // LANCZOS_FIRST_TEST
inline constexpr std::int64_t kTestGap = 8;    // LANCZOS_TEST_GAP

inline std::int64_t next_gap(double est, double last_est, std::int64_t since, double target) {
    const double rate = std::pow(est / last_est, 1.0 / static_cast<double>(std::max<std::int64_t>(since, 1)));
    const double steps = std::log(target / est) / std::log(rate);
    double gap = static_cast<double>(kTestGap);
    if (rate > 0.0 && rate < 1.0 && std::isfinite(steps)) gap = std::floor(steps / 2.0);
    return static_cast<std::int64_t>(std::clamp(gap, 1.0, static_cast<double>(kTestGap)));
}

struct Out {
    bool bad;
    double sigma, residual;
    std::int64_t iterations;
};

template <class T>
Out lanczos_row(bool centre, const T* x, const T* gamma, double eps, bool frozen, const double* v0,
                double tol, std::int64_t max_iter, index_t p, double* buf, index_t d) {
    double* Q = buf;                       // (p + 1) x d
    double* xh = Q + (p + 1) * d;          // d
    double* g = xh + d;                    // d
    double* g2 = g + d;                    // d
    double* w = g2 + d;                    // d
    double* y = w + d;                     // d
    double* u = y + d;                     // d
    double* al = u + d;                    // p
    double* be = al + p;                   // p
    double* z = be + p;                    // p
    double* h = z + p;                     // p + 1
    double* work = h + p + 1;              // 4 p
    const double inv_d = 1.0 / static_cast<double>(d);
    // -- row statistics of the row scaled by c = 2^-e (exact), eps by c^2 ------------------
    const double c = row_scale(x, d, eps);
    double mu = 0.0;
    if (centre) {
        for (index_t i = 0; i < d; ++i) mu += static_cast<double>(x[i]) * c;
        mu *= inv_d;
    }
    double ms = 0.0;
    for (index_t i = 0; i < d; ++i) {
        const double t = static_cast<double>(x[i]) * c - mu;
        ms += t * t;
    }
    const double sq = ms * inv_d + eps * c * c;
    if (!(std::isfinite(mu) && good_scale(sq))) return {true, kNaN, kNaN, 0};
    const double sc = std::sqrt(sq);
    const double inv_s = c / sc;  // 1/s of the unscaled row, sigma_J = sigma_K / s
    double gmax = 0.0;
    for (index_t i = 0; i < d; ++i) {
        xh[i] = (static_cast<double>(x[i]) * c - mu) / sc;
        g[i] = static_cast<double>(gamma[i]);
        g2[i] = g[i] * g[i];
        gmax = std::max(gmax, std::fabs(g[i]));
    }
    const Op op{xh, g, g2, d, centre, !frozen};
    // -- q0 = v0 / |v0| (divided by its largest entry first) --------------------------------
    double top = 0.0;
    bool finite = true;
    for (index_t i = 0; i < d; ++i) {
        const double a = std::fabs(v0[i]);
        finite = finite && std::isfinite(a);
        top = std::max(top, a);
    }
    if (!finite) return {true, kNaN, kNaN, 0};
    // LayerNorm with eps = 0 and d = 2 (full mode): J = 0 exactly; sigma 0, residual 0, 0 iterations
    if (centre && !frozen && eps == 0.0 && d == 2) return {false, 0.0, 0.0, 0};
    if (top == 0.0) return {false, 0.0, kInf, 0};
    for (index_t i = 0; i < d; ++i) Q[i] = v0[i] / top;
    const double qn = 1.0 / std::sqrt(dot(Q, Q, d));
    for (index_t i = 0; i < d; ++i) Q[i] *= qn;
    // -- the Ritz vector y: its explicit residual (one product) -----------------------------
    std::int64_t used = 0;
    auto verify = [&](double& sig) {  // returns the residual; y unit
        ++used;
#pragma omp simd
        for (index_t i = 0; i < d; ++i) u[i] = y[i];
        op.proj(u, u);
        for (index_t i = 0; i < d; ++i) u[i] *= g[i];  // u = K y
        double ut = 0.0;
        for (index_t i = 0; i < d; ++i) ut = std::max(ut, std::fabs(u[i]));
        double un = 0.0;
        if (ut > 0.0) {
            for (index_t i = 0; i < d; ++i) u[i] /= ut;
            un = std::sqrt(dot(u, u, d));
            for (index_t i = 0; i < d; ++i) u[i] = g[i] * (u[i] / un);  // G (u / |u|)
        }
        sig = un * ut;
        op.proj(u, u);  // K^T (K y / sigma)
        double rr = 0.0;
        for (index_t i = 0; i < d; ++i) {
            const double t = u[i] - sig * y[i];
            rr += t * t;
        }
        const double rn = std::sqrt(rr);
        if (sig > 0.0) return rn / sig;
        return (rn == 0.0 && gmax == 0.0) ? 0.0 : kInf;  // _relative_residual
    };
    if (max_iter <= 1) {  // no room for a step and its check: one power step
        for (index_t i = 0; i < d; ++i) y[i] = Q[i];
        double sig = 0.0;
        const double res = verify(sig);
        return {false, sig * inv_s, res, used};
    }
    double factor = 1.0, scale = 0.0;
    std::int64_t due = kFirstTest, last_at = 0;
    double last_est = kInf;
    index_t m = 0;  // Lanczos steps in this cycle (basis rows 0..m)
    while (true) {
        // -- one step: w = A q_m, orthogonalized; alpha_m, beta_m --------------------------
        op.ata(Q + m * d, w);
        ++used;
        const double alpha = orthogonalize(Q, m + 1, m > 0 ? be[m - 1] : 0.0, w, h, d);
        const double beta = std::sqrt(dot(w, w, d));
        scale = std::max(scale, std::max(std::fabs(alpha), beta));
        al[m] = alpha;
        be[m] = beta;
        ++m;
        const bool breakdown = beta <= kBreakdown * std::max(scale, 1e-300);
        if (!breakdown) {
            const double ib = 1.0 / beta;
            double* qn1 = Q + m * d;
#pragma omp simd
            for (index_t i = 0; i < d; ++i) qn1[i] = w[i] * ib;
        }
        const bool last = used + 1 >= max_iter;
        if (!(used >= due || breakdown || m == p || last)) continue;
        const double theta = top_eigenpair(al, be, m, z, work);
        const double fp = breakdown ? 0.0 : beta * std::fabs(z[m - 1]);
        const double est = theta > 0.0 ? fp / theta : (fp == 0.0 ? 0.0 : kInf);
        due = used + next_gap(est, last_est, used - last_at, tol * factor);
        last_est = est, last_at = used;
        if (!(est <= tol * factor || breakdown || m == p || last)) continue;
        // -- verify the Ritz vector y = Q z --------------------------------------------------
        for (index_t i = 0; i < d; ++i) y[i] = 0.0;
        for (index_t k = 0; k < m; ++k) {
            const double zk = z[k];
            const double* qk = Q + k * d;
#pragma omp simd
            for (index_t i = 0; i < d; ++i) y[i] += zk * qk[i];
        }
        const double yn = 1.0 / std::sqrt(dot(y, y, d));
        for (index_t i = 0; i < d; ++i) y[i] *= yn;
        double sig = 0.0;
        const double res = verify(sig);
        if (res <= tol || breakdown || last || used + 2 > max_iter) {
            return {false, sig * inv_s, res, used};
        }
        factor *= 0.1;  // the estimate was optimistic: ask more of it next time
        if (m == p) {   // basis full: restart from the Ritz vector
            for (index_t i = 0; i < d; ++i) Q[i] = y[i];
            m = 0;
        }
    }
}

inline index_t basis_size(index_t d, std::int64_t max_iter) {
    return std::max<index_t>(1, std::min<index_t>({d, static_cast<index_t>(std::min<std::int64_t>(max_iter, kMaxBasis)), kMaxBasis}));
}

template <class T>
std::int64_t lanczos(bool centre, const T* x, const T* gamma, double eps, bool frozen,
                     const double* v0, double tol, std::int64_t max_iter, index_t n, index_t d,
                     double* sigma, double* residual, std::int64_t* iterations) {
    const index_t p = basis_size(d, max_iter);
    const auto size = static_cast<std::size_t>((p + 1) * d + 6 * d + 8 * p + 1);
    const index_t work = (p + 1) * d * 8;
    return rows_with_scratch(
        n, work, [size] { return std::vector<double>(size); },
        [&](index_t row, std::vector<double>& buf) {
            const Out o = lanczos_row(centre, x + row * d, gamma, eps, frozen, v0 + row * d, tol,
                                      max_iter, p, buf.data(), d);
            sigma[row] = o.sigma;
            residual[row] = o.residual;
            iterations[row] = o.iterations;
            return o.bad;
        });
}

}  // namespace lanczos_detail

/// Fused Lanczos on J^T J per LayerNorm token (see pyengine/kernels/_numba/spectral_lanczos.py).
template <class T>
std::int64_t layer_norm_lanczos(const T* x, const T* gamma, double eps, bool frozen, const double* v0,
                                double tol, std::int64_t max_iter, index_t n, index_t d,
                                double* sigma, double* residual, std::int64_t* iterations) {
    return lanczos_detail::lanczos(true, x, gamma, eps, frozen, v0, tol, max_iter, n, d, sigma,
                                   residual, iterations);
}

/// Fused Lanczos on J^T J per RMSNorm token.
template <class T>
std::int64_t rms_norm_lanczos(const T* x, const T* gamma, double eps, bool frozen, const double* v0,
                              double tol, std::int64_t max_iter, index_t n, index_t d,
                              double* sigma, double* residual, std::int64_t* iterations) {
    return lanczos_detail::lanczos(false, x, gamma, eps, frozen, v0, tol, max_iter, n, d, sigma,
                                   residual, iterations);
}

}  // namespace pyengine
