// Batched Newton–Schulz orthogonalization (kernel id newton_schulz); the contract and the
// mathematics are in pyengine/kernels/_reference/orthogonalize.py.
//
// Pure C++17 on raw pointers. The products are BLAS calls through function pointers that
// the caller supplies (Fortran BLAS: column-major, every argument by pointer): the
// bindings take them from SciPy's scipy.linalg.cython_blas, the BLAS that NumPy/SciPy
// users already have, so no BLAS is linked here. A row-major (m, n) matrix X is the
// column-major n x m matrix Xc = Xᵀ, so with s = min(m, n), per step:
//   m <= n:  A = X Xᵀ = Xcᵀ Xc      syrk(U, T)          X' = a X + P X  ⇔  Xc' = a Xc + Xc P
//   m >  n:  A = Xᵀ X = Xc Xcᵀ      syrk(U, N)          X' = a X + X P  ⇔  Xc' = a Xc + P Xc
// with P = b A + c A² = b A + c A Aᵀ (a second syrk, with beta = b on a copy of A; with c = 0,
// P = b A is folded into the last gemm's alpha). syrk fills one triangle of a symmetric
// result (half the flops of a gemm, as numpy's X @ X.T); the other is mirrored before use.
// Per step: s² l + s³ + 2 s² l flops (4 n³ for a square n x n matrix, not 6 n³).
// The norm is summed in float64 over fixed chunks in a fixed order, so results do not
// depend on the number of threads (BLAS's own threading aside).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.hpp"

namespace pyengine {

// Fortran BLAS entry points (LP64: int dimensions), as scipy.linalg.cython_blas exports them.
template <class T>
struct Blas {
    using gemm_t = void (*)(char* transa, char* transb, int* m, int* n, int* k, T* alpha, T* a,
                            int* lda, T* b, int* ldb, T* beta, T* c, int* ldc);
    using syrk_t = void (*)(char* uplo, char* trans, int* n, int* k, T* alpha, T* a, int* lda,
                            T* beta, T* c, int* ldc);
    gemm_t gemm = nullptr;
    syrk_t syrk = nullptr;
};

namespace detail {

inline constexpr index_t kNormChunk = 1 << 14;

// ||x||_F in float64: chunk sums in parallel, added in chunk order.
template <class T>
double frobenius(const T* x, index_t size) {
    const index_t chunks = (size + kNormChunk - 1) / kNormChunk;
    std::vector<double> part(static_cast<std::size_t>(chunks), 0.0);
    parallel_for(chunks, kNormChunk, [&](index_t c) {
        const index_t lo = c * kNormChunk, hi = std::min(size, lo + kNormChunk);
        double acc = 0.0;
        for (index_t i = lo; i < hi; ++i) {
            const double v = static_cast<double>(x[i]);
            acc += v * v;
        }
        part[static_cast<std::size_t>(c)] = acc;
    });
    double total = 0.0;
    for (double p : part) total += p;
    return std::sqrt(total);
}

// Mirror the upper triangle of the column-major s x s matrix a into its lower triangle.
template <class T>
void mirror_upper(T* a, index_t s) {
    parallel_for(s, s, [&](index_t j) {
        for (index_t i = j + 1; i < s; ++i) a[i + j * s] = a[j + i * s];
    });
}

template <class T>
void copy(const T* src, T* dst, index_t size) {
    parallel_for((size + kNormChunk - 1) / kNormChunk, kNormChunk, [&](index_t c) {
        const index_t lo = c * kNormChunk, hi = std::min(size, lo + kNormChunk);
        std::memcpy(dst + lo, src + lo, static_cast<std::size_t>(hi - lo) * sizeof(T));
    });
}

}  // namespace detail

// Steps coeffs (steps x 3, row-major (a, b, c) per step) on each of the `batch` row-major
// m x n matrices of g, each divided by its Frobenius norm first, into out. Returns the
// number of bad matrices (non-finite norm; their out is unspecified). Zero matrices give 0.
template <class T>
std::int64_t newton_schulz(const T* g, index_t batch, index_t m, index_t n, const double* coeffs,
                           index_t steps, const Blas<T>& blas, T* out) {
    const index_t s = std::min(m, n), size = m * n;
    const bool wide = m <= n;
    std::vector<T> gram(static_cast<std::size_t>(s * s)), poly(static_cast<std::size_t>(s * s)),
        next(static_cast<std::size_t>(size));
    int is = static_cast<int>(s), il = static_cast<int>(std::max(m, n)), in = static_cast<int>(n);
    char U = 'U', N = 'N', Tr = 'T';
    std::int64_t bad = 0;
    for (index_t k = 0; k < batch; ++k) {
        const T* gk = g + k * size;
        T* ok = out + k * size;
        const double nrm = detail::frobenius(gk, size);
        if (!std::isfinite(nrm)) {
            ++bad;
            continue;
        }
        if (nrm == 0.0) {
            std::fill(ok, ok + size, T(0));
            continue;
        }
        const T inv = static_cast<T>(1.0 / nrm);
        parallel_for((size + detail::kNormChunk - 1) / detail::kNormChunk, detail::kNormChunk,
                     [&](index_t c) {
                         const index_t lo = c * detail::kNormChunk;
                         const index_t hi = std::min(size, lo + detail::kNormChunk);
                         for (index_t i = lo; i < hi; ++i) ok[i] = gk[i] * inv;
                     });
        T* x = ok;           // the iterate, column-major n x m (= row-major m x n)
        T* y = next.data();  // the next iterate
        for (index_t st = 0; st < steps; ++st) {
            T a = static_cast<T>(coeffs[3 * st]), b = static_cast<T>(coeffs[3 * st + 1]),
              c = static_cast<T>(coeffs[3 * st + 2]);
            T one = 1, zero = 0;
            // gram = Xᵀ-side Gram matrix (upper triangle), then mirrored.
            blas.syrk(&U, wide ? &Tr : &N, &is, &il, &one, x, &in, &zero, gram.data(), &is);
            detail::mirror_upper(gram.data(), s);
            T* p = gram.data();
            T alpha = b;
            if (c != T(0)) {  // P = b A + c A Aᵀ (A symmetric): a second syrk, one triangle
                std::memcpy(poly.data(), gram.data(), static_cast<std::size_t>(s * s) * sizeof(T));
                blas.syrk(&U, &N, &is, &is, &c, gram.data(), &is, &b, poly.data(), &is);
                detail::mirror_upper(poly.data(), s);
                p = poly.data();
                alpha = one;
            }
            detail::copy(x, y, size);  // y = x, then y = a y + (alpha P) applied to x
            if (wide) {                // Xc' = a Xc + Xc P: (n x m) = (n x m)(m x m)
                int im = static_cast<int>(m);
                blas.gemm(&N, &N, &in, &im, &im, &alpha, x, &in, p, &is, &a, y, &in);
            } else {  // Xc' = a Xc + P Xc: (n x m) = (n x n)(n x m)
                int im = static_cast<int>(m);
                blas.gemm(&N, &N, &in, &im, &in, &alpha, p, &is, x, &in, &a, y, &in);
            }
            std::swap(x, y);
        }
        if (x != ok) detail::copy(x, ok, size);  // an odd number of steps ends in `next`
    }
    return bad;
}

}  // namespace pyengine
