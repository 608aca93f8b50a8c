// Bindings of the machine-probe and threading kernels (parallel.hpp): register_machine(m) defines one overload
// per dtype of each kernel id, with the reference's argument names.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "bind_util.hpp"
#include "parallel.hpp"

namespace pyengine::bind {

// Machine probe and threading controls.

template <class T>
void stream_copy(const carray<T>& src, carray<T>& dst) {
    if (src.ndim() != 1) {
        throw std::invalid_argument("src must be 1-D, got shape " + shape_str(src));
    }
    expect_shape(dst, "dst", {src.shape(0)});
    const auto* sp = reinterpret_cast<const unsigned char*>(src.data());
    auto* dp = reinterpret_cast<unsigned char*>(dst.mutable_data());
    const auto n_bytes = static_cast<std::size_t>(src.nbytes());
    py::gil_scoped_release release;  // only raw buffers from here on, kept alive by the caller
    pyengine::stream_copy(sp, dp, n_bytes);
}

template <class T>
void def_stream_copy(py::module_& m) {
    m.def("stream_copy", &stream_copy<T>, py::arg("src").noconvert(), py::arg("dst").noconvert(),
          "Copy src into dst (1-D, same size and dtype) on all threads, in contiguous chunks: "
          "a probe of the machine's streaming copy bandwidth.");
}

inline void register_machine(py::module_& m) {
    m.def(
        "set_num_threads",
        [](int n) {
            if (n < 1) {
                throw std::invalid_argument("n must be >= 1, got " + std::to_string(n));
            }
            pyengine::set_num_threads(n);
        },
        py::arg("n"), "Set the number of threads every kernel of _core uses.");
    m.def("get_num_threads", &pyengine::get_num_threads,
          "The number of threads every kernel of _core uses.");
    def_stream_copy<std::uint8_t>(m);
    def_stream_copy<float>(m);
    def_stream_copy<double>(m);
}

}  // namespace pyengine::bind
