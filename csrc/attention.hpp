// Attention backward kernels and the fused, row-streaming attention head.
//
// Pure C++17 on raw pointers, templated on T (float or double); the kernel contract and
// the formulas are those of pyengine/kernels/_reference/attention.py, which these kernels
// match to rounding:
//   attention_score_grad:  p (n, tq, tk), u (n, tq, dv), v (n, tk, dv) -> out (n, tq, tk)
//                          = p * (b - sum_j p b), b = u v^T, and optionally the advantage
//                          b - sum_j p b (n, tq, tk) from the same b;
//   attention_forward:     q (n, tq, dk), k (n, tk, dk), v (n, tk, dv) -> out (n, tq, dv),
//                          lse and entropy (n, tq) double;
//   attention_backward:    q, k, v, o (n, tq, dv), d_o (n, tq, dv), lse -> dq, dk, dv,
//                          spread (n, tq).
// Key j is visible to query i when j <= i + offset; masked inputs are never read, masked
// outputs are 0. Every kernel returns the number of bad rows (non-finite row sums).
// On heads of width >= 16 the bindings call the BLAS versions of attention_score_grad and
// attention_backward instead (attention_blas.hpp); these register-blocked kernels serve
// narrow heads (the training step's d_k = 10) and run when BLAS is not found or forced off.
//
// Numerics: the fused head computes in the input's type C (double for float64, float for
// float32: 8-wide AVX lanes and a float exp, about 2x the throughput), with the row sums
// that gather T terms in double (the softmax's z and sum p s, D_i = d_o_i . o_i, the sum of
// the chunks' partials) and lse, entropy and spread returned in double; float64 is
// computed exactly as before. attention_score_grad computes in double for both. The fused
// head never stores a (tq, tk) matrix: a row (or column) of scores lives in a thread's
// scratch of length tk (tq). Scratch is per thread and kept across calls (scratch() in
// attention_tiles.hpp): a training loop allocates nothing in the kernels.
//
// Layout and vectorization (the tile helpers are in attention_tiles.hpp): per head, k, v
// (and for the backward q, d_o) are transposed into (features, tokens) scratch of C shared
// by the threads. Queries are taken kTile at
// a time (a tile): the tile's scores s_rj = sum_c q_rc kt[c][j] come from dot_rows, which
// keeps 4 rows x 8 keys in registers and reads each transposed key once for the 4 rows,
// and its weighted sums over keys (o_rc = sum_j p_rj vt[c][j]) from weighted_sums, in a
// fixed order. A one-row version was bound by re-reading the 400 KB of transposed keys and
// values from L2 for every query (12 ms for the forward pass at T = 2000).
//
// Parallelism: one OpenMP region per call. The forward pass shares out heads or (head,
// tile) pairs, each thread transposing the heads it reaches into its own scratch; the
// other passes, per head, first transpose (omp for over tokens), then share the tiles
// round-robin (causal tiles have unequal work, so contiguous blocks would leave one thread
// the long rows). Results do not depend on the number of threads. In the forward pass each
// tile of queries is computed whole by one thread in a fixed order. The backward pass is one pass over the visible (query, key)
// pairs: the row sums D_i = sum_j p_ij dp_ij are d_o_i . o_i (o from the forward pass), so
// each tile of keys computes its scores, p (from lse), dp and g = dL/ds once, and from them
// its dk, dv whole and its share of dq and of the spread. Those shares go into a partial
// per chunk of key tiles; the chunks (at most kChunks, of about equal work) are fixed by
// the shape alone, and their partials are summed in chunk order, so no two threads write
// one number and no sum depends on the thread count. (The previous version made a row
// pass and a column pass, each recomputing p and dp: 85 multiply-adds and 2 exp per pair
// against 60 and 1 now.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "activations.hpp"
#include "attention_tiles.hpp"
#include "parallel.hpp"

