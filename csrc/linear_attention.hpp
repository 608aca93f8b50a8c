// The attention JVP's head products in one OpenMP region (kernel linear_attention_jvp).
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
//
// Row blocks (tq > kRowBlock): the products then run per tangent
// and block of kRowBlock query rows, over the first kv keys only, kv = 1 + the last key with
// P != 0 in some row of the block (keys_with_weight: for causal rows, start + the block's end).
// The keys after kv have P = 0 in every row of the block, so they add exact zeros to dP V
// and P dV, and to the row sums of the softmax JVP: for finite inputs the result is the
// formula above. The key operands are transposed once (K_j^T per call, dK_r^T per tangent
// and head), so every product is a plain gemm (no transposing copy per call). A NaN or Inf
// in a key the block cannot see (a tangent's dK or dV row after the block's rows) does not
// reach the block's rows through 0 * Inf: each row depends on the keys it sees only.
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

// Query rows per block of the blocked paths (tq > kRowBlock): each block multiplies only
// the keys its rows can see; 16 rows was the fastest block size measured (docs/design.md).
inline constexpr index_t kRowBlock = 16;

// 1 + the last column of a row block of p (rows [t0, t1) of (tq, tk), row stride tk) that
// is not exactly 0 (NaN counts as not 0): the keys the block's rows can see. Columns after
// it have P = 0 in every row, so they add exact zeros to the JVP and can be skipped.
template <class T>
index_t keys_with_weight(const T* p, index_t tk, index_t t0, index_t t1) {
    index_t kv = 0;
    for (index_t t = t0; t < t1; ++t) {
        const T* pr = p + t * tk;
        index_t c = tk;
        while (c > kv && pr[c - 1] == T(0)) --c;
        kv = std::max(kv, c);
    }
    return kv;
}

// dst (dh, n; row stride ldd) = the transpose of the n rows (dh values each, row stride lds)
// at src: the key operands of the blocked paths, so that their products are plain gemms.
// In blocks of 8 rows: each of their dh columns is one contiguous 8-wide store (GCC turns
// the block into vector shuffles). The row-by-row loop stored every element to another
// cache line and was the hottest line of the span job outside the gemms (0.8 % of it).
template <class T>
void transpose_rows(const T* src, index_t lds, index_t n, index_t dh, T* dst, index_t ldd) {
    constexpr index_t B = 8;
    index_t c0 = 0;
    for (; c0 + B <= n; c0 += B) {
        for (index_t e = 0; e < dh; ++e) {
#pragma omp simd
            for (index_t c = c0; c < c0 + B; ++c) dst[e * ldd + c] = src[c * lds + e];
        }
    }
    for (index_t c = c0; c < n; ++c) {
        for (index_t e = 0; e < dh; ++e) dst[e * ldd + c] = src[c * lds + e];
    }
}

// One row of the softmax JVP in place: sr[c] = p[c] (sr[c] - sum_c p[c] sr[c]) over the first
// ncols columns, the sum in double; returns whether the sum is not finite.
template <class T>
bool softmax_jvp_row(T* sr, const T* pr, index_t ncols) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (index_t c = 0; c < ncols; ++c) s += static_cast<double>(pr[c]) * static_cast<double>(sr[c]);
    const T st = static_cast<T>(s);
