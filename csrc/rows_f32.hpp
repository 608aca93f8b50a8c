// The float32 row-writing pass: out[j] = value(lane, j) computed in float, 16 (AVX-512) or
// 8 (AVX2 + FMA) floats per register, for kernels whose float32 output is well conditioned
// in float once its statistics are known in double (LayerNorm's forward pass: see
// layernorm.hpp). rows.hpp's write_row computes in 4-lane double and converts on the way in
// and out, which costs 3 conversions per 4 values; in cache that made the (2048, 768)
// float32 LayerNorm compute-bound. Same structure as write_row: a scalar head up to a
// 64-byte boundary, the body in blocks of 16 (one step of the next row's RowSums per block,
// plain or streaming stores), a scalar tail. The scalar and the vector form do the same
// float operations (FMA spelled out), so a value does not depend on the output's alignment.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "rows.hpp"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PYENGINE_HAVE_F32_ROWS 1
#endif

namespace pyengine {

// One float, with the interface of LanesF32.
struct ScalarF32 {
    using V = float;
    static float load(const float* p) { return *p; }
    static float set1(float a) { return a; }
    static float sub(float a, float b) { return a - b; }
    static float mul(float a, float b) { return a * b; }
    static float fma(float a, float b, float c) { return std::fma(a, b, c); }
};

#ifdef PYENGINE_HAVE_F32_ROWS
#ifdef __AVX512F__
struct LanesF32 {
    static constexpr index_t kWidth = 16;
    using V = __m512;
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static V set1(float a) { return _mm512_set1_ps(a); }
    static V zero() { return _mm512_setzero_ps(); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    // The lanes widened to double and added to acc (8 doubles).
    static void widen_add(__m512d& acc, V v) {
        acc = _mm512_add_pd(acc, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)),
                                               _mm512_cvtps_pd(_mm256_castpd_ps(
                                                   _mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))));
    }
    using D = __m512d;
    static D dzero() { return _mm512_setzero_pd(); }
    static double dsum(D a) {
        alignas(64) double t[8];
        _mm512_store_pd(t, a);
        return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
    }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static void stream(float* p, V v) { _mm512_stream_ps(p, v); }  // p 64-byte aligned
};
#else
struct LanesF32 {
    static constexpr index_t kWidth = 8;
    using V = __m256;
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static V set1(float a) { return _mm256_set1_ps(a); }
    static V zero() { return _mm256_setzero_ps(); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    // The lanes widened to double and added to acc (4 doubles).
    static void widen_add(__m256d& acc, V v) {
        acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))));
    }
    using D = __m256d;
    static D dzero() { return _mm256_setzero_pd(); }
    static double dsum(D a) {
        alignas(32) double t[4];
        _mm256_store_pd(t, a);
        return (t[0] + t[1]) + (t[2] + t[3]);
    }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static void stream(float* p, V v) { _mm256_stream_ps(p, v); }  // p 32-byte aligned
};
#endif

template <class ValueFn, class Sums>
PYENGINE_ALWAYS_INLINE void write_body_f32(float* out, index_t& j, index_t d, bool stream,
                                           ValueFn& value, Sums& sums) {
    constexpr index_t w = LanesF32::kWidth;
    if (stream) {
        for (; j + 16 <= d; j += 16) {
            sums.step();
            for (index_t k = 0; k < 16; k += w) {
                LanesF32::stream(out + j + k, value(LanesF32{}, j + k));
            }
        }
    } else {
        for (; j + 16 <= d; j += 16) {
            sums.step();
            for (index_t k = 0; k < 16; k += w) {
                LanesF32::store(out + j + k, value(LanesF32{}, j + k));
            }
        }
    }
}

// sum_j (x_j - m)^2 over a float row, in float lanes: four accumulators of kWidth floats,
// each adding at most kFlushTerms squares before they are widened into a double
// accumulator, so a float partial sum holds few terms (all positive: its relative error is
// at most about kFlushTerms + 4 float roundings); the tail (d mod 4 kWidth) in double.
// The order of the additions is fixed by d.
inline constexpr index_t kFlushTerms = 8;
PYENGINE_ALWAYS_INLINE double sum_sq_dev_f32(const float* xr, index_t d, float m) {
    using L = LanesF32;
    constexpr index_t w = L::kWidth, block = 4 * w, chunk = kFlushTerms * block;
    const L::V mv = L::set1(m);
    L::D total = L::dzero();
    index_t j = 0;
    for (; j + block <= d;) {
        L::V a0 = L::zero(), a1 = a0, a2 = a0, a3 = a0;
        const index_t stop = std::min(d - d % block, j + chunk);
        for (; j < stop; j += block) {
            const L::V c0 = L::sub(L::load(xr + j), mv), c1 = L::sub(L::load(xr + j + w), mv);
            const L::V c2 = L::sub(L::load(xr + j + 2 * w), mv);
            const L::V c3 = L::sub(L::load(xr + j + 3 * w), mv);
            a0 = L::fma(c0, c0, a0), a1 = L::fma(c1, c1, a1);
            a2 = L::fma(c2, c2, a2), a3 = L::fma(c3, c3, a3);
        }
        L::widen_add(total, L::add(L::add(a0, a1), L::add(a2, a3)));
    }
    double sum = L::dsum(total);
    for (; j < d; ++j) {
        const double c = static_cast<double>(xr[j]) - static_cast<double>(m);
        sum += c * c;
    }
    return sum;
}

// write_row (rows.hpp) for float output computed in float: value(lane, j) with lane
// LanesF32 or ScalarF32. Only where PYENGINE_HAVE_F32_ROWS is defined.
template <class ValueFn, class Next = NoNextRow>
PYENGINE_ALWAYS_INLINE void write_row_f32(float* out, index_t d, bool stream, ValueFn&& value,
                                          Next* next = nullptr) {
    index_t j = 0;
    for (; j < d && reinterpret_cast<std::uintptr_t>(out + j) % 64 != 0; ++j) {
        out[j] = value(ScalarF32{}, j);
    }
    if (next) {
        Next sums = *next;  // a local copy keeps the accumulators in registers (write_row)
        write_body_f32(out, j, d, stream, value, sums);
        next->resume_from(sums);
    } else {
        NoNextRow none;
        write_body_f32(out, j, d, stream, value, none);
    }
    for (; j < d; ++j) {
        out[j] = value(ScalarF32{}, j);
    }
}
#endif

}  // namespace pyengine
