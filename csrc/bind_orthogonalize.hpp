// Bindings of the Newton–Schulz kernel (orthogonalize.hpp): register_orthogonalize(m) defines
// one overload per dtype of newton_schulz, with the reference's argument names.
//
// BLAS: the kernel calls sgemm/ssyrk (dgemm/dsyrk) of scipy.linalg.cython_blas, whose
// function pointers SciPy exports as PyCapsules in the module's __pyx_capi__ (the C-API
// that Cython modules cimport). They are looked up once, on the first call, with the GIL
// held; SciPy stays imported (modules are never unloaded), so the pointers stay valid.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "bind_util.hpp"
#include "orthogonalize.hpp"

namespace pyengine::bind {

inline void* blas_function(const char* name) {
    py::module_ cb = py::module_::import("scipy.linalg.cython_blas");
    py::dict capi = cb.attr("__pyx_capi__");
    py::object cap = capi[name];
    void* fn = PyCapsule_GetPointer(cap.ptr(), PyCapsule_GetName(cap.ptr()));
    if (fn == nullptr) {
        throw py::error_already_set();
    }
    return fn;
}

template <class T>
const pyengine::Blas<T>& blas() {
    static const pyengine::Blas<T> table = [] {
        constexpr bool f32 = sizeof(T) == 4;
        pyengine::Blas<T> b;
        b.gemm = reinterpret_cast<typename pyengine::Blas<T>::gemm_t>(blas_function(f32 ? "sgemm" : "dgemm"));
        b.syrk = reinterpret_cast<typename pyengine::Blas<T>::syrk_t>(blas_function(f32 ? "ssyrk" : "dsyrk"));
        return b;
    }();
    return table;
}

template <class T>
std::int64_t newton_schulz(const carray<T>& g, const carray<double>& coeffs, carray<T>& out) {
    if (g.ndim() != 3) {
        throw std::invalid_argument("g must be 3-D (B, m, n), got shape " + shape_str(g));
    }
    const index_t batch = g.shape(0), m = g.shape(1), n = g.shape(2);
    if (coeffs.ndim() != 2 || coeffs.shape(1) != 3) {
        throw std::invalid_argument("coeffs must have shape (S, 3), got " + shape_str(coeffs));
    }
    if (m > INT32_MAX || n > INT32_MAX) {
        throw std::invalid_argument("g's matrices are too large for LP64 BLAS: " + shape_str(g));
    }
    expect_shape(out, "out", {batch, m, n});
    const pyengine::Blas<T>& b = blas<T>();
    const T* gp = g.data();
    const double* cp = coeffs.data();
    const index_t steps = coeffs.shape(0);
    T* op = out.mutable_data();
    if (batch == 0 || m == 0 || n == 0) return 0;
    py::gil_scoped_release release;  // only raw buffers and BLAS from here on (see bind_util.hpp)
    return pyengine::newton_schulz(gp, batch, m, n, cp, steps, b, op);
}

template <class T>
void def_orthogonalize(py::module_& m) {
    m.def("newton_schulz", &newton_schulz<T>, py::arg("g").noconvert(), py::arg("coeffs").noconvert(),
          py::arg("out").noconvert(),
          "Newton-Schulz steps coeffs (S, 3) = (a, b, c) per step on each g[k] / ||g[k]||_F (B, m, "
          "n) into out (products by SciPy's BLAS); returns the number of non-finite matrices.");
}

inline void register_orthogonalize(py::module_& m) {
    def_orthogonalize<float>(m);
    def_orthogonalize<double>(m);
}

}  // namespace pyengine::bind