#pragma omp simd
    for (index_t c = 0; c < ncols; ++c) sr[c] = pr[c] * (sr[c] - st);
    return !std::isfinite(s);
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
    // Blocked path: the keys each block of query rows sees (vis, per head and block), and K_j^T
    // (Hkv, dh, tk) so that every product is a plain (no-transpose) gemm.
    const index_t RB = kRowBlock;
    const bool blocked = tq > RB;
    const index_t nblk = blocked ? (tq + RB - 1) / RB : 0;
    std::vector<index_t> vis(static_cast<std::size_t>(H * nblk));
    std::vector<T> kt(static_cast<std::size_t>(blocked ? Hkv * dh * tk : 0));
    for (index_t h = 0; h < H && blocked; ++h) {
        for (index_t b = 0; b < nblk; ++b) vis[h * nblk + b] = keys_with_weight(p + h * tq * tk, tk, b * RB,
                                                                                std::min(tq, (b + 1) * RB));
    }
    for (index_t j = 0; j < Hkv && blocked; ++j) {
        transpose_rows(k + j * tk * dh, dh, tk, dh, kt.data() + j * dh * tk, tk);
    }
    return blas_region(bl, threads, [&]() -> std::int64_t {
        std::int64_t nbad = 0;
        std::vector<T> ws(static_cast<std::size_t>(kc * tq * tk));
        std::vector<T> dkt(static_cast<std::size_t>(blocked ? dh * tq : 0));  // dK_r^T (dh, tq)
        T* ds = ws.data();
#pragma omp for schedule(dynamic, 1)
        for (index_t task = 0; task < tasks; ++task) {
            const index_t h = task / chunks, r0 = (task % chunks) * kc, r1 = std::min(K, r0 + kc);
            const index_t j = h / g, rows = (r1 - r0) * tq;
            const T* qh = q + h * tq * dh;   // (tq, dh): (j, i) flattens to h
            const T* kj = k + j * tk * dh;   // (tk, dh)
            const T* vj = v + j * tk * dh;
            const T* ph = p + h * tq * tk;   // (tq, tk)
            if (blocked) {  // per tangent and block of RB query rows, over the kv keys the block sees
                const index_t* vh = vis.data() + h * nblk;
                const index_t kn_all = std::min(tq, *std::max_element(vh, vh + nblk) - start);
                const T* ktj = kt.data() + j * dh * tk;
                for (index_t r = r0; r < r1; ++r) {
                    const T* dr = dqkv + r * tq * W;
                    transpose_rows(dr + (H + j) * dh, W, kn_all, dh, dkt.data(), tq);  // n <= 0: none
                    for (index_t b = 0; b < nblk; ++b) {
                        const index_t t0 = b * RB, nb = std::min(RB, tq - t0), kv = vh[b];
                        const index_t kn = std::min(kv - start, tq);  // of them new keys (moved by the tangent)
                        T* ob = out + (r * tq + t0) * H * dh + h * dh;
                        if (kv == 0) {  // P = 0 on the whole block: so is its tangent
                            for (index_t t = 0; t < nb; ++t) std::fill(ob + t * H * dh, ob + t * H * dh + dh, T(0));
                            continue;
                        }
                        gemm_ab<T>(bl, false, nb, kv, dh, scale, dr + t0 * W + h * dh, W, ktj, tk, T(0), ds, tk);
                        if (kn > 0) {
                            gemm_ab<T>(bl, false, nb, kn, dh, T(1), qh + t0 * dh, dh, dkt.data(), tq, T(1), ds + start,
                                       tk);
                        }
                        for (index_t row = 0; row < nb; ++row) {
                            nbad += softmax_jvp_row(ds + row * tk, ph + (t0 + row) * tk, kv);
                        }
                        gemm_ab<T>(bl, false, nb, dh, kv, T(1), ds, tk, vj, dh, T(0), ob, H * dh);
                        if (kn > 0) {
                            gemm_ab<T>(bl, false, nb, dh, kn, T(1), ph + t0 * tk + start, tk, dr + (H + Hkv + j) * dh,
                                       W, T(1), ob, H * dh);
                        }
                    }
                }
                continue;
            }
            // dS = scale dQ K^T over the chunk's tangents at once: dQ rows (r, t) are W apart.
            gemm_ab<T>(bl, true, rows, tk, dh, scale, dqkv + r0 * tq * W + h * dh, W, kj, dh, T(0), ds, tk);
            for (index_t r = r0; r < r1; ++r) {  // + Q dK_r^T on the key columns start..
                gemm_ab<T>(bl, true, tq, tq, dh, T(1), qh, dh, dqkv + r * tq * W + (H + j) * dh, W, T(1),
                           ds + (r - r0) * tq * tk + start, tk);
            }
            for (index_t row = 0; row < rows; ++row) {  // dP = P (dS - sum P dS), in place
                nbad += softmax_jvp_row(ds + row * tk, ph + (row % tq) * tk, tk);
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
/// other sequences. With causal rows (the first kRowBlock rows see fewer than s + tq keys) and
/// tq > kRowBlock, each block of kRowBlock rows multiplies only the keys it sees (offset + the
/// block's end), against keys transposed once (the past keys per call, a sequence's new keys
/// per task), which is faster than whole rows (docs/design.md). Returns the
/// rows whose maximum or sum is not finite (NaN or +Inf among the visible scores, or none finite).
template <class T>
std::int64_t linear_attention_forward(const LinearBlas& bl, const T* qkv, const T* kp, const T* vp, index_t B,
                                      index_t tq, index_t s, index_t H, index_t Hkv, index_t dh, index_t offset,
                                      T scale, T* out) {
    using namespace linear_detail;
    const index_t g = H / Hkv, W = (H + 2 * Hkv) * dh, tk = s + tq, tasks = B * H;
    const double work = static_cast<double>(B) * H * tq * tk * dh;
    const int threads = work >= double(1 << 18) ? static_cast<int>(std::min<index_t>(g_num_threads, tasks)) : 1;
    // Blocked path (causal rows: the first block of kRowBlock rows sees fewer than tk keys):
    // each block of query rows multiplies only the keys it sees, the key operands transposed
    // (past keys once, a sequence's new keys once per task) so that every product is a plain gemm.
    const index_t RB = kRowBlock;
    const bool blocked = tq > RB && offset + RB < tk;
    std::vector<T> kpt(static_cast<std::size_t>(blocked ? Hkv * dh * s : 0));  // (Hkv, dh, s)
    for (index_t jj = 0; jj < Hkv && blocked; ++jj) {
        transpose_rows(kp + jj * s * dh, dh, s, dh, kpt.data() + jj * dh * s, s);
    }
    return blas_region(bl, threads, [&]() -> std::int64_t {
        std::int64_t nbad = 0;
        std::vector<T> ws(static_cast<std::size_t>(tq * tk));
        std::vector<double> terms(static_cast<std::size_t>(tk));  // a float64 row's terms
        std::vector<T> knt(static_cast<std::size_t>(blocked ? dh * tq : 0));  // new keys^T (dh, tq)
        T* sc = ws.data();
#pragma omp for schedule(dynamic, 1)
        for (index_t task = 0; task < tasks; ++task) {
            const index_t b = task / H, h = task % H, j = h / g;
            const T* qb = qkv + b * tq * W;
            if (blocked) {
                const index_t nk = std::min(tq, offset + tq - s);  // new keys any row sees (n <= 0: none)
                transpose_rows(qb + (H + j) * dh, W, nk, dh, knt.data(), tq);
                for (index_t t0 = 0; t0 < tq; t0 += RB) {
                    const index_t nb = std::min(RB, tq - t0), kv = std::min(tk, std::max<index_t>(0, offset + t0 + nb));
                    const index_t kpast = std::min(s, kv), knew = kv - kpast;
                    T* ob = out + (b * tq + t0) * H * dh + h * dh;
                    const T* qr = qb + t0 * W + h * dh;
                    if (kpast > 0) {
                        gemm_ab<T>(bl, false, nb, kpast, dh, scale, qr, W, kpt.data() + j * dh * s, s, T(0), sc, tk);
                    }
                    if (knew > 0) gemm_ab<T>(bl, false, nb, knew, dh, scale, qr, W, knt.data(), tq, T(0), sc + s, tk);
                    for (index_t t = t0; t < t0 + nb; ++t) {
                        T* row = sc + (t - t0) * tk;
                        const index_t n = std::min(kv, std::max<index_t>(0, offset + t + 1));
                        nbad += activations_detail::softmax_row<T>(row, n, kv, terms.data(), row);
                    }
                    if (kpast > 0) {
                        gemm_ab<T>(bl, false, nb, dh, kpast, T(1), sc, tk, vp + j * s * dh, dh, T(0), ob, H * dh);
                    }
                    if (knew > 0) {
                        gemm_ab<T>(bl, false, nb, dh, knew, T(1), sc + s, tk, qb + (H + Hkv + j) * dh, W,
                                   kpast > 0 ? T(1) : T(0), ob, H * dh);
                    }
                }
                continue;
            }
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
