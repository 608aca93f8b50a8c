// The dense layers in bf16 (kernel ids linear_bf16, linear_act_bf16, linear_mul_bf16): the
// contract of linear.hpp with the product x @ w computed from bf16 operands with float32
// accumulation, by MKL's cblas_gemm_bf16bf16f32_compute (AVX512-BF16 / AMX-BF16):
//   - w (k, n) is converted to bf16 (round to nearest even) and packed by MKL once
//     (linear_bf16_pack: an opaque byte buffer the caller keeps with the weights);
//   - each row tile of x (float32) is rounded to bf16 (nearest even; NaN stays NaN) into a
//     per-thread buffer, then multiplied with the packed w into the float32 result;
//   - the epilogue (bias, residual, activation, coefficient) is linear.hpp's, in float32;
//     gelu_tanh is computed all in float (GeluTanhFloat: <= 1e-5 relative, half the cost).
// Tiles are full-width row tiles (the packed w cannot be cut into columns). MKL runs
// sequentially in each OpenMP thread, as for the float32 products (blas_region).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "linear.hpp"

namespace pyengine {

// MKL's bf16 gemm entry points (LP64: int dimensions, as the sgemm handed over).
struct LinearBf16 {
    using size_t_fn = std::size_t (*)(int, int, int, int);
    using pack_fn = void (*)(int, int, int, int, int, int, const std::uint16_t*, int, std::uint16_t*);
    using compute_fn = void (*)(int, int, int, int, int, int, float, const std::uint16_t*, int, const std::uint16_t*,
                                int, float, float*, int);
    size_t_fn pack_get_size = nullptr;
    pack_fn pack = nullptr;
    compute_fn compute = nullptr;
    bool ready() const { return pack_get_size != nullptr && pack != nullptr && compute != nullptr; }
};

inline constexpr int kCblasPacked = 151, kCblasBMatrix = 162;

// float32 -> bf16, round to nearest even; NaN -> quiet NaN of the same sign.
PYENGINE_ALWAYS_INLINE std::uint16_t to_bf16(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const std::uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return static_cast<std::uint16_t>(nan ? ((u >> 16) | 0x40u) : r);
}

inline void to_bf16_rows(const float* x, index_t count, std::uint16_t* o) {
#pragma omp simd
    for (index_t j = 0; j < count; ++j) o[j] = to_bf16(x[j]);
}

// Bytes of the packed w (k, n).
inline std::size_t bf16_packed_size(const LinearBf16& bf, index_t k, index_t n) {
    return bf.pack_get_size(kCblasBMatrix, 1, static_cast<int>(n), static_cast<int>(k));
}

// w (k, n) float32 -> its bf16 copy packed by MKL into dest (bf16_packed_size bytes).
inline void bf16_pack(const LinearBf16& bf, const float* w, index_t k, index_t n, void* dest) {
    std::vector<std::uint16_t> wb(static_cast<std::size_t>(k * n));
    to_bf16_rows(w, k * n, wb.data());
    bf.pack(kCblasRowMajor, kCblasBMatrix, kCblasNoTrans, 1, static_cast<int>(n), static_cast<int>(k), wb.data(),
            static_cast<int>(n), static_cast<std::uint16_t*>(dest));
}

namespace linear_detail {

// The product of the bf16 kernels (full-width row tiles): dst = bf16(x[r0:r1]) @ packed w + beta dst.
struct Bf16Product {
    const LinearBf16& bf;
    const float* x;
    const std::uint16_t* wp;
    index_t k, n;
    static constexpr bool full_width = true;
    static constexpr bool float_gelu_tanh = true;  // the operands' 2^-8 dwarfs its 1e-5
    void operator()(index_t r0, index_t r1, index_t, index_t, float beta, float* dst, index_t ldc) const {
        if (r1 <= r0) return;
        thread_local std::vector<std::uint16_t> xb;
        xb.resize(static_cast<std::size_t>((r1 - r0) * k));
        to_bf16_rows(x + r0 * k, (r1 - r0) * k, xb.data());
        bf.compute(kCblasRowMajor, kCblasNoTrans, kCblasPacked, static_cast<int>(r1 - r0), static_cast<int>(n),
                   static_cast<int>(k), 1.0f, xb.data(), static_cast<int>(k), wp, static_cast<int>(n), beta, dst,
                   static_cast<int>(ldc));
    }
};

}  // namespace linear_detail

/// out = bf16(x) @ w_packed (+ b) (+ r), float32; r may be out itself.
inline std::int64_t linear_bf16(const LinearBlas& blas, const LinearBf16& bf, const float* x, const void* wp,
                                const float* b, const float* r, index_t N, index_t k, index_t n, float* out) {
    const linear_detail::Bf16Product p{bf, x, static_cast<const std::uint16_t*>(wp), k, n};
    return linear_detail::linear_with(blas, p, b, r, N, k, n, out);
}

/// u = bf16(x) @ w_packed (+ b), out = act(u); u may be nullptr.
inline std::int64_t linear_act_bf16(const LinearBlas& blas, const LinearBf16& bf, const float* x, const void* wp,
                                    const float* b, Act act, index_t N, index_t k, index_t n, float* u, float* out) {
    const linear_detail::Bf16Product p{bf, x, static_cast<const std::uint16_t*>(wp), k, n};
    return linear_detail::linear_act_with(blas, p, b, act, N, k, n, u, out);
}

/// out = (bf16(x) @ w_packed) * coef, coef (M, n): row i uses coef[i % M].
inline std::int64_t linear_mul_bf16(const LinearBlas& blas, const LinearBf16& bf, const float* x, const void* wp,
                                    const float* coef, index_t M, index_t N, index_t k, index_t n, float* out) {
    const linear_detail::Bf16Product p{bf, x, static_cast<const std::uint16_t*>(wp), k, n};
    return linear_detail::linear_mul_with(blas, p, coef, M, N, k, n, out);
}

}  // namespace pyengine
