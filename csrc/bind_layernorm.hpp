// Bindings of the LayerNorm and RMSNorm kernels (layernorm.hpp): register_layernorm(m) defines one overload
// per dtype of each kernel id, with the reference's argument names.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bind_util.hpp"
#include "layernorm.hpp"
#include "rmsnorm.hpp"

namespace pyengine::bind {

template <class T>
std::int64_t layer_norm(const carray<T>& x, const carray<T>& gamma, const carray<T>& beta,
                        double eps, carray<T>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(gamma, "gamma", {d});
    expect_shape(beta, "beta", {d});
    expect_shape(out, "out", {n, d});
    const T *xp = x.data(), *gp = gamma.data(), *bp = beta.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return pyengine::layer_norm(xp, gp, bp, eps, n, d, op);
}

template <class T>
std::int64_t rms_norm(const carray<T>& x, const carray<T>& gamma, double eps, carray<T>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(gamma, "gamma", {d});
    expect_shape(out, "out", {n, d});
    const T *xp = x.data(), *gp = gamma.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return pyengine::rms_norm(xp, gp, eps, n, d, op);
}

// JVP and VJP: (x, v or u, gamma, eps, frozen, out) -> bad rows, for a kernel K.
template <class T, std::int64_t (*K)(const T*, const T*, const T*, double, bool, index_t,
                                     index_t, T*)>
std::int64_t tangent(const carray<T>& x, const carray<T>& w, const char* w_name,
                     const carray<T>& gamma, double eps, bool frozen, carray<T>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(w, w_name, {n, d});
    expect_shape(gamma, "gamma", {d});
    expect_shape(out, "out", {n, d});
    const T *xp = x.data(), *wp = w.data(), *gp = gamma.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return K(xp, wp, gp, eps, frozen, n, d, op);
}

// Dense Jacobians: (x, gamma, eps, frozen, out (n, d, d)) -> bad rows.
template <class T, std::int64_t (*K)(const T*, const T*, double, bool, index_t, index_t, T*)>
std::int64_t jacobian(const carray<T>& x, const carray<T>& gamma, double eps, bool frozen,
                      carray<T>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(gamma, "gamma", {d});
    expect_shape(out, "out", {n, d, d});
    const T *xp = x.data(), *gp = gamma.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return K(xp, gp, eps, frozen, n, d, op);
}

template <class T>
void def_layernorm(py::module_& m) {
    m.def("layer_norm", &layer_norm<T>, py::arg("x").noconvert(), py::arg("gamma").noconvert(),
          py::arg("beta").noconvert(), py::arg("eps"), py::arg("out").noconvert(),
          "y = gamma * (x - mu) / sqrt(var + eps) + beta per row, into out; returns the bad-row count.");
    m.def(
        "layer_norm_jvp",
        [](const carray<T>& x, const carray<T>& v, const carray<T>& gamma, double eps,
           bool frozen, carray<T>& out) {
            return tangent<T, pyengine::layer_norm_jvp<T>>(x, v, "v", gamma, eps, frozen, out);
        },
        py::arg("x").noconvert(), py::arg("v").noconvert(), py::arg("gamma").noconvert(),
        py::arg("eps"), py::arg("frozen"), py::arg("out").noconvert(),
        "J v per row, into out; returns the bad-row count.");
    m.def(
        "layer_norm_vjp",
        [](const carray<T>& x, const carray<T>& u, const carray<T>& gamma, double eps,
           bool frozen, carray<T>& out) {
            return tangent<T, pyengine::layer_norm_vjp<T>>(x, u, "u", gamma, eps, frozen, out);
        },
        py::arg("x").noconvert(), py::arg("u").noconvert(), py::arg("gamma").noconvert(),
        py::arg("eps"), py::arg("frozen"), py::arg("out").noconvert(),
        "J^T u per row, into out; returns the bad-row count.");
    m.def("layer_norm_jacobian", &jacobian<T, pyengine::layer_norm_jacobian<T>>,
          py::arg("x").noconvert(), py::arg("gamma").noconvert(), py::arg("eps"),
          py::arg("frozen"), py::arg("out").noconvert(),
          "Dense J per row into out (n, d, d); returns the bad-row count.");

    m.def("rms_norm", &rms_norm<T>, py::arg("x").noconvert(), py::arg("gamma").noconvert(),
          py::arg("eps"), py::arg("out").noconvert(),
          "y = gamma * x / sqrt(mean(x^2) + eps) per row, into out; returns the bad-row count.");
    m.def(
        "rms_norm_jvp",
        [](const carray<T>& x, const carray<T>& v, const carray<T>& gamma, double eps,
           bool frozen, carray<T>& out) {
            return tangent<T, pyengine::rms_norm_jvp<T>>(x, v, "v", gamma, eps, frozen, out);
        },
        py::arg("x").noconvert(), py::arg("v").noconvert(), py::arg("gamma").noconvert(),
        py::arg("eps"), py::arg("frozen"), py::arg("out").noconvert(),
        "J v per row, into out; returns the bad-row count.");
    m.def(
        "rms_norm_vjp",
        [](const carray<T>& x, const carray<T>& u, const carray<T>& gamma, double eps,
           bool frozen, carray<T>& out) {
            return tangent<T, pyengine::rms_norm_vjp<T>>(x, u, "u", gamma, eps, frozen, out);
        },
        py::arg("x").noconvert(), py::arg("u").noconvert(), py::arg("gamma").noconvert(),
        py::arg("eps"), py::arg("frozen"), py::arg("out").noconvert(),
        "J^T u per row, into out; returns the bad-row count.");
    m.def("rms_norm_jacobian", &jacobian<T, pyengine::rms_norm_jacobian<T>>,
          py::arg("x").noconvert(), py::arg("gamma").noconvert(), py::arg("eps"),
          py::arg("frozen"), py::arg("out").noconvert(),
          "Dense J per row into out (n, d, d); returns the bad-row count.");
}

inline void register_layernorm(py::module_& m) {
    def_layernorm<float>(m);
    def_layernorm<double>(m);
}

}  // namespace pyengine::bind
