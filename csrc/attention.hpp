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
//   attention_backward:    q, k, v, d_o (n, tq, dv), lse -> dq, dk, dv, spread (n, tq).
// Key j is visible to query i when j <= i + offset; masked inputs are never read, masked
// outputs are 0. Every kernel returns the number of bad rows (non-finite row sums).
//
// Numerics: everything in double, also for float input (the inputs a row needs are
// converted once per head into double scratch). The fused head never stores a (tq, tk)
// matrix: a row (or column) of scores lives in a thread's scratch of length tk (tq).
//
// Layout and vectorization (the tile helpers are in attention_tiles.hpp): per head, k, v
// (and for the backward q, d_o) are transposed
// into (features, tokens) double scratch shared by the threads. Queries are taken kTile at
// a time (a tile): the tile's scores s_rj = sum_c q_rc kt[c][j] come from dot_rows, which
// keeps 4 rows x 8 keys in registers and reads each transposed key once for the 4 rows,
// and its weighted sums over keys (o_rc = sum_j p_rj vt[c][j]) from weighted_sums, in a
// fixed order. A one-row version was bound by re-reading the 400 KB of transposed keys and
// values from L2 for every query (12 ms for the forward pass at T = 2000).
//
// Parallelism: one OpenMP region per call; per head, the threads first transpose (omp for
// over tokens), then share the tiles round-robin (causal tiles have unequal work, so
// contiguous blocks would leave one thread the long rows). Each tile (and, in the backward
// pass, each tile of key columns of dk and dv) is computed whole by one thread in a fixed
// order, so results do not depend on the number of threads. The backward pass is a row
// pass (dq, the row sums D_i = sum_j p_ij dp_ij, the spread) and then a column pass (dk,
// dv) that recomputes its p and dp: more arithmetic than scattering into per-thread dk,
// dv, but no reduction across threads, so it stays deterministic.
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
    std::vector<double> vt(sz(dv * tk));  // one head's v^T, shared
    const index_t tiles = (tq + kTile - 1) / kTile;
    std::int64_t nbad = 0;
