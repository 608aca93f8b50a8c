// Tile helpers of the attention kernels (csrc/attention.hpp): register-blocked products of
// a tile of kTile rows against (features, tokens) transposed scratch, the scaled row max,
// and the loads and transposes into double scratch. Pure C++17 on raw pointers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "parallel.hpp"
#include "rows.hpp"

namespace pyengine {
namespace attention_detail {


// Rows (queries, or keys in the column pass) computed together: one tile.
inline constexpr index_t kTile = 4;

// a * b + c, rounded once where the machine has FMA (the vector and scalar paths agree).
PYENGINE_ALWAYS_INLINE double madd(double a, double b, double c) {
#ifdef __FMA__
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

#ifdef __AVX__
PYENGINE_ALWAYS_INLINE __m256d vmadd(__m256d a, __m256d b, __m256d c) {
#ifdef __FMA__
    return _mm256_fmadd_pd(a, b, c);
#else
    return _mm256_add_pd(_mm256_mul_pd(a, b), c);
#endif
}
#endif

// out[r * ldo + j] = sum_c a[r * m + c] * bt[c * ld + j] for the kTile rows r of a tile,
// j in [0, n), c in [0, m) in order: a tile of scores (or of b = u.v). 4 rows x 8 j stay in
// eight registers across the c loop, so each load of bt serves four rows: the loads of the
// transposed keys, not the multiply-adds, bound a one-row loop (a (features, T) scratch
// of 400 KB is re-read for every row from L2). GCC does not vectorize this nest by itself
// ("complicated access pattern"), hence the intrinsics. Every output is the same chain of
// fused multiply-adds in c whichever path computes it, and fma(a, b, c) = fma(b, a, c), so
// a score computed from the query side and from the key side is the same number.
PYENGINE_ALWAYS_INLINE void dot_rows(const double* a, const double* bt, index_t m, index_t ld,
                                     index_t n, double* out, index_t ldo) {
    index_t j = 0;
#ifdef __AVX__
    for (; j + 8 <= n; j += 8) {
        __m256d acc[kTile][2];
        for (auto& r : acc) r[0] = r[1] = _mm256_setzero_pd();
        for (index_t c = 0; c < m; ++c) {
            const __m256d b0 = _mm256_loadu_pd(bt + c * ld + j);
            const __m256d b1 = _mm256_loadu_pd(bt + c * ld + j + 4);
            for (index_t r = 0; r < kTile; ++r) {
                const __m256d ar = _mm256_set1_pd(a[r * m + c]);
                acc[r][0] = vmadd(ar, b0, acc[r][0]);
                acc[r][1] = vmadd(ar, b1, acc[r][1]);
            }
        }
        for (index_t r = 0; r < kTile; ++r) {
            _mm256_storeu_pd(out + r * ldo + j, acc[r][0]);
            _mm256_storeu_pd(out + r * ldo + j + 4, acc[r][1]);
        }
    }
#endif
    for (; j < n; ++j) {
        for (index_t r = 0; r < kTile; ++r) {
            double s = 0.0;
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
// is fixed by n alone (4 lanes, folded in a fixed order, then the scalar tail).
PYENGINE_ALWAYS_INLINE void weighted_sums(const double* w, index_t ldw, const double* bt, index_t m,
                                          index_t ld, index_t n, const double* scale,
                                          double* out) {
    index_t c = 0;
#ifdef __AVX__
    const index_t n4 = n - n % 4;
    for (; c + 2 <= m; c += 2) {
        const double *b0 = bt + c * ld, *b1 = b0 + ld;
        __m256d acc[kTile][2];
        for (auto& r : acc) r[0] = r[1] = _mm256_setzero_pd();
        for (index_t j = 0; j < n4; j += 4) {
            const __m256d v0 = _mm256_loadu_pd(b0 + j), v1 = _mm256_loadu_pd(b1 + j);
            for (index_t r = 0; r < kTile; ++r) {
                const __m256d wr = _mm256_loadu_pd(w + r * ldw + j);
                acc[r][0] = vmadd(wr, v0, acc[r][0]);
                acc[r][1] = vmadd(wr, v1, acc[r][1]);
            }
        }
        for (index_t r = 0; r < kTile; ++r) {
            double s0 = sum_lanes(acc[r][0]), s1 = sum_lanes(acc[r][1]);
            for (index_t j = n4; j < n; ++j) {
                s0 = madd(w[r * ldw + j], b0[j], s0);
                s1 = madd(w[r * ldw + j], b1[j], s1);
            }
            out[r * m + c] = scale[r] * s0;
            out[r * m + c + 1] = scale[r] * s1;
        }
    }
    for (; c < m; ++c) {
        const double* b0 = bt + c * ld;
        __m256d acc[kTile];
        for (auto& r : acc) r = _mm256_setzero_pd();
        for (index_t j = 0; j < n4; j += 4) {
            const __m256d v0 = _mm256_loadu_pd(b0 + j);
            for (index_t r = 0; r < kTile; ++r) {
                acc[r] = vmadd(_mm256_loadu_pd(w + r * ldw + j), v0, acc[r]);
            }
        }
        for (index_t r = 0; r < kTile; ++r) {
            double s0 = sum_lanes(acc[r]);
            for (index_t j = n4; j < n; ++j) {
                s0 = madd(w[r * ldw + j], b0[j], s0);
            }
            out[r * m + c] = scale[r] * s0;
        }
    }
#endif
    for (; c < m; ++c) {  // without AVX: every column here, in the same order as above
        for (index_t r = 0; r < kTile; ++r) {
            double s0 = 0.0;
            for (index_t j = 0; j < n; ++j) {
                s0 = madd(w[r * ldw + j], bt[c * ld + j], s0);
            }
            out[r * m + c] = scale[r] * s0;
        }
    }
}

// dst (cols, rows) double = the transpose of src (rows, cols) of T, rows split over the team.
template <class T>
void transpose_into(const T* src, index_t rows, index_t cols, double* dst) {
#pragma omp for schedule(static)
    for (index_t r = 0; r < rows; ++r) {
        for (index_t c = 0; c < cols; ++c) {
            dst[c * rows + r] = static_cast<double>(src[r * cols + c]);
        }
    }
}

// Keys 0 .. vis-1 are visible to query i (written so that a huge offset cannot overflow).
PYENGINE_ALWAYS_INLINE index_t visible_keys(index_t i, index_t offset, index_t tk) {
    return offset >= tk - i ? tk : i + offset + 1;
}

// sum_j a[j] b[j], j in [0, n).
PYENGINE_ALWAYS_INLINE double dot(const double* a, const double* b, index_t n) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (index_t j = 0; j < n; ++j) {
        s += a[j] * b[j];
    }
    return s;
}

template <class T>
PYENGINE_ALWAYS_INLINE void to_double(const T* src, index_t n, double* dst) {
    for (index_t c = 0; c < n; ++c) {
        dst[c] = static_cast<double>(src[c]);
    }
}


// s[j] *= scale for j in [0, n); returns the max of the scaled values (-inf if n = 0). The
// intrinsics because GCC leaves the max reduction of doubles scalar, a chain of dependent
// maxsd that took a fifth of the forward pass. Inputs are finite (validated).
PYENGINE_ALWAYS_INLINE double scale_max(double* s, index_t n, double scale) {
    double m = -std::numeric_limits<double>::infinity();
    index_t j = 0;
#ifdef __AVX__
    const __m256d sc = _mm256_set1_pd(scale);
    __m256d m0 = _mm256_set1_pd(m), m1 = m0;
    for (; j + 8 <= n; j += 8) {
        const __m256d a = _mm256_mul_pd(_mm256_loadu_pd(s + j), sc);
        const __m256d b = _mm256_mul_pd(_mm256_loadu_pd(s + j + 4), sc);
        _mm256_storeu_pd(s + j, a);
        _mm256_storeu_pd(s + j + 4, b);
        m0 = _mm256_max_pd(m0, a);
        m1 = _mm256_max_pd(m1, b);
    }
    m0 = _mm256_max_pd(m0, m1);
    m = std::max(std::max(m0[0], m0[1]), std::max(m0[2], m0[3]));
#endif
    for (; j < n; ++j) {
        s[j] *= scale;
        m = std::max(m, s[j]);
    }
    return m;
}

// Loads the rows t0 .. t0 + kTile - 1 of src (rows, cols) of T into dst (kTile, cols)
// double, zero-filling the rows past `rows`; returns how many rows were real.
template <class T>
index_t load_tile(const T* src, index_t t0, index_t rows, index_t cols, double* dst) {
    const index_t real = std::min(kTile, rows - t0);
    for (index_t r = 0; r < kTile; ++r) {
        for (index_t c = 0; c < cols; ++c) {
            dst[r * cols + c] = r < real ? static_cast<double>(src[(t0 + r) * cols + c]) : 0.0;
        }
    }
    return real;
}

inline std::size_t sz(index_t a) { return static_cast<std::size_t>(a); }

}  // namespace attention_detail
}  // namespace pyengine
