// Dense layers with a fused epilogue (kernel ids linear, linear_act, linear_mul); the contract
// is pyengine/kernels/_reference/linear.py:
//   linear:      out = x @ w (+ b) (+ r)                 x (N, k), w (k, n), b (n,), r and out (N, n)
//   linear_act:  u = x @ w (+ b); out = act(u)            act in {none, gelu, gelu_tanh, relu}
//   linear_mul:  out = (x @ w) * coef                     coef (M, n), M | N: row i uses coef[i % M]
//                (the MLP JVP's du *= f'(u): K tangents against the base's T rows)
// Each returns the number of rows of the product (after bias and residual; before the
// activation or coefficient) that hold NaN or Inf.
//
// Pure C++17 on raw pointers. The product is a row-major CBLAS gemm through a function
// pointer the caller supplies (the bindings find NumPy's OpenBLAS at run time: nothing
// is linked). One OpenMP parallel region: the rows are cut into tiles, and each thread
// calls single-threaded BLAS on its tile (set_threads_local(1), OpenBLAS's per-thread
// setting) and then applies the epilogue to the tile while it is still in cache. So no
// BLAS thread pool runs (or spins after the call) next to ours, and the (N, n) result is
// written once and read once in cache instead of being streamed again by separate
// bias, activation and residual passes.
//
// Rounding: results do not depend on the number of threads (see tiling() below). The epilogue
// adds b, then r, in that order, in T; the activation is the one of activations.hpp, element
// for element (tested). The product itself agrees with one numpy matmul over all rows to
// rounding, not always bit for bit: a gemm's rounding can depend on where a column falls in
// its tile and on the call's size (the model keeps float64 on numpy's products for that).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "activations.hpp"
#include "parallel.hpp"

namespace pyengine {

// CBLAS entry points: ILP64 (64-bit integer) or LP64 (int) dimensions.
struct LinearBlas {
    using sgemm64_t = void (*)(int, int, int, std::int64_t, std::int64_t, std::int64_t, float, const float*,
                               std::int64_t, const float*, std::int64_t, float, float*, std::int64_t);
    using dgemm64_t = void (*)(int, int, int, std::int64_t, std::int64_t, std::int64_t, double, const double*,
                               std::int64_t, const double*, std::int64_t, double, double*, std::int64_t);
    using sgemm32_t = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                               float*, int);
    using dgemm32_t = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int,
                               double, double*, int);
    using local_t = int (*)(int);
    void* sgemm = nullptr;
    void* dgemm = nullptr;
    local_t set_threads_local = nullptr;
    bool ilp64 = true;
    bool ready() const { return sgemm != nullptr && dgemm != nullptr && set_threads_local != nullptr; }
};

// Runs body() once in every thread of one OpenMP region of `threads` threads, with OpenBLAS
// single-threaded in each of them, and returns the sum of what the calls returned (body
// shares its work out with orphaned `omp for` loops). Every kernel that calls BLAS from
// OpenMP threads goes through here: the caller's count is set to 1 before the region and
// restored after it on the caller's thread, since restores from every thread raced where the
// count is global (NumPy's pthreads OpenBLAS was left on one thread after a kernel).
template <class Body>
std::int64_t blas_region(const LinearBlas& bl, int threads, Body&& body) {
    std::int64_t total = 0;
    const int prev = bl.set_threads_local(1);
#pragma omp parallel num_threads(std::max(1, threads)) reduction(+ : total)
    {
        bl.set_threads_local(1);
        total += body();
    }
    bl.set_threads_local(prev);
    return total;
}

inline constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111;

enum class Act { none = 0, gelu = 1, gelu_tanh = 2, relu = 3 };

