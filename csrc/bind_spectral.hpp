// Bindings of the spectral kernels (spectral.hpp): register_spectral(m) defines one overload
// per dtype of each kernel id, with the reference's argument names.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bind_util.hpp"
#include "spectral.hpp"
#include "spectral_lanczos.hpp"

namespace pyengine::bind {

// Spectral kernels: the outputs are float64 (iterations int64) whatever the dtype of x.

// Exact sigma_max: (x, gamma, eps, frozen, out (n,) float64) -> bad rows.
template <class T, std::int64_t (*K)(const T*, const T*, double, bool, index_t, index_t, double*)>
std::int64_t sigma_max(const carray<T>& x, const carray<T>& gamma, double eps, bool frozen,
                       carray<double>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(gamma, "gamma", {d});
    expect_shape(out, "out", {n});
    const T *xp = x.data(), *gp = gamma.data();
    double* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return K(xp, gp, eps, frozen, n, d, op);
}

// Power iteration: (x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations).
template <class T, std::int64_t (*K)(const T*, const T*, double, bool, const T*, double,
                                     std::int64_t, index_t, index_t, double*, double*,
                                     std::int64_t*)>
std::int64_t power_iteration(const carray<T>& x, const carray<T>& gamma, double eps, bool frozen,
                             const carray<T>& v0, double tol, std::int64_t max_iter,
                             carray<double>& sigma, carray<double>& residual,
                             carray<std::int64_t>& iterations) {
    const auto [n, d] = rows_of(x);
    expect_shape(gamma, "gamma", {d});
    expect_shape(v0, "v0", {n, d});
    expect_shape(sigma, "sigma", {n});
    expect_shape(residual, "residual", {n});
    expect_shape(iterations, "iterations", {n});
    const T *xp = x.data(), *gp = gamma.data(), *vp = v0.data();
    double *sp = sigma.mutable_data(), *rp = residual.mutable_data();
    std::int64_t* ip = iterations.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return K(xp, gp, eps, frozen, vp, tol, max_iter, n, d, sp, rp, ip);
}

// Fused Lanczos: as power_iteration, with v0 (n, d) float64 (the generic solver's start vectors).
template <class T, std::int64_t (*K)(const T*, const T*, double, bool, const double*, double,
                                     std::int64_t, index_t, index_t, double*, double*,
                                     std::int64_t*)>
std::int64_t lanczos(const carray<T>& x, const carray<T>& gamma, double eps, bool frozen,
                     const carray<double>& v0, double tol, std::int64_t max_iter,
                     carray<double>& sigma, carray<double>& residual,
                     carray<std::int64_t>& iterations) {
    const auto [n, d] = rows_of(x);
    expect_shape(gamma, "gamma", {d});
    expect_shape(v0, "v0", {n, d});
    expect_shape(sigma, "sigma", {n});
    expect_shape(residual, "residual", {n});
    expect_shape(iterations, "iterations", {n});
    const T *xp = x.data(), *gp = gamma.data();
    const double* vp = v0.data();
    double *sp = sigma.mutable_data(), *rp = residual.mutable_data();
    std::int64_t* ip = iterations.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return K(xp, gp, eps, frozen, vp, tol, max_iter, n, d, sp, rp, ip);
}

template <class T>
void def_spectral(py::module_& m) {
    m.def("layer_norm_sigma_max", &sigma_max<T, pyengine::layer_norm_sigma_max<T>>,
          py::arg("x").noconvert(), py::arg("gamma").noconvert(), py::arg("eps"),
          py::arg("frozen"), py::arg("out").noconvert(),
          "Exact sigma_max of each token's LayerNorm Jacobian into out (n,) float64; returns "
          "the bad-row count.");
    m.def("rms_norm_sigma_max", &sigma_max<T, pyengine::rms_norm_sigma_max<T>>,
          py::arg("x").noconvert(), py::arg("gamma").noconvert(), py::arg("eps"),
          py::arg("frozen"), py::arg("out").noconvert(),
          "Exact sigma_max of each token's RMSNorm Jacobian into out (n,) float64; returns the "
          "bad-row count.");
    m.def("layer_norm_power_iteration",
          &power_iteration<T, pyengine::layer_norm_power_iteration<T>>, py::arg("x").noconvert(),
          py::arg("gamma").noconvert(), py::arg("eps"), py::arg("frozen"),
          py::arg("v0").noconvert(), py::arg("tol"), py::arg("max_iter"),
          py::arg("sigma").noconvert(), py::arg("residual").noconvert(),
          py::arg("iterations").noconvert(),
          "Fused power iteration on J^T J per LayerNorm token; returns the bad-row count.");
    m.def("rms_norm_power_iteration", &power_iteration<T, pyengine::rms_norm_power_iteration<T>>,
          py::arg("x").noconvert(), py::arg("gamma").noconvert(), py::arg("eps"),
          py::arg("frozen"), py::arg("v0").noconvert(), py::arg("tol"), py::arg("max_iter"),
          py::arg("sigma").noconvert(), py::arg("residual").noconvert(),
          py::arg("iterations").noconvert(),
          "Fused power iteration on J^T J per RMSNorm token; returns the bad-row count.");
    m.def("layer_norm_lanczos", &lanczos<T, pyengine::layer_norm_lanczos<T>>,
          py::arg("x").noconvert(), py::arg("gamma").noconvert(), py::arg("eps"),
          py::arg("frozen"), py::arg("v0").noconvert(), py::arg("tol"), py::arg("max_iter"),
          py::arg("sigma").noconvert(), py::arg("residual").noconvert(),
          py::arg("iterations").noconvert(),
          "Fused Lanczos on J^T J per LayerNorm token; returns the bad-row count.");
    m.def("rms_norm_lanczos", &lanczos<T, pyengine::rms_norm_lanczos<T>>,
          py::arg("x").noconvert(), py::arg("gamma").noconvert(), py::arg("eps"),
          py::arg("frozen"), py::arg("v0").noconvert(), py::arg("tol"), py::arg("max_iter"),
          py::arg("sigma").noconvert(), py::arg("residual").noconvert(),
          py::arg("iterations").noconvert(),
          "Fused Lanczos on J^T J per RMSNorm token; returns the bad-row count.");
}

inline void register_spectral(py::module_& m) {
    def_spectral<float>(m);
    def_spectral<double>(m);
}

}  // namespace pyengine::bind