namespace pyengine {

/// dL/ds = p * (b - sum_j p b), b = u v^T, into out; the advantage b - sum_j p b into adv
/// if adv is not null. Returns the number of rows whose sum is not finite.
template <class T>
std::int64_t attention_score_grad(const T* p, const T* u, const T* v, index_t offset, index_t n,
                                  index_t tq, index_t tk, index_t dv, T* out, T* adv) {
    using namespace attention_detail;
    double* vt = scratch<double>(0, dv * tk);  // one head's v^T, shared (the caller's slot)
    const index_t tiles = (tq + kTile - 1) / kTile;
    std::int64_t nbad = 0;
#pragma omp parallel num_threads(threads_for(n * tq, tk * (dv + 1))) reduction(+ : nbad)
    {
        double* bt = scratch<double>(1, kTile * tk);
        double* ut = scratch<double>(2, kTile * dv);
        for (index_t h = 0; h < n; ++h) {
            transpose_into(v + h * tk * dv, tk, dv, vt);  // ends in a barrier
#pragma omp for schedule(static, 1)
            for (index_t t = 0; t < tiles; ++t) {
                const index_t i0 = t * kTile;
                const index_t real = load_tile(u + h * tq * dv, i0, tq, dv, ut);
                const index_t nmax = visible_keys(i0 + real - 1, offset, tk);
                dot_rows(ut, vt, dv, tk, nmax, bt, tk);  // b, formed once
                for (index_t r = 0; r < real; ++r) {
                    const index_t row = h * tq + i0 + r;
                    const index_t vis = visible_keys(i0 + r, offset, tk);
                    const T* pr = p + row * tk;
                    const double* b = bt + r * tk;
                    T* o = out + row * tk;
                    T* a = adv ? adv + row * tk : nullptr;
                    double c = 0.0;
#pragma omp simd reduction(+ : c)
                    for (index_t j = 0; j < vis; ++j) {
                        c += static_cast<double>(pr[j]) * b[j];
                    }
                    if (!std::isfinite(c)) {
                        std::fill_n(o, tk, static_cast<T>(kNaN));
                        if (a) std::fill_n(a, tk, static_cast<T>(kNaN));
                        ++nbad;
                        continue;
                    }
#pragma omp simd
                    for (index_t j = 0; j < vis; ++j) {
                        o[j] = static_cast<T>(static_cast<double>(pr[j]) * (b[j] - c));
                    }
                    std::fill(o + vis, o + tk, T(0));
                    if (a) {
#pragma omp simd
                        for (index_t j = 0; j < vis; ++j) {
                            a[j] = static_cast<T>(b[j] - c);
                        }
                        std::fill(a + vis, a + tk, T(0));
                    }
                }
            }  // implicit barrier: vt is reused by the next head
        }
    }
    return nbad;
}

/// The fused forward pass of one head per batch index: out = softmax(scale q k^T) v, and
/// the row log-partition lse and entropy. Returns the number of bad rows.
///
/// The threads share out whole heads (at least as many heads as threads), else single
/// (head, tile) pairs, one unit at a time (dynamic); each thread transposes a head's k, v
/// into its own scratch when it reaches a head other than the one it holds, so there is no
/// barrier per head (two barriers per head dominated short heads; docs/design.md). Whole
/// heads keep a head's transposes to one thread ((12, 128, 128, 64) as single tiles: 25 %
/// slower). Each tile is computed
/// the same way by one thread, so the results do not depend on the number of threads.
template <class T>
std::int64_t attention_forward(const T* q, const T* k, const T* v, index_t offset, double scale,
                               index_t n, index_t tq, index_t tk, index_t dk, index_t dv, T* out,
                               double* lse, double* entropy) {
    using namespace attention_detail;
    using C = T;  // the compute type (see the header comment)
    const C cscale = static_cast<C>(scale);
    const index_t tiles = (tq + kTile - 1) / kTile;
    const int threads = threads_for(n * tq, tk * (dk + dv));
    // Units of work: whole heads when there are at least as many as threads, else single tiles.
    const bool by_head = n >= static_cast<index_t>(threads);
    const index_t units = by_head ? n : n * tiles;
    std::int64_t nbad = 0;
    // One tile of queries of head h against the transposed keys kt and values vt.
    auto tile = [&](index_t h, index_t t, const C* kt, const C* vt, C* st, C* et, C* qt, C* ot) -> std::int64_t {
        std::int64_t bad_rows = 0;
        const index_t i0 = t * kTile;
        const index_t real = load_tile(q + h * tq * dk, i0, tq, dk, qt);
        const index_t nmax = visible_keys(i0 + real - 1, offset, tk);
        dot_rows(qt, kt, dk, tk, nmax, st, tk);
        C inv[kTile] = {};
        double stat[kTile][2] = {};
        for (index_t r = 0; r < kTile; ++r) {
            const index_t vis = r < real ? visible_keys(i0 + r, offset, tk) : 0;
            C* s = st + r * tk;
            C* e = et + r * tk;
            const C m = scale_max(s, vis, cscale);
            double z = 0.0, zs = 0.0;  // in double also for float: T terms
#pragma omp simd reduction(+ : z, zs)
            for (index_t j = 0; j < vis; ++j) {
                const C x = exp_c(static_cast<C>(s[j] - m));
                e[j] = x;
                z += static_cast<double>(x);
                zs += static_cast<double>(x * s[j]);
            }
            std::fill(e + vis, e + nmax, C(0));  // masked (and padding rows): weight 0
            inv[r] = r < real ? static_cast<C>(1.0 / z) : C(0);
            stat[r][0] = static_cast<double>(m) + std::log(z);
            stat[r][1] = stat[r][0] - zs / z;
        }
        weighted_sums(et, tk, vt, dv, tk, nmax, inv, ot);
        for (index_t r = 0; r < real; ++r) {
            const index_t row = h * tq + i0 + r;
            lse[row] = stat[r][0];
            entropy[row] = stat[r][1];
            bool bad = !std::isfinite(stat[r][0]) || !std::isfinite(stat[r][1]);
            for (index_t c = 0; c < dv; ++c) {
                const C o = ot[sz(r * dv + c)];
                out[row * dv + c] = static_cast<T>(o);
                bad = bad || !std::isfinite(o);
            }
            bad_rows += bad ? 1 : 0;
        }
        return bad_rows;
    };
#pragma omp parallel num_threads(threads) reduction(+ : nbad)
    {
        C* st = scratch<C>(2, kTile * tk);
        C* et = scratch<C>(3, kTile * tk);
        C* qt = scratch<C>(4, kTile * dk);
        C* ot = scratch<C>(5, kTile * dv);
        C* kt = scratch<C>(6, dk * tk);
        C* vt = scratch<C>(7, dv * tk);
        index_t have = -1;  // the head whose k, v this thread's kt, vt hold
#pragma omp for schedule(dynamic, 1)
        for (index_t unit = 0; unit < units; ++unit) {
            const index_t h = by_head ? unit : unit / tiles;
            if (h != have) {
                const T* kh = k + h * tk * dk;
                const T* vh = v + h * tk * dv;
                for (index_t r = 0; r < tk; ++r) {
                    for (index_t c = 0; c < dk; ++c) kt[c * tk + r] = static_cast<C>(kh[r * dk + c]);
                    for (index_t c = 0; c < dv; ++c) vt[c * tk + r] = static_cast<C>(vh[r * dv + c]);
                }
                have = h;
            }
            const index_t t0 = by_head ? 0 : unit - h * tiles;
            const index_t t1 = by_head ? tiles : t0 + 1;
            for (index_t t = t0; t < t1; ++t) nbad += tile(h, t, kt, vt, st, et, qt, ot);
        }
    }
    return nbad;
}

/// The fused backward pass, one pass over the visible (query, key) pairs: dq, dk, dv from
/// d_o = dL/do and the forward pass's o and lse (p recomputed from lse, the row sums
/// D_i = sum_j p_ij dp_ij = d_o_i . o_i taken from o), and the row statistic
/// spread = sqrt(sum_j p A^2). Returns the number of bad rows.
template <class T>
std::int64_t attention_backward(const T* q, const T* k, const T* v, const T* o, const T* d_o,
                                const double* lse, index_t offset, double scale, index_t n,
                                index_t tq, index_t tk, index_t dk, index_t dv, T* dq, T* dkey,
                                T* dval, double* spread) {
    using namespace attention_detail;
    using C = T;  // the compute type (see the header comment)
    constexpr index_t kSumRows = 256;  // rows per block of the partials' sum
    const index_t tiles = (tk + kTile - 1) / kTile;
    const index_t nchunks = std::min(tiles, kChunks);
    const index_t prow = dk + 1;  // a chunk's partial: dk rows of dq^T, then the spread row
    // Shared, in the caller's slots: q^T, d_o^T, D_i and lse_i in C, the chunks' partials.
    C* qt = scratch<C>(0, dk * tq);
    C* gt = scratch<C>(1, dv * tq);
    C* delta = scratch<C>(2, tq);
    C* lsec = scratch<C>(3, tq);
    C* part = scratch<C>(4, nchunks * prow * tq);
    std::vector<index_t> bounds(sz(nchunks + 1)), firstq(sz(nchunks + 1));
    chunk_tiles(tq, tk, offset, nchunks, bounds.data(), firstq.data());
    const C cs = static_cast<C>(scale);
    const C scales[kTile] = {cs, cs, cs, cs}, ones[kTile] = {C(1), C(1), C(1), C(1)};
    std::int64_t nbad = 0, colbad = 0;
#pragma omp parallel num_threads(threads_for(n * tq, tk * (2 * dk + 2 * dv))) \
    reduction(+ : nbad, colbad)
    {
        C* st = scratch<C>(5, kTile * tq);
        C* pt = scratch<C>(6, kTile * tq);
        C* at2 = scratch<C>(7, kTile * tq);
        C* kb = scratch<C>(8, kTile * dk);
        C* vb = scratch<C>(9, kTile * dv);
        C* rk = scratch<C>(10, kTile * dk);
        C* rv = scratch<C>(11, kTile * dv);
        for (index_t h = 0; h < n; ++h) {
            const double* lh = lse + h * tq;
            transpose_into(q + h * tq * dk, tq, dk, qt);
            transpose_into(d_o + h * tq * dv, tq, dv, gt);
#pragma omp for schedule(static)
            for (index_t i = 0; i < tq; ++i) {
                const T *gr = d_o + (h * tq + i) * dv, *orow = o + (h * tq + i) * dv;
                double d = 0.0;  // in double also for float
                for (index_t c = 0; c < dv; ++c) {
                    d = madd(static_cast<double>(gr[c]), static_cast<double>(orow[c]), d);
                }
                delta[sz(i)] = static_cast<C>(d);
                lsec[sz(i)] = static_cast<C>(lh[i]);
            }  // barrier: every chunk needs every D_i
            // The chunks of key tiles: each accumulates dk, dv of its keys whole, and its share
            // of dq and the spread into its own partial, so no two threads write one number.
#pragma omp for schedule(static, 1)
            for (index_t ch = 0; ch < nchunks; ++ch) {
                C* pq = part + ch * prow * tq;
                const index_t f0 = firstq[sz(ch)];
                for (index_t c = 0; c < prow; ++c) std::fill(pq + c * tq + f0, pq + (c + 1) * tq, C(0));
                for (index_t t = bounds[sz(ch)]; t < bounds[sz(ch + 1)]; ++t) {
                    const index_t j0 = t * kTile;
                    const index_t real = load_tile(k + h * tk * dk, j0, tk, dk, kb);
                    load_tile(v + h * tk * dv, j0, tk, dv, vb);
                    const index_t i0 = first_query(j0, offset, tq);
                    const index_t cnt = tq - i0;
                    dot_rows(kb, qt + i0, dk, tq, cnt, st, tq);  // s
                    dot_rows(vb, gt + i0, dv, tq, cnt, at2, tq);  // dp
                    const C* dl = delta + i0;
                    const C* li = lsec + i0;
                    for (index_t r = 0; r < kTile; ++r) {
                        // Query i sees key j0 + r when i >= j0 + r - offset: local index >= first.
                        const index_t first =
                            r < real ? std::min(cnt, first_query(j0 + r, offset, tq) - i0) : cnt;
                        C *s = st + r * tq, *pp = pt + r * tq;
                        C* a = at2 + r * tq;
                        std::fill(s, s + first, C(0));
                        std::fill(pp, pp + first, C(0));
                        std::fill(a, a + first, C(0));
#pragma omp simd
                        for (index_t x = first; x < cnt; ++x) {
                            // <= 0 up to rounding when lse is the forward pass's; clamped so p <= 1.
                            const C y = cs * s[x] - li[x];
                            const C pv = exp_c(select_c(y > C(0), C(0), y));
                            const C ad = a[x] - dl[x];  // the advantage A_ij
                            const C g = pv * ad;        // dL/ds_ij
                            pp[x] = pv;
                            s[x] = g;
                            a[x] = g * ad;  // p A^2, the spread's term
                        }
                    }
                    weighted_sums(st, tq, qt + i0, dk, tq, cnt, scales, rk);
                    weighted_sums(pt, tq, gt + i0, dv, tq, cnt, ones, rv);
                    scatter_rows(st, at2, tq, kb, dk, cnt, pq + i0, tq);
                    for (index_t r = 0; r < real; ++r) {
                        const index_t col = h * tk + j0 + r;
                        bool bad = false;
                        for (index_t c = 0; c < dk; ++c) {
                            dkey[col * dk + c] = static_cast<T>(rk[sz(r * dk + c)]);
                            bad = bad || !std::isfinite(rk[sz(r * dk + c)]);
                        }
                        for (index_t c = 0; c < dv; ++c) {
                            dval[col * dv + c] = static_cast<T>(rv[sz(r * dv + c)]);
                            bad = bad || !std::isfinite(rv[sz(r * dv + c)]);
                        }
                        colbad += bad ? 1 : 0;
                    }
                }
            }  // barrier: the rows need every chunk's partial
            // dq_i and the spread: the chunks' partials summed in chunk order (in double), per
            // block of rows, a column at a time over the block (contiguous, vectorized; the
            // scalar gather across chunks was 4% of a training step). Chunk ch adds to the rows
            // i >= firstq[ch] (nondecreasing in ch), so each sum is 0 + p_0 + p_1 + ... in
            // chunk order, whatever the blocks.
#pragma omp for schedule(static)
            for (index_t b = 0; b < (tq + kSumRows - 1) / kSumRows; ++b) {
                const index_t r0 = b * kSumRows, r1 = std::min(tq, r0 + kSumRows), nr = r1 - r0;
                double* acc = scratch<double>(12, prow * kSumRows);
                for (index_t c = 0; c < prow; ++c) {
                    double* ac = acc + c * kSumRows;
                    std::fill(ac, ac + nr, 0.0);
                    for (index_t ch = 0; ch < nchunks && firstq[sz(ch)] < r1; ++ch) {
                        const index_t lo = std::max(r0, firstq[sz(ch)]);
                        const C* pc = part + (ch * prow + c) * tq;
#pragma omp simd
                        for (index_t i = lo; i < r1; ++i) ac[i - r0] += static_cast<double>(pc[i]);
                    }
                }
                for (index_t i = r0; i < r1; ++i) {
                    const index_t row = h * tq + i;
                    bool bad = !std::isfinite(delta[sz(i)]);
                    for (index_t c = 0; c < prow; ++c) {
                        const double a = acc[sz(c * kSumRows + i - r0)];
                        bad = bad || !std::isfinite(a);
                        if (c < dk) {
                            dq[row * dk + c] = static_cast<T>(scale * a);
                        } else {
                            spread[row] = std::sqrt(a);
                        }
                    }
                    nbad += bad ? 1 : 0;
                }
            }  // barrier: the scratch is reused by the next head
        }
    }
    return nbad ? nbad : (colbad ? 1 : 0);
}

}  // namespace pyengine