#pragma omp parallel num_threads(threads_for(n * tq, tk * (dv + 1))) reduction(+ : nbad)
    {
        std::vector<double> bt(sz(kTile * tk)), ut(sz(kTile * dv));
        for (index_t h = 0; h < n; ++h) {
            transpose_into(v + h * tk * dv, tk, dv, vt.data());  // ends in a barrier
#pragma omp for schedule(static, 1)
            for (index_t t = 0; t < tiles; ++t) {
                const index_t i0 = t * kTile;
                const index_t real = load_tile(u + h * tq * dv, i0, tq, dv, ut.data());
                const index_t nmax = visible_keys(i0 + real - 1, offset, tk);
                dot_rows(ut.data(), vt.data(), dv, tk, nmax, bt.data(), tk);  // b, formed once
                for (index_t r = 0; r < real; ++r) {
                    const index_t row = h * tq + i0 + r;
                    const index_t vis = visible_keys(i0 + r, offset, tk);
                    const T* pr = p + row * tk;
                    const double* b = bt.data() + r * tk;
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
template <class T>
std::int64_t attention_forward(const T* q, const T* k, const T* v, index_t offset, double scale,
                               index_t n, index_t tq, index_t tk, index_t dk, index_t dv, T* out,
                               double* lse, double* entropy) {
    using namespace attention_detail;
    using activations_detail::exp_neg;
    std::vector<double> kt(sz(dk * tk)), vt(sz(dv * tk));
    const index_t tiles = (tq + kTile - 1) / kTile;
    std::int64_t nbad = 0;
#pragma omp parallel num_threads(threads_for(n * tq, tk * (dk + dv))) reduction(+ : nbad)
    {
        std::vector<double> st(sz(kTile * tk)), et(sz(kTile * tk));
        std::vector<double> qt(sz(kTile * dk)), ot(sz(kTile * dv));
        for (index_t h = 0; h < n; ++h) {
            transpose_into(k + h * tk * dk, tk, dk, kt.data());
            transpose_into(v + h * tk * dv, tk, dv, vt.data());
#pragma omp for schedule(static, 1)
            for (index_t t = 0; t < tiles; ++t) {
                const index_t i0 = t * kTile;
                const index_t real = load_tile(q + h * tq * dk, i0, tq, dk, qt.data());
                const index_t nmax = visible_keys(i0 + real - 1, offset, tk);
                dot_rows(qt.data(), kt.data(), dk, tk, nmax, st.data(), tk);
                double inv[kTile] = {}, stat[kTile][2] = {};
                for (index_t r = 0; r < kTile; ++r) {
                    const index_t vis = r < real ? visible_keys(i0 + r, offset, tk) : 0;
                    double* s = st.data() + r * tk;
                    double* e = et.data() + r * tk;
                    const double m = scale_max(s, vis, scale);
                    double z = 0.0, zs = 0.0;
#pragma omp simd reduction(+ : z, zs)
                    for (index_t j = 0; j < vis; ++j) {
                        const double x = exp_neg(s[j] - m);
                        e[j] = x;
                        z += x;
                        zs += x * s[j];
                    }
                    std::fill(e + vis, e + nmax, 0.0);  // masked (and padding rows): weight 0
                    inv[r] = r < real ? 1.0 / z : 0.0;
                    stat[r][0] = m + std::log(z);
                    stat[r][1] = stat[r][0] - zs / z;
                }
                weighted_sums(et.data(), tk, vt.data(), dv, tk, nmax, inv, ot.data());
                for (index_t r = 0; r < real; ++r) {
                    const index_t row = h * tq + i0 + r;
                    lse[row] = stat[r][0];
                    entropy[row] = stat[r][1];
                    bool bad = !std::isfinite(stat[r][0]) || !std::isfinite(stat[r][1]);
                    for (index_t c = 0; c < dv; ++c) {
                        const double o = ot[sz(r * dv + c)];
                        out[row * dv + c] = static_cast<T>(o);
                        bad = bad || !std::isfinite(o);
                    }
                    nbad += bad ? 1 : 0;
                }
            }
        }
    }
    return nbad;
}

/// The fused backward pass: dq, dk, dv from d_o = dL/do, p recomputed from lse, and the row
/// statistic spread = sqrt(sum_j p A^2). Returns the number of bad rows.
template <class T>
std::int64_t attention_backward(const T* q, const T* k, const T* v, const T* d_o, const double* lse,
                                index_t offset, double scale, index_t n, index_t tq, index_t tk,
                                index_t dk, index_t dv, T* dq, T* dkey, T* dval, double* spread) {
    using namespace attention_detail;
    using activations_detail::exp_neg;
    using activations_detail::select;
    std::vector<double> kt(sz(dk * tk)), vt(sz(dv * tk)), qt(sz(dk * tq)), gt(sz(dv * tq));
    std::vector<double> delta(sz(tq));
    const index_t row_tiles = (tq + kTile - 1) / kTile, col_tiles = (tk + kTile - 1) / kTile;
    const double scales[kTile] = {scale, scale, scale, scale}, ones[kTile] = {1.0, 1.0, 1.0, 1.0};
    std::int64_t nbad = 0, colbad = 0;
#pragma omp parallel num_threads(threads_for(n * tq, tk * (2 * dk + 2 * dv))) \
    reduction(+ : nbad, colbad)
    {
        const index_t tmax = std::max(tq, tk), dmax = std::max(dk, dv);
        std::vector<double> st(sz(kTile * tmax)), pt(sz(kTile * tmax)), dpt(sz(kTile * tmax));
        std::vector<double> at(sz(kTile * dmax)), bt(sz(kTile * dmax)), rt(sz(kTile * dmax));
        for (index_t h = 0; h < n; ++h) {
            const double* lh = lse + h * tq;
            transpose_into(k + h * tk * dk, tk, dk, kt.data());
            transpose_into(v + h * tk * dv, tk, dv, vt.data());
            transpose_into(q + h * tq * dk, tq, dk, qt.data());
            transpose_into(d_o + h * tq * dv, tq, dv, gt.data());
            // Row pass: dq_i, D_i = sum_j p_ij dp_ij and the spread, a tile of queries at a time.
#pragma omp for schedule(static, 1)
            for (index_t t = 0; t < row_tiles; ++t) {
                const index_t i0 = t * kTile;
                const index_t real = load_tile(q + h * tq * dk, i0, tq, dk, at.data());
                load_tile(d_o + h * tq * dv, i0, tq, dv, bt.data());
                const index_t nmax = visible_keys(i0 + real - 1, offset, tk);
                dot_rows(at.data(), kt.data(), dk, tk, nmax, st.data(), tk);
                dot_rows(bt.data(), vt.data(), dv, tk, nmax, dpt.data(), tk);
                double sp[kTile] = {};
                for (index_t r = 0; r < kTile; ++r) {
                    const index_t vis = r < real ? visible_keys(i0 + r, offset, tk) : 0;
                    const double l = r < real ? lh[i0 + r] : 0.0;
                    double *s = st.data() + r * tk, *pp = pt.data() + r * tk;
                    const double* dp = dpt.data() + r * tk;
                    double d = 0.0;
#pragma omp simd reduction(+ : d)
                    for (index_t j = 0; j < vis; ++j) {
                        // <= 0 up to rounding when lse is the forward pass's; clamped so p <= 1.
                        const double x = scale * s[j] - l;
                        pp[j] = exp_neg(select(x > 0.0, 0.0, x));
                        d += pp[j] * dp[j];
                    }
                    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
                    for (index_t j = 0; j < vis; ++j) {
                        const double a = dp[j] - d;
                        s[j] = pp[j] * a;  // g_ij = dL/ds_ij
                        acc += s[j] * a;
                    }
                    std::fill(s + vis, s + nmax, 0.0);
                    sp[r] = acc;
                    if (r < real) delta[sz(i0 + r)] = d;
                }
                weighted_sums(st.data(), tk, kt.data(), dk, tk, nmax, scales, rt.data());
                for (index_t r = 0; r < real; ++r) {
                    const index_t row = h * tq + i0 + r;
                    spread[row] = std::sqrt(sp[r]);
                    bool bad = !std::isfinite(sp[r]) || !std::isfinite(delta[sz(i0 + r)]);
                    for (index_t c = 0; c < dk; ++c) {
                        const double g = rt[sz(r * dk + c)];
                        dq[row * dk + c] = static_cast<T>(g);
                        bad = bad || !std::isfinite(g);
                    }
                    nbad += bad ? 1 : 0;
                }
            }  // barrier: the column pass needs every D_i
            // Column pass: dk_j and dv_j, a tile of keys at a time, over the queries that see them.
#pragma omp for schedule(static, 1)
            for (index_t t = 0; t < col_tiles; ++t) {
                const index_t j0 = t * kTile;
                const index_t real = load_tile(k + h * tk * dk, j0, tk, dk, at.data());
                load_tile(v + h * tk * dv, j0, tk, dv, bt.data());
                const index_t i0 = std::min(tq, std::max<index_t>(0, j0 - offset));
                const index_t cnt = tq - i0;
                dot_rows(at.data(), qt.data() + i0, dk, tq, cnt, st.data(), tq);
                dot_rows(bt.data(), gt.data() + i0, dv, tq, cnt, dpt.data(), tq);
                for (index_t r = 0; r < kTile; ++r) {
                    // Query i sees key j0 + r when i >= j0 + r - offset: local index >= first.
                    const index_t first = r < real ? std::min(cnt, std::max<index_t>(0, j0 + r - offset) - i0) : cnt;
                    double *s = st.data() + r * tq, *pp = pt.data() + r * tq;
                    const double* dp = dpt.data() + r * tq;
                    std::fill(s, s + first, 0.0);
                    std::fill(pp, pp + first, 0.0);
#pragma omp simd
                    for (index_t x = first; x < cnt; ++x) {
                        const double y = scale * s[x] - lh[i0 + x];
                        const double pv = exp_neg(select(y > 0.0, 0.0, y));
                        pp[x] = pv;
                        s[x] = pv * (dp[x] - delta[sz(i0 + x)]);
                    }
                }
                weighted_sums(st.data(), tq, qt.data() + i0, dk, tq, cnt, scales, rt.data());
                weighted_sums(pt.data(), tq, gt.data() + i0, dv, tq, cnt, ones, bt.data());
                for (index_t r = 0; r < real; ++r) {
                    const index_t col = h * tk + j0 + r;
                    bool bad = false;
                    for (index_t c = 0; c < dk; ++c) {
                        dkey[col * dk + c] = static_cast<T>(rt[sz(r * dk + c)]);
                        bad = bad || !std::isfinite(rt[sz(r * dk + c)]);
                    }
                    for (index_t c = 0; c < dv; ++c) {
                        dval[col * dv + c] = static_cast<T>(bt[sz(r * dv + c)]);
                        bad = bad || !std::isfinite(bt[sz(r * dv + c)]);
                    }
                    colbad += bad ? 1 : 0;
                }
            }  // barrier: the scratch is reused by the next head
        }
    }
    return nbad ? nbad : (colbad ? 1 : 0);
}

}  // namespace pyengine
