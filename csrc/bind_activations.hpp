// Bindings of the softmax and activation kernels (activations.hpp): register_activations(m) defines one overload
// per dtype of each kernel id, with the reference's argument names.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "bind_util.hpp"
#include "activations.hpp"

namespace pyengine::bind {

// Softmax and activations.

// (n, tq, tk) of a 3-D batch of score matrices.
inline std::array<index_t, 3> scores_of(const py::array& a, const char* name) {
    if (a.ndim() != 3) {
        throw std::invalid_argument(std::string(name) + " must be 3-D (N, Tq, Tk), got shape " +
                                    shape_str(a));
    }
    return {a.shape(0), a.shape(1), a.shape(2)};
}

template <class T>
std::int64_t softmax(const carray<T>& x, std::int64_t offset, carray<T>& out) {
    const auto [n, tq, tk] = scores_of(x, "x");
    if (offset < 0) {
        throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
    }
    expect_shape(out, "out", {n, tq, tk});
    const T* xp = x.data();
    T* op = out.mutable_data();  // may be x's buffer: the kernel reads a row before writing it
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return pyengine::softmax(xp, static_cast<index_t>(offset), n, tq, tk, op);
}

template <class T>
std::int64_t softmax_jvp(const carray<T>& p, const carray<T>& dx, carray<T>& out) {
    const auto [m, tq, tk] = scores_of(p, "p");
    if (dx.ndim() != 4) {
        throw std::invalid_argument("dx must be 4-D (R, M, Tq, Tk), got shape " + shape_str(dx));
    }
    const index_t r = dx.shape(0);
    expect_shape(dx, "dx", {r, m, tq, tk});
    expect_shape(out, "out", {r, m, tq, tk});
    const T *pp = p.data(), *dp = dx.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return pyengine::softmax_jvp(pp, dp, r, m, tq, tk, op);
}

// Elementwise activation or derivative: (x (n, d), out (n, d)) -> bad rows, for a kernel K.
template <class T, std::int64_t (*K)(const T*, index_t, index_t, T*)>
std::int64_t elementwise(const carray<T>& x, carray<T>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(out, "out", {n, d});
    const T* xp = x.data();
    T* op = out.mutable_data();  // may be x's buffer: each element is read before it is written
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return K(xp, n, d, op);
}

// (n, d) of a gated pre-activation u (n, 2d) = [gate | up].
inline std::pair<index_t, index_t> gated_of(const py::array& u) {
    if (u.ndim() != 2 || u.shape(1) % 2 != 0) {
        throw std::invalid_argument("u must be 2-D (N, 2n) = [gate | up], got shape " +
                                    shape_str(u));
    }
    return {u.shape(0), u.shape(1) / 2};
}

template <class T>
std::int64_t silu_gated(const carray<T>& u, carray<T>& out) {
    const auto [n, d] = gated_of(u);
    expect_shape(out, "out", {n, d});
    const T* up = u.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return pyengine::silu_gated(up, n, d, op);
}

template <class T>
std::int64_t silu_gated_grad(const carray<T>& u, carray<T>& out_a, carray<T>& out_b) {
    const auto [n, d] = gated_of(u);
    expect_shape(out_a, "out_a", {n, d});
    expect_shape(out_b, "out_b", {n, d});
    const T* up = u.data();
    T *ap = out_a.mutable_data(), *bp = out_b.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return pyengine::silu_gated_grad(up, n, d, ap, bp);
}

template <class T>
void def_activations(py::module_& m) {
    m.def("softmax", &softmax<T>, py::arg("x").noconvert(), py::arg("offset"),
          py::arg("out").noconvert(),
          "Row softmax of x (N, Tq, Tk) over keys j <= i + offset into out (may be x; masked "
          "keys 0); returns the bad-row count.");
    m.def("softmax_jvp", &softmax_jvp<T>, py::arg("p").noconvert(), py::arg("dx").noconvert(),
          py::arg("out").noconvert(),
          "out = p * (dx - sum_j p dx) per row, p (M, Tq, Tk) shared by dx (R, M, Tq, Tk); "
          "out may be dx; returns the bad-row count.");
    const auto elementwise_def = [&m](const char* name, auto kernel, const char* doc) {
        m.def(name, kernel, py::arg("x").noconvert(), py::arg("out").noconvert(), doc);
    };
    elementwise_def("gelu", &elementwise<T, pyengine::gelu<T>>,
                    "x Phi(x) elementwise into out (may be x); returns the bad-row count.");
    elementwise_def("gelu_grad", &elementwise<T, pyengine::gelu_grad<T>>,
                    "Phi(x) + x phi(x) elementwise into out (may be x); returns the bad-row count.");
    elementwise_def("gelu_tanh", &elementwise<T, pyengine::gelu_tanh<T>>,
                    "0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) elementwise into out (may be "
                    "x); returns the bad-row count.");
    elementwise_def("gelu_tanh_grad", &elementwise<T, pyengine::gelu_tanh_grad<T>>,
                    "The derivative of gelu_tanh elementwise into out (may be x); returns the "
                    "bad-row count.");
    elementwise_def("relu", &elementwise<T, pyengine::relu<T>>,
                    "max(x, 0) elementwise into out (may be x); returns the bad-row count.");
    elementwise_def("relu_grad", &elementwise<T, pyengine::relu_grad<T>>,
                    "1 where x > 0, else 0, into out (may be x); returns the bad-row count.");
    m.def("silu_gated", &silu_gated<T>, py::arg("u").noconvert(), py::arg("out").noconvert(),
          "silu(gate) * up of u (N, 2n) = [gate | up] into out (N, n); returns the bad-row "
          "count.");
    m.def("silu_gated_grad", &silu_gated_grad<T>, py::arg("u").noconvert(),
          py::arg("out_a").noconvert(), py::arg("out_b").noconvert(),
          "out_a = silu'(gate) * up, out_b = silu(gate) of u (N, 2n) = [gate | up]; returns the "
          "bad-row count.");
}

inline void register_activations(py::module_& m) {
    def_activations<float>(m);
    def_activations<double>(m);
}

}  // namespace pyengine::bind
