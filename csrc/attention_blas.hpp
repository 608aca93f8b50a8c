// The attention backward kernels on head-sized problems as BLAS products: the
// per-head matrix products b = u v^T, s = q k^T, dp = d_o v^T, dv = p^T d_o, dq = g k and
// dk = g^T q are CBLAS gemms of NumPy's own OpenBLAS (the pointers of linear.hpp's
// LinearBlas, found at run time; each OpenMP thread calls it single-threaded through
// openblas_set_num_threads_local(1), as the linear kernels do), and the row epilogues (the
// advantage, p recomputed from lse, dL/ds, the spread) run on a block of kRows query rows
// while it is in cache. The contract is the one of attention.hpp, which keeps the
// register-blocked kernels for what this file does not serve (tiny heads such as the
// training step's d_k = 10, or BLAS not found / forced off by attention_force_fallback).
//
// Causal masks: the query rows are taken kRows at a time and a block's products stop at
// the last key its last row sees (nmax), so about (1 + kRows / T) / 2 of the full work is
// done; the masked entries inside a block are written as 0 before they enter a product.
//
// Parallelism and rounding: attention_score_grad shares the (head, row block) pairs among
// the threads, attention_backward the heads (a head's dk, dv gather every row block, so
// they accumulate in one thread, block by block in order). Which BLAS call computes a
// number depends on the shape alone, so the results do not depend on the thread count.
// attention_score_grad forms b in double for both dtypes (float inputs converted per
// block: the float32 result is the float64 one rounded once, as in attention.hpp);
// attention_backward computes in the input's type, with D_i = d_o_i . o_i and the spread
// in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_tiles.hpp"
#include "linear.hpp"
#include "parallel.hpp"

