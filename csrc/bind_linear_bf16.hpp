// Bindings of the bf16 dense-layer kernels (linear_bf16.hpp): register_linear_bf16(m) defines
// set_blas_bf16 / linear_bf16_info / linear_bf16_ready, linear_bf16_pack (a weight's packed
// bf16 copy) and linear_bf16, linear_act_bf16, linear_mul_bf16 (float32 x, packed w).
//
// MKL's cblas_gemm_bf16bf16f32 pack / compute addresses are found in Python
// (pyengine.kernels._blas.find_bf16: only where MKL is the BLAS handed over by set_blas and
// the CPU has AVX512-BF16 or AMX-BF16) and handed over by pyengine.kernels._cpp. Without them
// every bf16 kernel raises RuntimeError with the reason: there is no fallback.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "bind_linear.hpp"
#include "linear_bf16.hpp"

namespace pyengine::bind {

struct Bf16State {
    pyengine::LinearBf16 bf;
    std::string info = "bf16 products not handed over (pyengine.kernels._cpp calls set_blas_bf16)";
};

inline Bf16State& bf16_state() {
    static Bf16State s;
    return s;
}

// The bf16 entry points, or RuntimeError with the reason they are missing; the float32 BLAS
// must be on as well (its per-thread count setter is used, and its fallback is refused).
inline pyengine::LinearBf16 bf16_ready_or_raise() {
    const Bf16State& s = bf16_state();
    if (!s.bf.ready()) throw std::runtime_error("bf16 products unavailable: " + s.info);
    if (!linear_fast()) throw std::runtime_error("bf16 products unavailable: the linear kernels' BLAS path is off");
    return s.bf;
}

// (N, k, n) of x (N, k) times a packed (k, n) w; checks wp, b and out.
inline std::array<index_t, 3> bf16_dims(const pyengine::LinearBf16& bf, const carray<float>& x,
                                        const carray<std::uint8_t>& wp, const std::optional<carray<float>>& b,
                                        const carray<float>& out) {
    if (x.ndim() != 2) throw std::invalid_argument("x must be 2-D (N, k), got shape " + shape_str(x));
    if (out.ndim() != 2 || out.shape(0) != x.shape(0)) {
        throw std::invalid_argument("out must have shape (" + std::to_string(x.shape(0)) + ", n), got " +
                                    shape_str(out));
    }
    const index_t N = x.shape(0), k = x.shape(1), n = out.shape(1);
    if (k == 0 || n == 0) throw std::invalid_argument("x and out must have k > 0 and n > 0 columns");
    const auto size = static_cast<index_t>(pyengine::bf16_packed_size(bf, k, n));
    if (wp.ndim() != 1 || wp.shape(0) != size) {
        throw std::invalid_argument("wp must be the packed (" + std::to_string(k) + ", " + std::to_string(n) +
                                    ") weight of linear_bf16_pack (" + std::to_string(size) + " bytes), got " +
                                    shape_str(wp));
    }
    if (b) expect_shape(*b, "b", {n});
    no_overlap(out, "out", x, "x");
    return {N, k, n};
}

inline void register_linear_bf16(py::module_& m) {
    using F = carray<float>;
    using OF = std::optional<carray<float>>;
    m.def(
        "set_blas_bf16",
        [](std::uintptr_t pack_get_size, std::uintptr_t pack, std::uintptr_t compute, const std::string& info) {
            Bf16State& s = bf16_state();
            s.bf.pack_get_size = reinterpret_cast<pyengine::LinearBf16::size_t_fn>(pack_get_size);
            s.bf.pack = reinterpret_cast<pyengine::LinearBf16::pack_fn>(pack);
            s.bf.compute = reinterpret_cast<pyengine::LinearBf16::compute_fn>(compute);
            s.info = info;
        },
        py::arg("pack_get_size"), py::arg("pack"), py::arg("compute"), py::arg("info"),
        "Hand over MKL's cblas_gemm_bf16bf16f32_pack_get_size / _pack / _compute (LP64; 0: none) and their "
        "description, or the reason they are missing.");
    m.def(
        "linear_bf16_info", [] { return bf16_state().info; },
        "The bf16 products' library, or why they are unavailable, in words.");
    m.def(
        "linear_bf16_ready", [] { return bf16_state().bf.ready() && linear_fast(); },
        "Whether the bf16 kernels run (MKL's bf16 gemm handed over and the BLAS path on).");
    m.def(
        "linear_bf16_pack",
        [](const F& w) {
            const pyengine::LinearBf16 bf = bf16_ready_or_raise();
            if (w.ndim() != 2 || w.shape(0) == 0 || w.shape(1) == 0) {
                throw std::invalid_argument("w must be 2-D (k, n) with k, n > 0, got shape " + shape_str(w));
            }
            const index_t k = w.shape(0), n = w.shape(1);
            py::array_t<std::uint8_t> out(static_cast<py::ssize_t>(pyengine::bf16_packed_size(bf, k, n)));
            const float* src = w.data();
            void* dst = out.mutable_data();
            py::gil_scoped_release release;  // raw buffers only
            pyengine::bf16_pack(bf, src, k, n, dst);
            return out;
        },
        py::arg("w").noconvert(), "w (k, n) float32 rounded to bf16 and packed by MKL: a uint8 buffer for wp.");
    m.def(
        "linear_bf16",
        [](const F& x, const carray<std::uint8_t>& wp, const OF& b, const OF& r, F& out) {
            const pyengine::LinearBf16 bf = bf16_ready_or_raise();
            const auto [N, k, n] = bf16_dims(bf, x, wp, b, out);
            const bool inplace = r && r->data() == out.data();
            if (r) {
                expect_shape(*r, "r", {N, n});
                if (!inplace) no_overlap(out, "out", *r, "r (unless r is out itself)");
            }
            if (N == 0) return std::int64_t{0};
            const pyengine::LinearBlas blas = linear_state().blas;
            const float *xp = x.data(), *bp = ptr(b), *rp = ptr(r);
            const void* w = wp.data();
            float* op = out.mutable_data();
            py::gil_scoped_release release;  // raw buffers and MKL only
            return pyengine::linear_bf16(blas, bf, xp, w, bp, rp, N, k, n, op);
        },
        py::arg("x").noconvert(), py::arg("wp").noconvert(), py::arg("b").noconvert().none(true),
        py::arg("r").noconvert().none(true), py::arg("out").noconvert(),
        "out = bf16(x) @ wp (+ b) (+ r), float32 accumulation (r may be out); returns the rows with NaN/Inf.");
    m.def(
        "linear_act_bf16",
        [](const F& x, const carray<std::uint8_t>& wp, const OF& b, const std::string& activation, std::optional<F>& u,
           F& out) {
            const pyengine::LinearBf16 bf = bf16_ready_or_raise();
            const auto [N, k, n] = bf16_dims(bf, x, wp, b, out);
            const pyengine::Act act = parse_act(activation);
            if (u) {
                expect_shape(*u, "u", {N, n});
                no_overlap(out, "out", *u, "u");
                no_overlap(*u, "u", x, "x");
            }
            if (N == 0) return std::int64_t{0};
            const pyengine::LinearBlas blas = linear_state().blas;
            const float *xp = x.data(), *bp = ptr(b);
            const void* w = wp.data();
            float* up = u ? u->mutable_data() : nullptr;
            float* op = out.mutable_data();
            py::gil_scoped_release release;
            return pyengine::linear_act_bf16(blas, bf, xp, w, bp, act, N, k, n, up, op);
        },
        py::arg("x").noconvert(), py::arg("wp").noconvert(), py::arg("b").noconvert().none(true),
        py::arg("activation"), py::arg("u").noconvert().none(true), py::arg("out").noconvert(),
        "u = bf16(x) @ wp (+ b) (kept in u unless None), out = activation(u); returns the rows of u with NaN/Inf.");
    m.def(
        "linear_mul_bf16",
        [](const F& x, const carray<std::uint8_t>& wp, const F& coef, F& out) {
            const pyengine::LinearBf16 bf = bf16_ready_or_raise();
            const auto [N, k, n] = bf16_dims(bf, x, wp, std::nullopt, out);
            if (coef.ndim() != 2 || coef.shape(1) != n || (N > 0 && (coef.shape(0) == 0 || N % coef.shape(0) != 0))) {
                throw std::invalid_argument("coef must have shape (M, " + std::to_string(n) +
                                            ") with M dividing N = " + std::to_string(N) + ", got " + shape_str(coef));
            }
            no_overlap(out, "out", coef, "coef");
            if (N == 0) return std::int64_t{0};
            const index_t M = coef.shape(0);
            const pyengine::LinearBlas blas = linear_state().blas;
            const float *xp = x.data(), *cp = coef.data();
            const void* w = wp.data();
            float* op = out.mutable_data();
            py::gil_scoped_release release;
            return pyengine::linear_mul_bf16(blas, bf, xp, w, cp, M, N, k, n, op);
        },
        py::arg("x").noconvert(), py::arg("wp").noconvert(), py::arg("coef").noconvert(), py::arg("out").noconvert(),
        "out = (bf16(x) @ wp) * coef (coef (M, n), row i uses coef[i % M]); returns the rows of the product with "
        "NaN/Inf.");
}

}  // namespace pyengine::bind
