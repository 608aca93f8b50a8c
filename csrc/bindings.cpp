// Python bindings of pyengine._core: one bind_<family>.hpp per kernel family, each with a
// register_<family>(py::module_&), and the module definition below that calls them.
//
// Every kernel is bound under its registry id (pyengine.backends.KERNELS) with the
// reference's argument names, one overload per dtype. Arguments are noconvert c_style
// arrays: the Python layer has already validated and converted them, so an array of the
// wrong dtype or layout here is a bug and raises TypeError instead of being copied.
//
// A new family: its kernels in csrc/<family>.hpp (pure C++, installed for
// pyengine.get_include()), its wrappers and register_<family>() in csrc/bind_<family>.hpp
// (see bind_util.hpp), then one #include and one register_<family>(m) call here, and its
// overloads in pyengine/_core.pyi (tests/test_stub.py checks them against this module).
#include <pybind11/pybind11.h>

#include "bind_activations.hpp"
#include "bind_attention.hpp"
#include "bind_layernorm.hpp"
#include "bind_linear.hpp"
#include "bind_linear_bf16.hpp"
#include "bind_machine.hpp"
#include "bind_orthogonalize.hpp"
#include "bind_spectral.hpp"

PYBIND11_MODULE(_core, m) {
    using namespace pyengine::bind;
    m.doc() = "pyengine's compiled kernels; use them through pyengine.backends.";
    register_machine(m);
    register_layernorm(m);
    register_spectral(m);
    register_activations(m);
    register_attention(m);
    register_orthogonalize(m);
    register_linear(m);
    register_linear_bf16(m);
}
