// Shared by the bind_<family>.hpp files of pyengine._core: the array type every kernel
// argument has, and the shape checks, which run with the GIL held and raise ValueError.
// Binding code only (needs pybind11); not installed with the kernel headers.
//
// Each wrapper in those files checks shapes and takes the raw pointers with the GIL held,
// then releases the GIL for the kernel: the kernel touches only those buffers (kept alive
// by the array arguments, which the caller holds) and no Python object.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "parallel.hpp"

namespace pyengine::bind {

namespace py = pybind11;

template <class T>
using carray = py::array_t<T, py::array::c_style>;

inline std::string shape_str(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t k = 0; k < a.ndim(); ++k) {
        s += (k ? ", " : "") + std::to_string(a.shape(k));
    }
    return s + (a.ndim() == 1 ? ",)" : ")");
}

// Shapes are checked here, while holding the GIL; std::invalid_argument -> ValueError.
inline void expect_shape(const py::array& a, const char* name,
                         std::initializer_list<index_t> shape) {
    bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
    py::ssize_t k = 0;
    for (index_t s : shape) {
        ok = ok && a.shape(k++) == s;
    }
    if (!ok) {
        std::string want = "(";
        for (index_t s : shape) {
            want += (want.size() > 1 ? ", " : "") + std::to_string(s);
        }
        want += shape.size() == 1 ? ",)" : ")";
        throw std::invalid_argument(std::string(name) + " must have shape " + want + ", got " +
                                    shape_str(a));
    }
}

// (n, d) of the row-major batch x.
inline std::pair<index_t, index_t> rows_of(const py::array& x) {
    if (x.ndim() != 2) {
        throw std::invalid_argument("x must be 2-D (tokens, d), got shape " + shape_str(x));
    }
    return {x.shape(0), x.shape(1)};
}

}  // namespace pyengine::bind