namespace pyengine {
namespace attention_blas_detail {

using attention_detail::scratch;
using attention_detail::sz;
using attention_detail::visible_keys;

// Query rows per block. Measured at (12, 128, 128), width 64, causal, one thread (min of 60,
// under load), 16 / 32 / 64 / 128 rows: the score gradient 0.66 / 0.52 / 0.64 / 0.74 ms, the
// float32 backward 1.70 / 1.48 / 1.58 / 1.88 ms, the float64 one 2.62 / 2.71 / 3.37 / 4.20.
inline constexpr index_t kRows = 32;
inline constexpr int kTrans = 112;

// Scratch slots of this file: after the 12 of attention.hpp's kernels.
inline constexpr int kSlot = 12;

// c (m, n; ldc) = alpha op(a) op(b) + beta c, row-major; op(x) = x^T when t is set.
template <class T>
void gemm(const LinearBlas& bl, bool ta, bool tb, index_t m, index_t n, index_t k, T alpha, const T* a,
          index_t lda, const T* b, index_t ldb, T beta, T* c, index_t ldc) {
    const int A = ta ? kTrans : kCblasNoTrans, B = tb ? kTrans : kCblasNoTrans;
    if (bl.ilp64) {
        if constexpr (std::is_same_v<T, float>) {
            reinterpret_cast<LinearBlas::sgemm64_t>(bl.sgemm)(kCblasRowMajor, A, B, m, n, k, alpha, a, lda, b, ldb,
                                                             beta, c, ldc);
        } else {
            reinterpret_cast<LinearBlas::dgemm64_t>(bl.dgemm)(kCblasRowMajor, A, B, m, n, k, alpha, a, lda, b, ldb,
                                                             beta, c, ldc);
        }
    } else {
        const auto i = [](index_t v) { return static_cast<int>(v); };
        if constexpr (std::is_same_v<T, float>) {
            reinterpret_cast<LinearBlas::sgemm32_t>(bl.sgemm)(kCblasRowMajor, A, B, i(m), i(n), i(k), alpha, a,
                                                             i(lda), b, i(ldb), beta, c, i(ldc));
        } else {
            reinterpret_cast<LinearBlas::dgemm32_t>(bl.dgemm)(kCblasRowMajor, A, B, i(m), i(n), i(k), alpha, a,
                                                             i(lda), b, i(ldb), beta, c, i(ldc));
        }
    }
}

// Runs body(task) for task in [0, tasks) in one parallel region of `threads` threads, each
// with single-threaded BLAS (linear.hpp's blas_region); returns the sum of what body returned.
template <class Body>
std::int64_t over_tasks(const LinearBlas& bl, index_t tasks, int threads, Body&& body) {
    return blas_region(bl, threads, [&]() -> std::int64_t {
        std::int64_t total = 0;
#pragma omp for schedule(dynamic, 1)
        for (index_t t = 0; t < tasks; ++t) total += body(t);
        return total;
    });
}

}  // namespace attention_blas_detail

/// Whether the BLAS kernels serve a head of widths (d_1, d_2) (the score gradient: dv twice)
/// with n heads of tq x tk: by the shape alone, never by the thread count.
inline bool attention_blas_serves(const LinearBlas& bl, index_t n, index_t tq, index_t tk, index_t d1,
                                  index_t d2, bool per_head) {
    if (!bl.ready() || tq <= 0 || tk <= 0 || std::min(d1, d2) < 16) return false;
    // The backward pass runs a head in one thread: few long heads stay on the fused kernel.
    return !per_head || n >= 4 || tq * tk <= 256 * 256;
}

/// attention_score_grad / attention_advantage of attention.hpp by BLAS (b in double).
template <class T>
std::int64_t attention_score_grad_blas(const LinearBlas& bl, const T* p, const T* u, const T* v, index_t offset,
                                       index_t n, index_t tq, index_t tk, index_t dv, T* out, T* adv) {
    using namespace attention_blas_detail;
    constexpr bool conv = !std::is_same_v<T, double>;
    const index_t blocks = (tq + kRows - 1) / kRows;
    const int threads = static_cast<int>(std::min<index_t>(threads_for(n * tq, tk * (dv + 1)), n * blocks));
    return over_tasks(bl, n * blocks, threads, [&](index_t task) -> std::int64_t {
        const index_t h = task / blocks, i0 = (task % blocks) * kRows, rows = std::min(kRows, tq - i0);
        const index_t nmax = visible_keys(i0 + rows - 1, offset, tk);
        double* b = scratch<double>(kSlot, kRows * tk);
        const double *ud, *vd;
        if constexpr (conv) {
            double* uc = scratch<double>(kSlot + 1, kRows * dv);
            double* vc = scratch<double>(kSlot + 2, tk * dv);
            const T* us = u + (h * tq + i0) * dv;
            const T* vs = v + h * tk * dv;
            for (index_t x = 0; x < rows * dv; ++x) uc[x] = static_cast<double>(us[x]);
            for (index_t x = 0; x < nmax * dv; ++x) vc[x] = static_cast<double>(vs[x]);
            ud = uc;
            vd = vc;
        } else {
            ud = u + (h * tq + i0) * dv;
            vd = v + h * tk * dv;
        }
        gemm<double>(bl, false, true, rows, nmax, dv, 1.0, ud, dv, vd, dv, 0.0, b, nmax);  // b = u v^T
        std::int64_t bad = 0;
        for (index_t r = 0; r < rows; ++r) {
            const index_t row = h * tq + i0 + r;
            const index_t vis = visible_keys(i0 + r, offset, tk);
            const T* pr = p + row * tk;
            const double* br = b + r * nmax;
            T* o = out + row * tk;
            T* a = adv ? adv + row * tk : nullptr;
            double c = 0.0;
#pragma omp simd reduction(+ : c)
            for (index_t j = 0; j < vis; ++j) c += static_cast<double>(pr[j]) * br[j];
            if (!std::isfinite(c)) {
                std::fill_n(o, tk, static_cast<T>(kNaN));
                if (a) std::fill_n(a, tk, static_cast<T>(kNaN));
                ++bad;
                continue;
            }
#pragma omp simd
            for (index_t j = 0; j < vis; ++j) o[j] = static_cast<T>(static_cast<double>(pr[j]) * (br[j] - c));
            std::fill(o + vis, o + tk, T(0));
            if (a) {
#pragma omp simd
                for (index_t j = 0; j < vis; ++j) a[j] = static_cast<T>(br[j] - c);
                std::fill(a + vis, a + tk, T(0));
            }
        }
        return bad;
    });
}

/// attention_backward of attention.hpp by BLAS: per head, per block of query rows,
/// s = q k^T and dp = d_o v^T (up to the block's last visible key), the epilogue
/// p = exp(scale s - lse), g = p (dp - D), then dq = scale g k, dk += scale g^T q and
/// dv += p^T d_o.
template <class T>
std::int64_t attention_backward_blas(const LinearBlas& bl, const T* q, const T* k, const T* v, const T* o,
                                     const T* d_o, const double* lse, index_t offset, double scale, index_t n,
                                     index_t tq, index_t tk, index_t dk, index_t dv, T* dq, T* dkey, T* dval,
                                     double* spread) {
    using namespace attention_blas_detail;
    using attention_detail::exp_c;
    using attention_detail::select_c;
    const T cs = static_cast<T>(scale);
    const int threads = static_cast<int>(std::min<index_t>(threads_for(n * tq, tk * (2 * dk + 2 * dv)), n));
    std::int64_t colbad = 0;
    const std::int64_t nbad = over_tasks(bl, n, threads, [&](index_t h) -> std::int64_t {
        T* sb = scratch<T>(kSlot, kRows * tk);      // s, then p
        T* gb = scratch<T>(kSlot + 1, kRows * tk);  // dp, then g
        const T *qh = q + h * tq * dk, *kh = k + h * tk * dk, *vh = v + h * tk * dv;
        const T *oh = o + h * tq * dv, *gh = d_o + h * tq * dv;
        T *dqh = dq + h * tq * dk, *dkh = dkey + h * tk * dk, *dvh = dval + h * tk * dv;
        std::fill(dkh, dkh + tk * dk, T(0));
        std::fill(dvh, dvh + tk * dv, T(0));
        std::int64_t bad = 0;
        for (index_t i0 = 0; i0 < tq; i0 += kRows) {
            const index_t rows = std::min(kRows, tq - i0);
            const index_t nmax = visible_keys(i0 + rows - 1, offset, tk);
            gemm<T>(bl, false, true, rows, nmax, dk, cs, qh + i0 * dk, dk, kh, dk, T(0), sb, nmax);  // scale s
            gemm<T>(bl, false, true, rows, nmax, dv, T(1), gh + i0 * dv, dv, vh, dv, T(0), gb, nmax);  // dp
            for (index_t r = 0; r < rows; ++r) {
                const index_t i = i0 + r;
                const index_t vis = visible_keys(i, offset, tk);
                double d = 0.0;  // D_i = d_o_i . o_i, in double also for float
                for (index_t c = 0; c < dv; ++c) {
                    d = attention_detail::madd(static_cast<double>(gh[i * dv + c]),
                                               static_cast<double>(oh[i * dv + c]), d);
                }
                const T dl = static_cast<T>(d), li = static_cast<T>(lse[h * tq + i]);
                T *s = sb + r * nmax, *g = gb + r * nmax;
                double sp = 0.0;
#pragma omp simd reduction(+ : sp)
                for (index_t j = 0; j < vis; ++j) {
                    // <= 0 up to rounding when lse is the forward pass's; clamped so p <= 1.
                    const T y = s[j] - li;
                    const T pv = exp_c(select_c(y > T(0), T(0), y));
                    const T ad = g[j] - dl;  // the advantage A_ij
                    const T gv = pv * ad;    // dL/ds_ij
                    s[j] = pv;
                    g[j] = gv;
                    sp += static_cast<double>(gv * ad);
                }
                std::fill(s + vis, s + nmax, T(0));
                std::fill(g + vis, g + nmax, T(0));
                spread[h * tq + i] = std::sqrt(sp);
                bad += (!std::isfinite(d) || !std::isfinite(sp)) ? 1 : 0;
            }
            gemm<T>(bl, true, false, nmax, dv, rows, T(1), sb, nmax, gh + i0 * dv, dv, T(1), dvh, dv);  // dv += p^T d_o
            gemm<T>(bl, false, false, rows, dk, nmax, cs, gb, nmax, kh, dk, T(0), dqh + i0 * dk, dk);  // dq
            gemm<T>(bl, true, false, nmax, dk, rows, cs, gb, nmax, qh + i0 * dk, dk, T(1), dkh, dk);  // dk += g^T q
            for (index_t r = 0; r < rows; ++r) {
                const T* dr = dqh + (i0 + r) * dk;
                bool rb = false;
                for (index_t c = 0; c < dk; ++c) rb = rb || !std::isfinite(dr[c]);
                if (rb && std::isfinite(spread[h * tq + i0 + r])) ++bad;  // not counted above
            }
        }
        bool cb = false;
        for (index_t x = 0; x < tk * dk; ++x) cb = cb || !std::isfinite(dkh[x]);
        for (index_t x = 0; x < tk * dv; ++x) cb = cb || !std::isfinite(dvh[x]);
        if (cb) {
#pragma omp atomic
            ++colbad;
        }
        return bad;
    });
    return nbad ? nbad : (colbad ? 1 : 0);
}

}  // namespace pyengine