namespace linear_detail {

// c (m, nn; row stride ldc) = x (m, k; lda) @ w (k, nn; ldb) + beta c, row-major.
template <class T>
void gemm(const LinearBlas& b, index_t m, index_t nn, index_t k, const T* x, index_t lda, const T* w, index_t ldb,
          T beta, T* c, index_t ldc) {
    if (b.ilp64) {
        if constexpr (std::is_same_v<T, float>) {
            reinterpret_cast<LinearBlas::sgemm64_t>(b.sgemm)(kCblasRowMajor, kCblasNoTrans, kCblasNoTrans, m, nn, k,
                                                            1.0f, x, lda, w, ldb, beta, c, ldc);
        } else {
            reinterpret_cast<LinearBlas::dgemm64_t>(b.dgemm)(kCblasRowMajor, kCblasNoTrans, kCblasNoTrans, m, nn, k,
                                                            1.0, x, lda, w, ldb, beta, c, ldc);
        }
    } else {
        const auto i = [](index_t v) { return static_cast<int>(v); };
        if constexpr (std::is_same_v<T, float>) {
            reinterpret_cast<LinearBlas::sgemm32_t>(b.sgemm)(kCblasRowMajor, kCblasNoTrans, kCblasNoTrans, i(m),
                                                            i(nn), i(k), 1.0f, x, i(lda), w, i(ldb), beta, c, i(ldc));
        } else {
            reinterpret_cast<LinearBlas::dgemm32_t>(b.dgemm)(kCblasRowMajor, kCblasNoTrans, kCblasNoTrans, i(m),
                                                            i(nn), i(k), 1.0, x, i(lda), w, i(ldb), beta, c, i(ldc));
        }
    }
}

// o = F(x) on one row of d elements (o may be x), as activations.hpp's elementwise does it.
template <class F, class T>
PYENGINE_ALWAYS_INLINE void act_row(const T* xr, index_t d, T* o) {
    using namespace activations_detail;
    if constexpr (in_storage_type<F>::value) {
#pragma omp simd
        for (index_t j = 0; j < d; ++j) o[j] = F::f(xr[j]);
    } else if constexpr (std::is_same_v<T, float> && has_f32<F>::value) {
#pragma omp simd
        for (index_t j = 0; j < d; ++j) o[j] = F::f32(xr[j]);
    } else {
#pragma omp simd
        for (index_t j = 0; j < d; ++j) o[j] = static_cast<T>(F::f(static_cast<double>(xr[j])));
    }
}

// FloatGeluTanh: gelu_tanh all in float (GeluTanhFloat), for the bf16 products' epilogue.
template <bool FloatGeluTanh = false, class T>
void act_row(Act act, const T* xr, index_t d, T* o) {
    using namespace activations_detail;
    using GeluT = std::conditional_t<FloatGeluTanh, GeluTanhFloat, GeluTanh>;
    switch (act) {
        case Act::gelu: act_row<Gelu>(xr, d, o); break;
        case Act::gelu_tanh: act_row<GeluT>(xr, d, o); break;
        case Act::relu: act_row<Relu>(xr, d, o); break;
        case Act::none:
            if (o != xr) std::copy(xr, xr + d, o);
            break;
    }
}

// The epilogue of one row p (n,) of the product: p += b, p += r (in that order); whether it
// holds NaN/Inf afterwards.
template <class T>
PYENGINE_ALWAYS_INLINE bool bias_residual_row(T* p, index_t n, const T* b, const T* r) {
    int bad = 0;
    if (b != nullptr && r != nullptr) {
#pragma omp simd reduction(| : bad)
        for (index_t j = 0; j < n; ++j) {
            const T v = (p[j] + b[j]) + r[j];
            p[j] = v;
            bad |= activations_detail::nonfinite(v);
        }
    } else if (b != nullptr || r != nullptr) {
        const T* a = b != nullptr ? b : r;
#pragma omp simd reduction(| : bad)
        for (index_t j = 0; j < n; ++j) {
            const T v = p[j] + a[j];
            p[j] = v;
            bad |= activations_detail::nonfinite(v);
        }
    } else {
#pragma omp simd reduction(| : bad)
        for (index_t j = 0; j < n; ++j) bad |= activations_detail::nonfinite(p[j]);
    }
    return bad != 0;
}

// The tiles of the (N, n) result. Large N: row tiles of the full width, at most 2048 rows.
// Each row tile packs all of w once and each gemm call packs its own rows
// of x, so tall, full-width tiles keep the packing small next to the flops; the epilogue
// then runs on a tile that has left L2, which costs less than packing w per tile
// (docs/design.md). Small N (a single sequence) splits the columns only, so w is still
// packed once in all.
//
// Rounding: every element must be computed the same way whatever the number of threads. A
// gemm's rounding can depend on where a column falls in its tile, and on the call's size
// where the BLAS takes a small-matrix path (OpenBLAS: under about 1e6 multiply-adds), but
// not on where a row falls in a row tile of a large product (tested for OpenBLAS and MKL,
// float32 and float64: tests/test_blas.py). So a large product (k * n >= 2^18: every tile of
// 16 rows or more is far past the small-matrix paths) is cut into a multiple of the thread
// count (at most 8) of row tiles, spread evenly at multiples of 16 rows: on two threads
// each thread packs w once (4096 rows) or three times (8320 rows) instead of four
// (docs/design.md). Other products take about 8 row tiles, by the shape alone.
struct Tiling {
    index_t rows;    // row tile height (the last tile may be shorter); 0: `rtiles` even tiles
    index_t rtiles;  // row tiles
    index_t cols;    // column tile width
};

inline index_t round16(index_t v) { return std::max<index_t>(16, (v + 15) / 16 * 16); }

inline constexpr index_t kRowInvariantWork = index_t{1} << 18;  // k * n of a large product

inline Tiling tiling(index_t N, index_t n, index_t k, int threads) {
    if (N >= 256 && k * n >= kRowInvariantWork) {
        const index_t t = std::clamp<index_t>(threads, 1, 8);
        const index_t tiles = t * ((N + 2048 * t - 1) / (2048 * t));
        return {0, tiles, n};
    }
    if (N >= 256) {  // ~8 full-width row tiles of at most 2048 rows
        const index_t rows = std::min<index_t>(2048, round16((N + 7) / 8));
        return {rows, (N + rows - 1) / rows, n};
    }
    return {N, 1, std::min(n, std::max<index_t>(64, round16((n + 7) / 8)))};
}

// First row of row tile i (i = t.rtiles: N).
inline index_t row_start(const Tiling& t, index_t N, index_t i) {
    if (t.rows > 0) return std::min(N, i * t.rows);
    return i >= t.rtiles ? N : (i * N / t.rtiles) / 16 * 16;
}

// Runs tile(r0, r1, c0, c1) -> row r of the tile is bad (via flags[r * ctiles + ct]) over the
// tiles of [0, N) x [0, n) in one parallel region, each thread with single-threaded BLAS;
// returns the number of rows with a bad tile.
// Rows of a full-width tile over a prepacked w (linear_bf16.hpp): w is packed once for all
// tiles, so short tiles cost no packing, and the epilogue then reads a tile still in L2
// (128 x 3072 float32: 1.5 MiB). Fixed, so the rounding does not depend on the thread count.
inline constexpr index_t kPackedTileRows = 128;

// full_width: row tiles of kPackedTileRows over the whole width (a product whose operand is
// prepacked whole and cannot be cut into columns).
template <class TileFn>
std::int64_t over_tiles(const LinearBlas& blas, index_t N, index_t n, index_t k, bool full_width, TileFn&& tile) {
    const Tiling t = full_width ? Tiling{kPackedTileRows, (N + kPackedTileRows - 1) / kPackedTileRows, n}
                                : tiling(N, n, k, g_num_threads);
    const index_t ctiles = (n + t.cols - 1) / t.cols, tiles = t.rtiles * ctiles;
    const int threads = (N * n * k >= (index_t{1} << 18)) ? static_cast<int>(std::min<index_t>(g_num_threads, tiles))
                                                          : 1;
    std::vector<unsigned char> flags(static_cast<std::size_t>(N * ctiles), 0);
    unsigned char* fl = flags.data();
    blas_region(blas, threads, [&]() -> std::int64_t {
#pragma omp for schedule(dynamic, 1)
        for (index_t i = 0; i < tiles; ++i) {
            const index_t rt = i / ctiles, ct = i % ctiles;
            const index_t r0 = row_start(t, N, rt), r1 = row_start(t, N, rt + 1);
            const index_t c0 = ct * t.cols, c1 = std::min(n, c0 + t.cols);
            tile(r0, r1, c0, c1, fl + ct, ctiles);
        }
        return 0;
    });
    std::int64_t nbad = 0;
    for (index_t r = 0; r < N; ++r) {
        bool bad = false;
        for (index_t c = 0; c < ctiles; ++c) bad = bad || fl[r * ctiles + c] != 0;
        nbad += bad;
    }
    return nbad;
}

}  // namespace linear_detail

