// Row helpers shared by the kernel families: the NaN and scale conventions of a bad row,
// SIMD lanes (row sums and the row-writing pass, with streaming stores), and the row
// pipeline that overlaps one row's writing with the next row's reading. Pure C++17 on
// raw pointers, no pybind11; threads come from parallel.hpp.
// Longer than ~400 lines by exception: every family includes the three parts together and
// they change together (the row pipeline drives RowSums and write_row, which apply the bad-row
// conventions); csrc/ is split by kernel family, not by helper.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "parallel.hpp"

namespace pyengine {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

// A usable scale: var + eps (resp. mean(x^2) + eps) finite and positive. Written so
// that NaN fails it.
inline bool good_scale(double sq) { return std::isfinite(sq) && sq > 0.0; }

// Rows of extreme magnitude (the kernels' "slow path"). The fast path's statistics keep
// full precision while the squared scale sq = var + eps (resp. mean(x^2) + eps) lies in
// [kSafeLow, kSafeHigh]: no square that matters is subnormal and no sum of squares, or of
// products with an ordinary tangent, overflows. Outside that range (rows like 1e-160 or
// 1e+200, or sums that overflowed) a kernel redoes the row's statistics on the row scaled
// by c = 2^-e (row_scale), which is exact, as the reference does for every row; eps is
// scaled with it (var(c x) + c^2 eps). Serial loops in source order: such rows are rare.
inline constexpr double kSafeLow = 0x1p-960;
inline constexpr double kSafeHigh = 0x1p960;
// Written so that NaN fails it; __builtin_expect: the fast path is the expected one.
inline bool safe_scale(double sq, double mu) {
    return __builtin_expect(sq >= kSafeLow && sq <= kSafeHigh && std::isfinite(mu), 1);
}

// c = 2^-e bringing max(max|x|, sqrt(eps)) into [0.5, 1); 1 for a non-finite or zero row.
// e is clipped to [-1022, 1024] (2^1074 is not a double); c^2 eps <= 1 never overflows.
template <class T>
double row_scale(const T* xr, index_t d, double eps) {
    double m = std::sqrt(eps);
    for (index_t i = 0; i < d; ++i) {
        const double a = std::fabs(static_cast<double>(xr[i]));
        if (a > m) {
            m = a;
        } else if (a != a) {
            return 1.0;
        }
    }
    if (!(std::isfinite(m) && m > 0.0)) return 1.0;
    int e = 0;
    std::frexp(m, &e);
    return std::ldexp(1.0, -std::min(std::max(e, -1022), 1024));
}

// Statistics of a row of extreme magnitude: mean (0 for RMSNorm), scale s (or r), and
// k = mean((x - mu) w) / s^2, w_j = w(j) (0 unless want_dot); bad if unusable.
struct SlowStats {
    double mu, scale, k;
    bool bad;
};

// `centre`: LayerNorm (mean removed; an exactly constant row has mean x[0] and variance
// 0, the kernel contract) or RMSNorm (centre 0). `w(j)` returns the tangent w_j in double.
// Out of line and marked cold: the kernels' hot row loops stay as they were without it.
template <class T, class W>
[[gnu::noinline, gnu::cold]] SlowStats slow_stats(const T* xr, index_t d, double eps, bool centre, bool want_dot, W w) {
    const double c = row_scale(xr, d, eps);
    double mu = 0.0;
    bool constant = centre;
    if (centre) {
        double t = 0.0;
        for (index_t i = 0; i < d; ++i) {
            t += static_cast<double>(xr[i]) * c;
            constant = constant && xr[i] == xr[0];
        }
        mu = constant ? static_cast<double>(xr[0]) * c : t / static_cast<double>(d);
    }
    double q = 0.0, dot = 0.0;
    for (index_t i = 0; i < d; ++i) {
        const double xc = constant ? 0.0 : static_cast<double>(xr[i]) * c - mu;
        q += xc * xc;
        if (want_dot) dot += xc * w(i);
    }
    const double sq = q / static_cast<double>(d) + eps * c * c;  // eps * c first: c * c may overflow
    if (!(good_scale(sq) && std::isfinite(dot))) return {0.0, 1.0, 0.0, true};
    // Scaled row: scale sqrt(sq), centre mu; the row's own are sqrt(sq) / c and mu / c, and
    // mean((x - mu) w) / s^2 = c mean(xc w) / sq.
    return {mu / c, std::sqrt(sq) / c, c * (dot / static_cast<double>(d) / sq), false};
}

// Bad rows are rare: plain stores are fine for them.
template <class T>
void write_nan_row(T* out, index_t d) {
    std::fill_n(out, d, static_cast<T>(kNaN));
}

// Outputs larger than this are written with non-temporal stores: they cannot stay
// in the cache anyway (32 MiB L3 on the target machine), and streaming stores skip
// the read-for-ownership that a normal store to an uncached line costs, which is a
// third of the memory traffic of a read-one-write-one kernel. Smaller outputs are
// stored normally so that the caller finds them in cache.
inline constexpr std::size_t kStreamMinBytes = std::size_t{16} << 20;

// ---------------------------------------------------------------------------------------
// SIMD lanes

// Whether an output of `n_elements` values of T should be written with streaming stores.
template <class T>
bool use_streaming_stores(index_t n_elements) {
    return static_cast<std::size_t>(n_elements) * sizeof(T) >= kStreamMinBytes;
}

// Every pass over a row is written once, as a generic lambda term(lane, j) that loads
// through Lane::load(p + j) and computes in double: with `Scalar` it computes element j,
// with `Lanes4` elements j .. j+3 in one AVX register of 4 doubles. Arithmetic is
// spelled with operators, which GCC and Clang also define on vector types (a scalar
// operand is broadcast), so one expression serves both.
// Why not plain `omp simd` loops: GCC vectorizes a float -> double -> float loop 8 floats
// wide, splitting and rejoining registers around every conversion, and its simd
// reductions keep two accumulators, so they wait on the latency of the adds. This 4-wide
// form (converting loads and stores, four accumulators) made the LayerNorm row about
// 1.4x faster in cache on the target machine (Zen 3), which matters because the compute
// does not fully overlap the memory traffic. `omp simd` still vectorizes the tails, and
// every pass in builds without AVX.
struct Scalar {
    template <class T>
    static double load(const T* p) {
        return static_cast<double>(*p);
    }
};

#ifdef __AVX__
struct Lanes4 {
    static __m256d load(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
    static __m256d load(const double* p) { return _mm256_loadu_pd(p); }
    static void store(float* p, __m256d v) { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
    static void store(double* p, __m256d v) { _mm256_storeu_pd(p, v); }
    // Non-temporal: p must be 16-byte (float) or 32-byte (double) aligned.
    static void stream(float* p, __m256d v) { _mm_stream_ps(p, _mm256_cvtpd_ps(v)); }
    static void stream(double* p, __m256d v) { _mm256_stream_pd(p, v); }
};

// The lanes of v summed in a fixed order.
inline double sum_lanes(__m256d v) { return (v[0] + v[1]) + (v[2] + v[3]); }
#endif

#ifdef __AVX512F__
// 8 doubles: RowSums's accumulators hold two Lanes4 ones each (elements j .. j+7), half
// the conversions and adds per block; lo + hi then rebuilds the Lanes4 order exactly.
struct Lanes8 {
    static __m512d load(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
    static __m512d load(const double* p) { return _mm512_loadu_pd(p); }
};
inline __m256d fold(__m512d v) {
    return _mm512_castpd512_pd256(v) + _mm512_extractf64x4_pd(v, 1);
}
#if !defined(PYENGINE_NO_WIDE_SUMS)
#define PYENGINE_WIDE_SUMS 1
#endif
#endif

// Element j of a row, in double, in either lane width.
template <class T>
auto element(const T* row) {
    return [=](auto lane, index_t j) { return decltype(lane)::load(row + j); };
}

// A term that contributes nothing: RowSums with a single sum.
struct NoTerm {};

// Sums over one row, in double: of f(lane, j) and, optionally, of g(lane, j). Blocks of
// kBlock elements go into four vector accumulators per sum, because the loop is bound by
// the latency of the adds, not by their throughput; then the scalar tail. The order of
// the additions is fixed by d alone, so a row's sums do not depend on the thread or the
// number of threads. An object rather than a function so that a row's first pass can
// run alone (finish) or interleaved with the previous row's writing pass (write_row
// steps it), in the same order either way.
// With prefetch_from(a, b), each step also prefetches a and b (the arrays that f and g
// read) kPrefetchBytes ahead: the loop that steps this object also computes and writes
// another row, so too few of its loads are in flight to keep memory busy; prefetching
// made the pipelined LayerNorm about 15% faster.
// kWideSingle: see kWide below (RMSNorm's sum of squares opts out).
template <class F, class G = NoTerm, bool kWideSingle = true>
class RowSums {
  public:
    static constexpr index_t kBlock = 16;
    static constexpr index_t kPrefetchBytes = 4096;

    explicit RowSums(index_t d, F f, G g = {}) : d_(d), f_(f), g_(g) {}

    template <class T>
    RowSums& prefetch_from(const T* a, const T* b = nullptr) {
        a_ = reinterpret_cast<const char*>(a);
        b_ = reinterpret_cast<const char*>(b);
        element_bytes_ = index_t{sizeof(T)};
        return *this;
    }

    // Adds the next block, if one remains (without AVX, finish does all the work).
    void step() {
#ifdef __AVX__
        if (j_ + kBlock > d_) {
            return;
        }
        for (index_t byte = 0; byte < kBlock * element_bytes_; byte += 64) {
            prefetch(a_, byte);
            prefetch(b_, byte);
        }
#ifdef PYENGINE_WIDE_SUMS
        if constexpr (kWide) {
            fa_ += f_(Lanes8{}, j_);  // the lanes of f0 | f1
            fb_ += f_(Lanes8{}, j_ + 8);  // of f2 | f3
            j_ += kBlock;
            return;
        }
#endif
        f0_ += f_(Lanes4{}, j_);
        f1_ += f_(Lanes4{}, j_ + 4);
        f2_ += f_(Lanes4{}, j_ + 8);
        f3_ += f_(Lanes4{}, j_ + 12);
        if constexpr (kTwo) {
            g0_ += g_(Lanes4{}, j_);
            g1_ += g_(Lanes4{}, j_ + 4);
            g2_ += g_(Lanes4{}, j_ + 8);
            g3_ += g_(Lanes4{}, j_ + 12);
        }
        j_ += kBlock;
#endif
    }

    // Takes over the progress of `copy`, a copy of this object that was stepped instead.
    void resume_from(const RowSums& copy) {
        j_ = copy.j_;
#ifdef PYENGINE_WIDE_SUMS
        fa_ = copy.fa_, fb_ = copy.fb_;
#endif
#ifdef __AVX__
        f0_ = copy.f0_, f1_ = copy.f1_, f2_ = copy.f2_, f3_ = copy.f3_;
        g0_ = copy.g0_, g1_ = copy.g1_, g2_ = copy.g2_, g3_ = copy.g3_;
#endif
    }

    // Adds what remains; returns (sum of f, sum of g).
    std::pair<double, double> finish() {
        double sf = 0.0;
        double sg = 0.0;
#ifdef __AVX__
        while (j_ + kBlock <= d_) {
            step();
        }
        sf = sum_lanes((f0_ + f1_) + (f2_ + f3_));
        if constexpr (kTwo) {
            sg = sum_lanes((g0_ + g1_) + (g2_ + g3_));
        }
#ifdef PYENGINE_WIDE_SUMS
        if constexpr (kWide) {
            sf = sum_lanes(fold(fa_) + fold(fb_));  // (f0 + f1) + (f2 + f3), as above
        }
#endif
#endif
        double f_tail = 0.0;
        double g_tail = 0.0;
#pragma omp simd reduction(+ : f_tail, g_tail)
        for (index_t k = j_; k < d_; ++k) {
            f_tail += f_(Scalar{}, k);
            if constexpr (kTwo) {
                g_tail += g_(Scalar{}, k);
            }
        }
        return {sf + f_tail, sg + g_tail};
    }

  private:
    static constexpr bool kTwo = !std::is_same_v<G, NoTerm>;
    // A single sum accumulates in 8-double registers (AVX-512): with the float output
    // pass, LayerNorm's forward in cache 1.35x faster. Two sums keep the eight 4-double
    // accumulators: with 8-double ones they had half the independent add chains, and the
    // JVP was 5 % slower. RMSNorm's sum of squares opts out: with the wide form its forward
    // measured a few per cent slower.
    static constexpr bool kWide = !kTwo && kWideSingle;

#ifdef __AVX__
    // Prefetching never faults, so running past the end of the array is harmless.
    void prefetch(const char* p, index_t byte) const {
        if (p != nullptr) {
            _mm_prefetch(p + j_ * element_bytes_ + kPrefetchBytes + byte, _MM_HINT_T0);
        }
    }
#endif

    index_t d_;
    F f_;
    G g_;
    index_t j_ = 0;
    const char* a_ = nullptr;
    const char* b_ = nullptr;
    index_t element_bytes_ = 0;
#ifdef PYENGINE_WIDE_SUMS
    __m512d fa_ = _mm512_setzero_pd(), fb_ = fa_;
#endif
#ifdef __AVX__
    __m256d f0_ = _mm256_setzero_pd(), f1_ = f0_, f2_ = f0_, f3_ = f0_;
    __m256d g0_ = f0_, g1_ = f0_, g2_ = f0_, g3_ = f0_;
#endif
};

// sum_j f(lane, j) (and sum_j g(lane, j)) over a row of length d that is in cache.
template <class F, class G = NoTerm>
std::pair<double, double> row_sums(index_t d, F f, G g = {}) {
    return RowSums(d, f, g).finish();
}

// What write_row steps when there is no next row.
struct NoNextRow {
    void step() {}
    void resume_from(const NoNextRow&) {}
};

#ifdef __AVX__
// The vector body of write_row: out[j .. ) in blocks of 16 from a 64-byte aligned j, one
// step of `sums` (a block of the same size) per block. Forced inline: when GCC outlined
// it, the closures and the accumulators went through memory in the hot loop (2x slower).
template <class T, class ValueFn, class Sums>
PYENGINE_ALWAYS_INLINE void write_body(T* out, index_t& j, index_t d, bool stream,
                                       ValueFn& value, Sums& sums) {
    if (stream) {
        for (; j + 16 <= d; j += 16) {
            sums.step();
            for (index_t k = 0; k < 16; k += 4) {
                Lanes4::stream(out + j + k, value(Lanes4{}, j + k));
            }
        }
    } else {
        for (; j + 16 <= d; j += 16) {
            sums.step();
            for (index_t k = 0; k < 16; k += 4) {
                Lanes4::store(out + j + k, value(Lanes4{}, j + k));
            }
        }
    }
}
#endif

// Writes out[j] = value(lane, j) for j in [0, d), cast to T. With `stream` the aligned
// body goes through non-temporal stores, fenced by the thread loops. If `next` is given
// (the RowSums of the next row), one block of it is added per block written.
template <class T, class ValueFn, class Next = NoNextRow>
PYENGINE_ALWAYS_INLINE void write_row(T* out, index_t d, bool stream, ValueFn&& value,
                                      Next* next = nullptr) {
    index_t j = 0;
#ifdef __AVX__
    // Scalar head up to a cache-line boundary: streaming stores must be aligned, and
    // they are fast only when they fill whole lines in order (a 32-byte offset cost 15%,
    // a 16-byte offset, which NumPy's large arrays have, 50%).
    for (; j < d && reinterpret_cast<std::uintptr_t>(out + j) % 64 != 0; ++j) {
        out[j] = static_cast<T>(value(Scalar{}, j));
    }
    if (next) {
        // Step a local copy: the accumulators are __m256d, which may alias the output, so
        // those of *next would stay in memory across the stores instead of in registers.
        Next sums = *next;
        write_body(out, j, d, stream, value, sums);
        next->resume_from(sums);
    } else {
        NoNextRow none;
        write_body(out, j, d, stream, value, none);
    }
#else
    (void)stream;
    (void)next;
#endif
#pragma omp simd
    for (index_t k = j; k < d; ++k) {
        out[k] = static_cast<T>(value(Scalar{}, k));
    }
}

// ---------------------------------------------------------------------------------------
// Row pipeline

// Runs bad = row(i, sums, next) for every row i in [0, n) and returns the number of bad
// rows, like count_bad_rows, as a pipeline: each thread takes one contiguous block of
// rows; row i gets `sums`, the first-pass sums of row i (first_pass(i).finish()), and
// `next`, first_pass(i + 1) (nullptr at the end of the block), for its writing pass to
// step. Row i + 1 then streams in from memory while row i streams out. A thread that
// reads a row, then computes, then writes leaves memory idle between the phases; the
// pipeline made LayerNorm about 1.15x faster (1.3x with the prefetching of RowSums).
template <class FirstPass, class RowFn>
std::int64_t count_bad_rows_pipelined(index_t n, index_t work, FirstPass&& first_pass,
                                      RowFn&& row) {
    // The rows [begin, end) of one thread; returns their bad-row count.
    auto block = [&](index_t begin, index_t end) {
        std::int64_t bad = 0;
        if (begin < end) {
            auto sums = first_pass(begin).finish();
            for (index_t i = begin; i < end; ++i) {
                const bool has_next = i + 1 < end;
                auto next = first_pass(has_next ? i + 1 : i);
                bad += row(i, sums, has_next ? &next : nullptr) ? 1 : 0;
                if (has_next) {
                    sums = next.finish();  // completes what the writing pass did not add
                }
            }
        }
        store_fence();
        return bad;
    };
    const int threads = threads_for(n, work);
    if (threads == 1) {  // a small call (one token): no parallel region, whose start costs
        return block(0, n);  // about as much as a d = 768 row
    }
    std::int64_t nbad = 0;
#pragma omp parallel num_threads(threads) reduction(+ : nbad)
    {
        const auto t = static_cast<index_t>(omp_get_thread_num());
        const auto nt = static_cast<index_t>(omp_get_num_threads());
        nbad += block(n * t / nt, n * (t + 1) / nt);
    }
    return nbad;
}

}  // namespace pyengine
