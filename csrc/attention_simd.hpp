// The vector layer of the attention tiles (attention_tiles.hpp): madd (a scalar fused
// multiply-add), vmadd and Simd<C> (one vector register of the compute type C, with the
// operations the tiles use: AVX-512 where the build has it, else AVX), and in_register.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "parallel.hpp"
#include "rows.hpp"

namespace pyengine {
namespace attention_detail {

// a * b + c, rounded once where the machine has FMA (the vector and scalar paths agree).
PYENGINE_ALWAYS_INLINE double madd(double a, double b, double c) {
#ifdef __FMA__
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}
PYENGINE_ALWAYS_INLINE float madd(float a, float b, float c) {
#ifdef __FMA__
    return std::fmaf(a, b, c);
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
PYENGINE_ALWAYS_INLINE __m256 vmadd(__m256 a, __m256 b, __m256 c) {
#ifdef __FMA__
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

// One vector register of C: W lanes, with the operations the tiles use. AVX-512 where the
// build has it (-march=native on a machine with it: 16 floats or 8 doubles a register; on
// Zen 4 the 512-bit operations are double-pumped, so the gain is in the instructions and
// loads per multiply-add, not in the FMA rate), else AVX (8 floats or 4 doubles).
template <class C>
struct Simd;
#ifdef __AVX512F__
PYENGINE_ALWAYS_INLINE __m512d vmadd(__m512d a, __m512d b, __m512d c) { return _mm512_fmadd_pd(a, b, c); }
PYENGINE_ALWAYS_INLINE __m512 vmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
template <>
struct Simd<double> {
    using V = __m512d;
    static constexpr index_t W = 8;
    static V load(const double* p) { return _mm512_loadu_pd(p); }
    static void store(double* p, V v) { _mm512_storeu_pd(p, v); }
    static V set1(double x) { return _mm512_set1_pd(x); }
    static V zero() { return _mm512_setzero_pd(); }
    static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
    static V add(V a, V b) { return _mm512_add_pd(a, b); }
    static V max(V a, V b) { return _mm512_max_pd(a, b); }
    // The lanes folded in a fixed order: the two halves added, then as the AVX version.
    static double sum(V v) {
        return sum_lanes(_mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1)));
    }
    static double hmax(V v) { return _mm512_reduce_max_pd(v); }
    // The first n < W lanes (the rest of a load are 0, of a store untouched; masked lanes
    // are never read or written, so a tail past the end of an array is safe).
    static __mmask8 first(index_t n) { return static_cast<__mmask8>((1u << n) - 1u); }
    static V load_first(const double* p, index_t n) { return _mm512_maskz_loadu_pd(first(n), p); }
    static void store_first(double* p, index_t n, V v) { _mm512_mask_storeu_pd(p, first(n), v); }
};
template <>
struct Simd<float> {
    using V = __m512;
    static constexpr index_t W = 16;
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V zero() { return _mm512_setzero_ps(); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    // The lanes folded in a fixed order: 16 -> 8 -> 4 (halves added), then ((0+1) + (2+3)).
    static float sum(V v) {
        const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        return (h[0] + h[1]) + (h[2] + h[3]);
    }
    static float hmax(V v) { return _mm512_reduce_max_ps(v); }
    static __mmask16 first(index_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
    static V load_first(const float* p, index_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
    static void store_first(float* p, index_t n, V v) { _mm512_mask_storeu_ps(p, first(n), v); }
};
#else
template <>
struct Simd<double> {
    using V = __m256d;
    static constexpr index_t W = 4;
    static V load(const double* p) { return _mm256_loadu_pd(p); }
    static void store(double* p, V v) { _mm256_storeu_pd(p, v); }
    static V set1(double x) { return _mm256_set1_pd(x); }
    static V zero() { return _mm256_setzero_pd(); }
    static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
    static V add(V a, V b) { return _mm256_add_pd(a, b); }
    static V max(V a, V b) { return _mm256_max_pd(a, b); }
    static double sum(V v) { return sum_lanes(v); }
    static double hmax(V v) { return std::max(std::max(v[0], v[1]), std::max(v[2], v[3])); }
};
template <>
struct Simd<float> {
    using V = __m256;
    static constexpr index_t W = 8;
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V zero() { return _mm256_setzero_ps(); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    // The lanes folded in a fixed order: ((0+4) + (1+5)) + ((2+6) + (3+7)).
    static float sum(V v) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        return (h[0] + h[1]) + (h[2] + h[3]);
    }
    static float hmax(V v) {
        const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        return std::max(std::max(h[0], h[1]), std::max(h[2], h[3]));
    }
};
#endif

// Keeps v in a register: GCC otherwise folds a vector loaded once into every multiply-add
// that uses it as a memory operand, so a tile re-reads it once per row (the loads, not the
// multiply-adds, then bound the loop). An empty asm statement; the arithmetic is unchanged.
template <class V>
PYENGINE_ALWAYS_INLINE void in_register(V& v) {
    asm("" : "+v"(v));
}
#endif

}  // namespace attention_detail
}  // namespace pyengine
