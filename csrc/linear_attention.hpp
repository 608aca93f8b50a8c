// The attention JVP's head products in one OpenMP region (kernel linear_attention_jvp, issue 18).
//
// For a block's base attention (queries q, keys k, values v, probabilities p, shared by
// every tangent) and K tangents of the projections dqkv, per tangent r and query head
// h = j*g + i (key/value head j):
//
//   dS  = scale * dQ_rh K_j^T                        (tq, tk)
//   dS[:, start:start+tq] += Q_h dK_rj^T              (the tangent moves the keys start..)
//   dP  = P_h * (dS - rowsum(P_h * dS))               (softmax JVP; masked entries have P = 0)
//   out_rh = dP V_j + P_h[:, start:start+tq] dV_rj    (tq, dh)
//
// with dQ_rh, dK_rj, dV_rj the head slices of dqkv[r] (tq, H + 2 Hkv, dh) and tk = start + tq
// (a causal span from start; start = 0: all rows). The tasks are (query head, chunk of
// tangents); each thread runs single-threaded BLAS (OpenBLAS's per-thread setting, like
// linear.hpp) on its task with a reused (chunk * tq, tk) score workspace, so no BLAS thread
// pool spins next to pyengine's threads, and dS is written and read in cache instead of as
// a (H, K, tq, tk) array streamed by separate passes. The chunking depends on the shapes
// only (never on the thread count). The row sums of the softmax JVP are accumulated in double.
// Returns the number of rows whose sum is not finite (NaN or Inf in dS or P), as softmax_jvp.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "linear.hpp"
#include "parallel.hpp"
#include "vmath.hpp"

