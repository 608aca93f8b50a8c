// Threads, shared by every kernel family: the thread-count setting, the loops over rows
// (count_bad_rows, parallel_for, rows_with_scratch), and the stream_copy machine probe.
// Pure C++17 on raw pointers, no pybind11. The SIMD lanes and the passes over a row are
// in rows.hpp.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#ifdef __AVX__
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define PYENGINE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PYENGINE_ALWAYS_INLINE inline
#endif

namespace pyengine {

using index_t = std::ptrdiff_t;

// Below this many elements of work a parallel region costs more than it saves
// (thread wake-up is a few microseconds), so small calls run on the caller's thread.
inline constexpr index_t kMinParallelWork = index_t{1} << 15;

// The number of threads every kernel uses; the default is OpenMP's (OMP_NUM_THREADS
// or the number of cores). A plain global: set it from one thread, between calls.
inline int g_num_threads = omp_get_max_threads();

inline void set_num_threads(int n) { g_num_threads = std::max(1, n); }
inline int get_num_threads() { return g_num_threads; }

// ---------------------------------------------------------------------------------------
// Threads

// Orders this thread's streaming stores before whatever follows (they are weakly ordered).
inline void store_fence() {
#ifdef __AVX__
    _mm_sfence();
#endif
}

inline int threads_for(index_t n, index_t work) {
    return (n > 1 && n * work >= kMinParallelWork) ? g_num_threads : 1;
}

// Runs bad = row(i) for every row i in [0, n), in parallel over rows, and returns the
// number of rows for which it returned true. Each row is computed whole by one thread
// in a fixed order, so the output does not depend on the number of threads.
// `work` is the number of elements one row touches, to skip threading tiny calls.
template <class RowFn>
std::int64_t count_bad_rows(index_t n, index_t work, RowFn&& row) {
    std::int64_t nbad = 0;
#pragma omp parallel num_threads(threads_for(n, work)) reduction(+ : nbad)
    {
#pragma omp for schedule(static)
        for (index_t i = 0; i < n; ++i) {
            nbad += row(i) ? 1 : 0;
        }
        store_fence();  // once per thread, not per row: a fence waits for the stores to drain
    }
    return nbad;
}

// Runs body(k) for every k in [0, n), in parallel, statically scheduled.
template <class Body>
void parallel_for(index_t n, index_t work, Body&& body) {
#pragma omp parallel num_threads(threads_for(n, work))
    {
#pragma omp for schedule(static)
        for (index_t k = 0; k < n; ++k) {
            body(k);
        }
        store_fence();
    }
}

// Runs bad = row(i, scratch) for every row in [0, n), in parallel over rows, each thread
// with its own scratch from make_scratch(); returns the number of bad rows. Rows take
// different amounts of work (iterations), hence dynamic chunks; every row is computed whole
// by one thread, so results do not depend on the schedule or the number of threads.
template <class MakeScratch, class RowFn>
std::int64_t rows_with_scratch(index_t n, index_t work, MakeScratch&& make_scratch, RowFn&& row) {
    std::int64_t nbad = 0;
#pragma omp parallel num_threads(threads_for(n, work)) reduction(+ : nbad)
    {
        auto scratch = make_scratch();
#pragma omp for schedule(dynamic, 8)
        for (index_t i = 0; i < n; ++i) {
            nbad += row(i, scratch) ? 1 : 0;
        }
    }
    return nbad;
}

// ---------------------------------------------------------------------------------------
// Machine probe

// Copies n bytes, with streaming stores of whole cache lines where AVX allows (as the
// kernels' writing pass does).
inline void copy_streaming(const unsigned char* src, unsigned char* dst, std::size_t n) {
    std::size_t i = 0;
#ifdef __AVX__
    for (; i < n && reinterpret_cast<std::uintptr_t>(dst + i) % 64 != 0; ++i) {
        dst[i] = src[i];
    }
    for (; i + 64 <= n; i += 64) {
        const auto* s = reinterpret_cast<const __m256i*>(src + i);
        auto* p = reinterpret_cast<__m256i*>(dst + i);
        _mm256_stream_si256(p, _mm256_loadu_si256(s));
        _mm256_stream_si256(p + 1, _mm256_loadu_si256(s + 1));
    }
    _mm_sfence();
#endif
    std::memcpy(dst + i, src + i, n - i);
}

// For `pyengine bench`: copies n_bytes from src to dst on all threads, each thread one
// contiguous chunk, so that the measured time gives the machine's streaming copy
// bandwidth: the ceiling of a memory-bound kernel that reads its input once and writes
// its output once. Streaming stores, as in the kernels, so that the two compare alike
// (glibc's memcpy reached only 60-70% of this bandwidth here at these sizes).
inline void stream_copy(const unsigned char* src, unsigned char* dst, std::size_t n_bytes) {
    const int n_threads = g_num_threads;
#pragma omp parallel num_threads(n_threads)
    {
        const auto t = static_cast<std::size_t>(omp_get_thread_num());
        const auto nt = static_cast<std::size_t>(omp_get_num_threads());
        // Chunk edges at multiples of 64 bytes so that no cache line is shared.
        const std::size_t per = ((n_bytes + nt - 1) / nt + 63) / 64 * 64;
        const std::size_t begin = std::min(n_bytes, t * per);
        const std::size_t end = std::min(n_bytes, begin + per);
        if (end > begin) {
            copy_streaming(src + begin, dst + begin, end - begin);
        }
    }
}

}  // namespace pyengine
