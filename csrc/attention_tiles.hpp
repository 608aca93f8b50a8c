// Tile helpers of the attention kernels (csrc/attention.hpp): register-blocked products of
// a tile of kTile rows against (features, tokens) transposed scratch, the scaled row max,
// the loads and transposes into scratch, a float exp, and per-thread scratch reused across
// calls. Templated on the compute type C (double, or float for float32 inputs): Simd<C>
// is one AVX register of C (4 doubles or 8 floats). Pure C++17 on raw pointers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_simd.hpp"
#include "parallel.hpp"
#include "rows.hpp"
#include "vmath.hpp"

namespace pyengine {
namespace attention_detail {


// Rows (queries, or keys in the backward pass) computed together: one tile.
inline constexpr index_t kTile = 4;

// The backward pass splits the key tiles of a head into at most this many chunks of about
// equal work, fixed by the shape alone (not by the number of threads): each chunk keeps
// its own partial of dq and the spread, summed in chunk order afterwards.
inline constexpr index_t kChunks = 16;

inline std::size_t sz(index_t a) { return static_cast<std::size_t>(a); }

// Scratch of this thread that outlives the call: slot `slot` of the compute type C, grown
// (never shrunk) to at least n elements. The kernels' buffers live here, so a call in a
// training loop allocates nothing (a fresh vector per call cost ~500 page faults a step).
// Contents are not initialized: every kernel writes what it reads. Each OpenMP thread (and
// each calling thread) has its own slots, and a thread runs one kernel at a time.
template <class C>
C* scratch(int slot, index_t n) {
    thread_local std::vector<C> slots[16];
    auto& b = slots[slot];
    if (b.size() < sz(n)) b.resize(sz(n));
    return b.data();
}

// madd, vmadd, Simd<C> and in_register: attention_simd.hpp.

// e^x for x <= 0 in float, a few ulp (Cephes expf: x = n ln2 + r, |r| <= ln2/2, a degree-6
// polynomial); 0 for x < -87 (and -inf); branch-free like vmath's exp_neg so GCC
// vectorizes it 8 wide. exp_c picks the double or the float version.
PYENGINE_ALWAYS_INLINE float exp_negf(float x) {
    constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
    const float k = x * 1.44269504088896341f + kMagic;
    const float n = k - kMagic;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    std::uint32_t kb, mb, out;
    std::memcpy(&kb, &k, 4);
    std::memcpy(&mb, &kMagic, 4);
    const std::uint32_t sb = (kb - mb + 127u) << 23;
    float scale;
    std::memcpy(&scale, &sb, 4);
    const float res = p * scale;
    std::uint32_t rb;
    std::memcpy(&rb, &res, 4);
    const std::uint32_t m = 0u - static_cast<std::uint32_t>(x < -87.0f);
    out = rb & ~m;  // a NaN x keeps res, which is NaN
    float o;
    std::memcpy(&o, &out, 4);
    return o;
}
PYENGINE_ALWAYS_INLINE double exp_c(double x) { return vmath::exp_neg(x); }
PYENGINE_ALWAYS_INLINE float exp_c(float x) { return exp_negf(x); }

// c ? a : b without a branch (see vmath::select), in double or float.
PYENGINE_ALWAYS_INLINE double select_c(bool c, double a, double b) { return vmath::select(c, a, b); }
PYENGINE_ALWAYS_INLINE float select_c(bool c, float a, float b) {
    std::uint32_t ab, bb;
    std::memcpy(&ab, &a, 4);
    std::memcpy(&bb, &b, 4);
    const std::uint32_t m = 0u - static_cast<std::uint32_t>(c);
    const std::uint32_t r = (ab & m) | (bb & ~m);
    float o;
    std::memcpy(&o, &r, 4);
    return o;
}

// out[r * ldo + j] = sum_c a[r * m + c] * bt[c * ld + j] for the kTile rows r of a tile,
// j in [0, n), c in [0, m) in order: a tile of scores (or of b = u.v). 4 rows x 2 registers
// of j stay in eight registers across the c loop, so each load of bt serves four rows: the
// loads of the transposed keys, not the multiply-adds, bound a one-row loop (a (features, T)
// scratch of 400 KB is re-read for every row from L2). GCC does not vectorize this nest by
// itself ("complicated access pattern"), hence the intrinsics. Every output is the same
// chain of fused multiply-adds in c whichever path computes it, and fma(a, b, c) =
// fma(b, a, c), so a score computed from the query side and from the key side is the same
// number.
template <class C>
PYENGINE_ALWAYS_INLINE void dot_rows(const C* a, const C* bt, index_t m, index_t ld, index_t n,
                                     C* out, index_t ldo) {
    index_t j = 0;
#ifdef __AVX__
    using S = Simd<C>;
    constexpr index_t W = S::W;
    for (; j + 2 * W <= n; j += 2 * W) {
        typename S::V acc[kTile][2];
        for (auto& r : acc) r[0] = r[1] = S::zero();
        for (index_t c = 0; c < m; ++c) {
            auto b0 = S::load(bt + c * ld + j);
            auto b1 = S::load(bt + c * ld + j + W);
            in_register(b0);
            in_register(b1);
            for (index_t r = 0; r < kTile; ++r) {
                const auto ar = S::set1(a[r * m + c]);
                acc[r][0] = vmadd(ar, b0, acc[r][0]);
                acc[r][1] = vmadd(ar, b1, acc[r][1]);
            }
        }
        for (index_t r = 0; r < kTile; ++r) {
            S::store(out + r * ldo + j, acc[r][0]);
            S::store(out + r * ldo + j + W, acc[r][1]);
        }
    }
    for (; j + W <= n; j += W) {  // one register of j (the same chains of multiply-adds)
        typename S::V acc[kTile];
        for (auto& r : acc) r = S::zero();
        for (index_t c = 0; c < m; ++c) {
            const auto b0 = S::load(bt + c * ld + j);
            for (index_t r = 0; r < kTile; ++r) acc[r] = vmadd(S::set1(a[r * m + c]), b0, acc[r]);
        }
        for (index_t r = 0; r < kTile; ++r) S::store(out + r * ldo + j, acc[r]);
    }
#ifdef __AVX512F__
    if (j < n) {  // the last n - j < W keys in masked lanes: the same chains, not scalar ones
        typename S::V acc[kTile];
        for (auto& r : acc) r = S::zero();
        for (index_t c = 0; c < m; ++c) {
            const auto b0 = S::load_first(bt + c * ld + j, n - j);
            for (index_t r = 0; r < kTile; ++r) acc[r] = vmadd(S::set1(a[r * m + c]), b0, acc[r]);
        }
        for (index_t r = 0; r < kTile; ++r) S::store_first(out + r * ldo + j, n - j, acc[r]);
        j = n;
    }
#endif
#endif
    for (; j < n; ++j) {
        for (index_t r = 0; r < kTile; ++r) {
            C s = 0;
            for (index_t c = 0; c < m; ++c) {
                s = madd(a[r * m + c], bt[c * ld + j], s);
            }
            out[r * ldo + j] = s;
        }
    }
}

// out[r * m + c] = scale[r] * sum_j w[r * ldw + j] * bt[c * ld + j] for the kTile rows r,
// c in [0, m), j in [0, n): two c at a time for the four rows (eight registers), so each
// load of bt serves four rows and each load of w two columns. The order of the additions
// is fixed by n alone (W lanes, folded in a fixed order, then the scalar tail).
template <class C>
PYENGINE_ALWAYS_INLINE void weighted_sums(const C* w, index_t ldw, const C* bt, index_t m,
                                          index_t ld, index_t n, const C* scale, C* out) {
    index_t c = 0;
#ifdef __AVX__
    using S = Simd<C>;
    const index_t nw = n - n % S::W;
    // Four columns at a time (16 accumulators): 8 loads per 16 multiply-adds instead of 6 per
    // 8. Each output is the same chain as in the two- and one-column loops below.
    for (; c + 4 <= m; c += 4) {
        const C* b[4] = {bt + c * ld, bt + (c + 1) * ld, bt + (c + 2) * ld, bt + (c + 3) * ld};
        typename S::V acc[kTile][4];
        for (auto& r : acc) r[0] = r[1] = r[2] = r[3] = S::zero();
        for (index_t j = 0; j < nw; j += S::W) {
            auto v0 = S::load(b[0] + j), v1 = S::load(b[1] + j);
            auto v2 = S::load(b[2] + j), v3 = S::load(b[3] + j);
            in_register(v0);
            in_register(v1);
            in_register(v2);
            in_register(v3);
            for (index_t r = 0; r < kTile; ++r) {
                const auto wr = S::load(w + r * ldw + j);
                acc[r][0] = vmadd(wr, v0, acc[r][0]);
                acc[r][1] = vmadd(wr, v1, acc[r][1]);
                acc[r][2] = vmadd(wr, v2, acc[r][2]);
                acc[r][3] = vmadd(wr, v3, acc[r][3]);
            }
        }
        for (index_t r = 0; r < kTile; ++r) {
            for (index_t q = 0; q < 4; ++q) {
                C s0 = S::sum(acc[r][q]);
                for (index_t j = nw; j < n; ++j) s0 = madd(w[r * ldw + j], b[q][j], s0);
                out[r * m + c + q] = scale[r] * s0;
            }
        }
    }
    for (; c + 2 <= m; c += 2) {
        const C *b0 = bt + c * ld, *b1 = b0 + ld;
        typename S::V acc[kTile][2];
        for (auto& r : acc) r[0] = r[1] = S::zero();
        for (index_t j = 0; j < nw; j += S::W) {
            auto v0 = S::load(b0 + j), v1 = S::load(b1 + j);
            in_register(v0);
            in_register(v1);
            for (index_t r = 0; r < kTile; ++r) {
                const auto wr = S::load(w + r * ldw + j);
                acc[r][0] = vmadd(wr, v0, acc[r][0]);
                acc[r][1] = vmadd(wr, v1, acc[r][1]);
            }
        }
        for (index_t r = 0; r < kTile; ++r) {
            C s0 = S::sum(acc[r][0]), s1 = S::sum(acc[r][1]);
            for (index_t j = nw; j < n; ++j) {
                s0 = madd(w[r * ldw + j], b0[j], s0);
                s1 = madd(w[r * ldw + j], b1[j], s1);
            }
            out[r * m + c] = scale[r] * s0;
            out[r * m + c + 1] = scale[r] * s1;
        }
    }
    for (; c < m; ++c) {
        const C* b0 = bt + c * ld;
        typename S::V acc[kTile];
        for (auto& r : acc) r = S::zero();
        for (index_t j = 0; j < nw; j += S::W) {
            const auto v0 = S::load(b0 + j);
            for (index_t r = 0; r < kTile; ++r) {
                acc[r] = vmadd(S::load(w + r * ldw + j), v0, acc[r]);
            }
        }
        for (index_t r = 0; r < kTile; ++r) {
            C s0 = S::sum(acc[r]);
            for (index_t j = nw; j < n; ++j) {
                s0 = madd(w[r * ldw + j], b0[j], s0);
            }
            out[r * m + c] = scale[r] * s0;
        }
    }
#endif
    for (; c < m; ++c) {  // without AVX: every column here, in the same order as above
        for (index_t r = 0; r < kTile; ++r) {
            C s0 = 0;
            for (index_t j = 0; j < n; ++j) {
                s0 = madd(w[r * ldw + j], bt[c * ld + j], s0);
            }
            out[r * m + c] = scale[r] * s0;
        }
    }
}

// dst (cols, rows) of C = the transpose of src (rows, cols) of T, rows split over the team.
template <class T, class C>
void transpose_into(const T* src, index_t rows, index_t cols, C* dst) {
#pragma omp for schedule(static)
    for (index_t r = 0; r < rows; ++r) {
        for (index_t c = 0; c < cols; ++c) {
            dst[c * rows + r] = static_cast<C>(src[r * cols + c]);
        }
    }
}

// Keys 0 .. vis-1 are visible to query i (written so that a huge offset cannot overflow).
PYENGINE_ALWAYS_INLINE index_t visible_keys(index_t i, index_t offset, index_t tk) {
    return offset >= tk - i ? tk : i + offset + 1;
}

// The first query that sees key j (queries i >= j - offset), at most tq.
PYENGINE_ALWAYS_INLINE index_t first_query(index_t j, index_t offset, index_t tq) {
    return std::min(tq, std::max<index_t>(0, j - offset));
}

// Splits the key tiles [0, tiles) into nchunks contiguous chunks of about equal work (a
// tile's work: the queries that see it, plus one): chunk c is the tiles
// [bounds[c], bounds[c + 1]), and firstq[c] the first query its first tile's keys reach
// (nondecreasing in c). Depends on the shape and the mask only.
inline void chunk_tiles(index_t tq, index_t tk, index_t offset, index_t nchunks, index_t* bounds,
                        index_t* firstq) {
    const index_t tiles = (tk + kTile - 1) / kTile;
    double total = 0.0;
    for (index_t t = 0; t < tiles; ++t) total += double(tq - first_query(t * kTile, offset, tq) + 1);
    double acc = 0.0;
    index_t c = 1;
    bounds[0] = 0;
    for (index_t t = 0; t < tiles && c < nchunks; ++t) {
        acc += double(tq - first_query(t * kTile, offset, tq) + 1);
        while (c < nchunks && acc >= total * double(c) / double(nchunks)) bounds[c++] = t + 1;
    }
    while (c <= nchunks) bounds[c++] = tiles;
    for (c = 0; c <= nchunks; ++c) firstq[c] = first_query(bounds[c] * kTile, offset, tq);
}

// part[c * ldp + x] += sum_r g[r * ldg + x] kb[r * m + c] (r = 0 .. kTile-1, in order) for
// c in [0, m), and part[m * ldp + x] += sum_r w[r * ldg + x], x in [0, n): a key tile's share
// of dq^T (the weighted keys) and of the spread, into a chunk's partial.
template <class C>
PYENGINE_ALWAYS_INLINE void scatter_rows(const C* g, const C* w, index_t ldg, const C* kb,
                                         index_t m, index_t n, C* part, index_t ldp) {
    const C *g0 = g, *g1 = g + ldg, *g2 = g + 2 * ldg, *g3 = g + 3 * ldg;
    index_t c = 0;
#ifdef __AVX__
    // Columns kGroup at a time with x outer: each vector of the four rows of g is loaded once
    // for the group, not once per column (the loads bound the column-by-column loop), and
    // the group's 4 kGroup weights stay in registers. Each output is the same expression as
    // in the loop below, so the results are identical.
    using S = Simd<C>;
    constexpr index_t W = S::W, kGroup = 5;
    const index_t nw = n - n % W;
    for (; c + kGroup <= m; c += kGroup) {
        typename S::V k0[kGroup], k1[kGroup], k2[kGroup], k3[kGroup];
        for (index_t q = 0; q < kGroup; ++q) {
            k0[q] = S::set1(kb[c + q]);
            k1[q] = S::set1(kb[m + c + q]);
            k2[q] = S::set1(kb[2 * m + c + q]);
            k3[q] = S::set1(kb[3 * m + c + q]);
        }
        for (index_t x = 0; x < nw; x += W) {
            const auto a0 = S::load(g0 + x), a1 = S::load(g1 + x), a2 = S::load(g2 + x), a3 = S::load(g3 + x);
            for (index_t q = 0; q < kGroup; ++q) {
                C* out = part + (c + q) * ldp + x;
                const auto t = vmadd(a3, k3[q], vmadd(a2, k2[q], vmadd(a1, k1[q], S::mul(a0, k0[q]))));
                S::store(out, S::add(S::load(out), t));
            }
        }
        for (index_t q = 0; q < kGroup; ++q) {
            const C q0 = kb[c + q], q1 = kb[m + c + q], q2 = kb[2 * m + c + q], q3 = kb[3 * m + c + q];
            C* out = part + (c + q) * ldp;
            for (index_t x = nw; x < n; ++x) out[x] += madd(g3[x], q3, madd(g2[x], q2, madd(g1[x], q1, g0[x] * q0)));
        }
    }
#endif
    for (; c < m; ++c) {
        const C k0 = kb[c], k1 = kb[m + c], k2 = kb[2 * m + c], k3 = kb[3 * m + c];
        C* out = part + c * ldp;
#pragma omp simd
        for (index_t x = 0; x < n; ++x) {
            out[x] += madd(g3[x], k3, madd(g2[x], k2, madd(g1[x], k1, g0[x] * k0)));
        }
    }
    const C *w0 = w, *w1 = w + ldg, *w2 = w + 2 * ldg, *w3 = w + 3 * ldg;
    C* out = part + m * ldp;
#pragma omp simd
    for (index_t x = 0; x < n; ++x) {
        out[x] += ((w0[x] + w1[x]) + w2[x]) + w3[x];
    }
}

// s[j] *= scale for j in [0, n); returns the max of the scaled values (-inf if n = 0). The
// intrinsics because GCC leaves the max reduction scalar, a chain of dependent maxsd that
// took a fifth of the forward pass. Inputs are finite (validated).
template <class C>
PYENGINE_ALWAYS_INLINE C scale_max(C* s, index_t n, C scale) {
    C m = -std::numeric_limits<C>::infinity();
    index_t j = 0;
#ifdef __AVX__
    using S = Simd<C>;
    constexpr index_t W = S::W;
    const auto sc = S::set1(scale);
    auto m0 = S::set1(m), m1 = m0;
    for (; j + 2 * W <= n; j += 2 * W) {
        const auto a = S::mul(S::load(s + j), sc);
        const auto b = S::mul(S::load(s + j + W), sc);
        S::store(s + j, a);
        S::store(s + j + W, b);
        m0 = S::max(m0, a);
        m1 = S::max(m1, b);
    }
    m = S::hmax(S::max(m0, m1));
#endif
    for (; j < n; ++j) {
        s[j] *= scale;
        m = std::max(m, s[j]);
    }
    return m;
}

// Loads the rows t0 .. t0 + kTile - 1 of src (rows, cols) of T into dst (kTile, cols) of
// C, zero-filling the rows past `rows`; returns how many rows were real.
template <class T, class C>
index_t load_tile(const T* src, index_t t0, index_t rows, index_t cols, C* dst) {
    const index_t real = std::min(kTile, rows - t0);
    for (index_t r = 0; r < kTile; ++r) {
        for (index_t c = 0; c < cols; ++c) {
            dst[r * cols + c] = r < real ? static_cast<C>(src[(t0 + r) * cols + c]) : C(0);
        }
    }
    return real;
}


}  // namespace attention_detail
}  // namespace pyengine