namespace pyengine {

inline constexpr int kCblasTrans = 112;

namespace linear_detail {

// c (m, nn; ldc) = alpha * a (m, k; lda) @ op(b) + beta c, row-major; op(b) = b (k, nn; ldb) or
// b^T with b (nn, k; ldb).
template <class T>
void gemm_ab(const LinearBlas& bl, bool trans_b, index_t m, index_t nn, index_t k, T alpha, const T* a, index_t lda,
             const T* b, index_t ldb, T beta, T* c, index_t ldc) {
    const int tb = trans_b ? kCblasTrans : kCblasNoTrans;
    if (bl.ilp64) {
        if constexpr (std::is_same_v<T, float>) {
            reinterpret_cast<LinearBlas::sgemm64_t>(bl.sgemm)(kCblasRowMajor, kCblasNoTrans, tb, m, nn, k, alpha, a,
                                                             lda, b, ldb, beta, c, ldc);
        } else {
            reinterpret_cast<LinearBlas::dgemm64_t>(bl.dgemm)(kCblasRowMajor, kCblasNoTrans, tb, m, nn, k, alpha, a,
                                                             lda, b, ldb, beta, c, ldc);
        }
    } else {
        const auto i = [](index_t v) { return static_cast<int>(v); };
        if constexpr (std::is_same_v<T, float>) {
            reinterpret_cast<LinearBlas::sgemm32_t>(bl.sgemm)(kCblasRowMajor, kCblasNoTrans, tb, i(m), i(nn), i(k),
                                                             alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
        } else {
            reinterpret_cast<LinearBlas::dgemm32_t>(bl.dgemm)(kCblasRowMajor, kCblasNoTrans, tb, i(m), i(nn), i(k),
                                                             alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
        }
    }
}

// Tangents per task: about 512 score rows (chunk * tq), at least one.
inline index_t attention_chunk(index_t K, index_t tq) {
    return std::max<index_t>(1, std::min<index_t>(K, 512 / std::max<index_t>(1, tq)));
}

}  // namespace linear_detail

/// See the header comment. dqkv (K, tq, H + 2 Hkv, dh); q (Hkv, g, tq, dh); k, v (Hkv, tk, dh);
/// p (Hkv, g, tq, tk); out (K, tq, H, dh); all C-contiguous.
template <class T>
std::int64_t linear_attention_jvp(const LinearBlas& bl, const T* dqkv, const T* q, const T* k, const T* v,
                                  const T* p, index_t K, index_t tq, index_t tk, index_t H, index_t Hkv, index_t dh,
                                  index_t start, T scale, T* out) {
    using namespace linear_detail;
    const index_t g = H / Hkv, W = (H + 2 * Hkv) * dh, kc = attention_chunk(K, tq);
    const index_t chunks = (K + kc - 1) / kc, tasks = H * chunks;
    const double work = static_cast<double>(K) * H * tq * tk * dh;
    const int threads = work >= double(1 << 18) ? static_cast<int>(std::min<index_t>(g_num_threads, tasks)) : 1;
    return blas_region(bl, threads, [&]() -> std::int64_t {
        std::int64_t nbad = 0;
        std::vector<T> ws(static_cast<std::size_t>(kc * tq * tk));
        T* ds = ws.data();
#pragma omp for schedule(dynamic, 1)
        for (index_t task = 0; task < tasks; ++task) {
            const index_t h = task / chunks, r0 = (task % chunks) * kc, r1 = std::min(K, r0 + kc);
            const index_t j = h / g, rows = (r1 - r0) * tq;
            const T* qh = q + h * tq * dh;   // (tq, dh): (j, i) flattens to h
            const T* kj = k + j * tk * dh;   // (tk, dh)
            const T* vj = v + j * tk * dh;
            const T* ph = p + h * tq * tk;   // (tq, tk)
            // dS = scale dQ K^T over the chunk's tangents at once: dQ rows (r, t) are W apart.
            gemm_ab<T>(bl, true, rows, tk, dh, scale, dqkv + r0 * tq * W + h * dh, W, kj, dh, T(0), ds, tk);
            for (index_t r = r0; r < r1; ++r) {  // + Q dK_r^T on the key columns start..
                gemm_ab<T>(bl, true, tq, tq, dh, T(1), qh, dh, dqkv + r * tq * W + (H + j) * dh, W, T(1),
                           ds + (r - r0) * tq * tk + start, tk);
            }
            for (index_t row = 0; row < rows; ++row) {  // dP = P (dS - sum P dS), in place
                T* sr = ds + row * tk;
                const T* pr = ph + (row % tq) * tk;
                double s = 0.0;
#pragma omp simd reduction(+ : s)
                for (index_t c = 0; c < tk; ++c) s += static_cast<double>(pr[c]) * static_cast<double>(sr[c]);
                if (!std::isfinite(s)) ++nbad;
                const T st = static_cast<T>(s);
#pragma omp simd
                for (index_t c = 0; c < tk; ++c) sr[c] = pr[c] * (sr[c] - st);
            }
            // out rows (r, t) of head h are H dh apart: dP V for the chunk at once, then + P dV_r.
            T* oh = out + r0 * tq * H * dh + h * dh;
            gemm_ab<T>(bl, false, rows, dh, tk, T(1), ds, tk, vj, dh, T(0), oh, H * dh);
            for (index_t r = r0; r < r1; ++r) {
                gemm_ab<T>(bl, false, tq, dh, tq, T(1), ph + start, tk, dqkv + r * tq * W + (H + Hkv + j) * dh, W,
                           T(1), oh + (r - r0) * tq * H * dh, H * dh);
            }
        }
        return nbad;
    });
}

/// softmax(scale q k^T, visible keys j <= offset + t) v per sequence b and query head h, with
/// the keys and values of the first s positions shared by every sequence (the base's, for a
/// causal span from s) and those of the tq new rows from qkv itself:
/// qkv (B, tq, H + 2 Hkv, dh) [q | k | v heads, unscaled], kp, vp (Hkv, s, dh) (s may be 0),
/// out (B, tq, H, dh) (the layout of the output projection's input). Tasks are (b, h): the
/// scores (tq, s + tq) by two single-threaded gemms into a reused workspace, the row
/// softmax in place by the softmax kernel's rows (activations_detail::softmax_row: float32
/// terms by exp_neg_f of x - m formed in double, sums in double; a bad row becomes NaN),
/// then P V by two gemms; a task's result does not depend on B, the thread count or the
/// other sequences. Returns the rows whose maximum or sum is not finite (NaN or +Inf among
/// the visible scores, or none finite).
template <class T>
std::int64_t linear_attention_forward(const LinearBlas& bl, const T* qkv, const T* kp, const T* vp, index_t B,
                                      index_t tq, index_t s, index_t H, index_t Hkv, index_t dh, index_t offset,
                                      T scale, T* out) {
    using namespace linear_detail;
    const index_t g = H / Hkv, W = (H + 2 * Hkv) * dh, tk = s + tq, tasks = B * H;
    const double work = static_cast<double>(B) * H * tq * tk * dh;
    const int threads = work >= double(1 << 18) ? static_cast<int>(std::min<index_t>(g_num_threads, tasks)) : 1;
    return blas_region(bl, threads, [&]() -> std::int64_t {
        std::int64_t nbad = 0;
        std::vector<T> ws(static_cast<std::size_t>(tq * tk));
        std::vector<double> terms(static_cast<std::size_t>(tk));  // a float64 row's terms
        T* sc = ws.data();
#pragma omp for schedule(dynamic, 1)
        for (index_t task = 0; task < tasks; ++task) {
            const index_t b = task / H, h = task % H, j = h / g;
            const T* qb = qkv + b * tq * W;
            if (s > 0) gemm_ab<T>(bl, true, tq, s, dh, scale, qb + h * dh, W, kp + j * s * dh, dh, T(0), sc, tk);
            gemm_ab<T>(bl, true, tq, tq, dh, scale, qb + h * dh, W, qb + (H + j) * dh, W, T(0), sc + s, tk);
            for (index_t t = 0; t < tq; ++t) {  // the softmax kernel's rows, in place (NaN rows if bad)
                T* row = sc + t * tk;
                const index_t n = std::min(tk, std::max<index_t>(0, offset + t + 1));
                nbad += activations_detail::softmax_row<T>(row, n, tk, terms.data(), row);
            }
            T* ob = out + b * tq * H * dh + h * dh;
            if (s > 0) gemm_ab<T>(bl, false, tq, dh, s, T(1), sc, tk, vp + j * s * dh, dh, T(0), ob, H * dh);
            gemm_ab<T>(bl, false, tq, dh, tq, T(1), sc + s, tk, qb + (H + Hkv + j) * dh, W, s > 0 ? T(1) : T(0), ob,
                       H * dh);
        }
        return nbad;
    });
}

}  // namespace pyengine