namespace linear_detail {

// The product of the float32/float64 kernels: dst (rows r0..r1, columns c0..c1; row stride
// ldc) = x[r0:r1] @ w[:, c0:c1] + beta dst, by the CBLAS gemm handed over.
template <class T>
struct GemmProduct {
    const LinearBlas& blas;
    const T* x;
    const T* w;
    index_t k, n;
    static constexpr bool full_width = false;  // any column tile
    static constexpr bool float_gelu_tanh = false;
    void operator()(index_t r0, index_t r1, index_t c0, index_t c1, T beta, T* dst, index_t ldc) const {
        gemm<T>(blas, r1 - r0, c1 - c0, k, x + r0 * k, k, w + c0, n, beta, dst, ldc);
    }
};

// out = prod (+ b) (+ r); r may be out itself (then the product is added to it, beta = 1, and b after).
template <class T, class P>
std::int64_t linear_with(const LinearBlas& blas, const P& prod, const T* b, const T* r, index_t N, index_t k,
                         index_t n, T* out) {
    const bool inplace = r == out;
    return over_tiles(blas, N, n, k, P::full_width, [&](index_t r0, index_t r1, index_t c0, index_t c1,
                                                        unsigned char* fl, index_t fs) {
        prod(r0, r1, c0, c1, inplace ? T(1) : T(0), out + r0 * n + c0, n);
        for (index_t i = r0; i < r1; ++i) {
            fl[i * fs] = bias_residual_row(out + i * n + c0, c1 - c0, b == nullptr ? nullptr : b + c0,
                                           (r == nullptr || inplace) ? nullptr : r + i * n + c0);
        }
    });
}

// u = prod (+ b), out = act(u); u may be nullptr.
template <class T, class P>
std::int64_t linear_act_with(const LinearBlas& blas, const P& prod, const T* b, Act act, index_t N, index_t k,
                             index_t n, T* u, T* out) {
    T* dst = u != nullptr ? u : out;
    return over_tiles(blas, N, n, k, P::full_width, [&](index_t r0, index_t r1, index_t c0, index_t c1,
                                                        unsigned char* fl, index_t fs) {
        prod(r0, r1, c0, c1, T(0), dst + r0 * n + c0, n);
        for (index_t i = r0; i < r1; ++i) {
            T* p = dst + i * n + c0;
            fl[i * fs] = bias_residual_row(p, c1 - c0, b == nullptr ? nullptr : b + c0, static_cast<const T*>(nullptr));
            act_row<P::float_gelu_tanh>(act, p, c1 - c0, out + i * n + c0);
        }
    });
}

// out = prod * coef, coef (M, n): row i uses coef[i % M].
template <class T, class P>
std::int64_t linear_mul_with(const LinearBlas& blas, const P& prod, const T* coef, index_t M, index_t N, index_t k,
                             index_t n, T* out) {
    return over_tiles(blas, N, n, k, P::full_width, [&](index_t r0, index_t r1, index_t c0, index_t c1,
                                                        unsigned char* fl, index_t fs) {
        prod(r0, r1, c0, c1, T(0), out + r0 * n + c0, n);
        for (index_t i = r0; i < r1; ++i) {
            T* o = out + i * n + c0;
            const T* c = coef + (i % M) * n + c0;
            int rb = 0;
#pragma omp simd reduction(| : rb)
            for (index_t j = 0; j < c1 - c0; ++j) {
                rb |= activations_detail::nonfinite(o[j]);
                o[j] *= c[j];
            }
            fl[i * fs] = rb != 0;
        }
    });
}

}  // namespace linear_detail

/// out = x @ w (+ b) (+ r); r may be out itself (then the gemm adds the product to it, with
/// beta = 1, and b after: (x w + r) + b).
template <class T>
std::int64_t linear(const LinearBlas& blas, const T* x, const T* w, const T* b, const T* r, index_t N, index_t k,
                    index_t n, T* out) {
    return linear_detail::linear_with(blas, linear_detail::GemmProduct<T>{blas, x, w, k, n}, b, r, N, k, n, out);
}

/// u = x @ w (+ b), out = act(u); u may be nullptr (not kept: the product lives in out).
template <class T>
std::int64_t linear_act(const LinearBlas& blas, const T* x, const T* w, const T* b, Act act, index_t N, index_t k,
                        index_t n, T* u, T* out) {
    return linear_detail::linear_act_with(blas, linear_detail::GemmProduct<T>{blas, x, w, k, n}, b, act, N, k, n, u,
                                          out);
}

/// out = (x @ w) * coef, coef (M, n) with N a multiple of M: row i uses coef[i % M].
template <class T>
std::int64_t linear_mul(const LinearBlas& blas, const T* x, const T* w, const T* coef, index_t M, index_t N,
                        index_t k, index_t n, T* out) {
    return linear_detail::linear_mul_with(blas, linear_detail::GemmProduct<T>{blas, x, w, k, n}, coef, M, N, k, n,
                                          out);
}

/// The epilogues alone, for the fallback path (the product already in p, by numpy):
/// p += b, p += r, then out = act(p) or out = p * coef (out may be p); returns the bad rows of p.
template <class T>
std::int64_t linear_epilogue(T* p, const T* b, const T* r, Act act, const T* coef, index_t M, index_t N, index_t n,
                             T* out) {
    using namespace linear_detail;
    return count_bad_rows(N, n, [=](index_t i) {
        T* pr = p + i * n;
        T* o = out + i * n;
        const bool bad = bias_residual_row(pr, n, b, r == nullptr ? nullptr : r + i * n);
        if (coef != nullptr) {
            const T* c = coef + (i % M) * n;
#pragma omp simd
            for (index_t j = 0; j < n; ++j) o[j] = pr[j] * c[j];
        } else if (act != Act::none || o != pr) {
            act_row(act, pr, n, o);
        }
        return bad;
    });
}

}  // namespace pyengine
