// Python bindings of pyengine._core: one register_<family>() per kernel family, and the
// module definition at the bottom that calls them.
//
// Every kernel is bound under its registry id (pyengine.backends.KERNELS) with the
// reference's argument names, one overload per dtype. Arguments are noconvert c_style
// arrays: the Python layer has already validated and converted them, so an array of the
// wrong dtype or layout here is a bug and raises TypeError instead of being copied.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "activations.hpp"
#include "bind_attention.hpp"
#include "layernorm.hpp"
#include "parallel.hpp"
#include "spectral.hpp"

namespace py = pybind11;
using pyengine::index_t;

namespace {

template <class T>
using carray = py::array_t<T, py::array::c_style>;

std::string shape_str(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t k = 0; k < a.ndim(); ++k) {
        s += (k ? ", " : "") + std::to_string(a.shape(k));
    }
    return s + (a.ndim() == 1 ? ",)" : ")");
}

// Shapes are checked here, while holding the GIL; std::invalid_argument -> ValueError.
void expect_shape(const py::array& a, const char* name, std::initializer_list<index_t> shape) {
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
std::pair<index_t, index_t> rows_of(const py::array& x) {
    if (x.ndim() != 2) {
        throw std::invalid_argument("x must be 2-D (tokens, d), got shape " + shape_str(x));
    }
    return {x.shape(0), x.shape(1)};
}

// Each wrapper checks shapes and takes the raw pointers with the GIL held, then releases
// the GIL for the kernel: the kernel touches only those buffers (kept alive by the array
// arguments, which the caller holds) and no Python object.

template <class T>
std::int64_t layer_norm(const carray<T>& x, const carray<T>& gamma, const carray<T>& beta,
                        double eps, carray<T>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(gamma, "gamma", {d});
    expect_shape(beta, "beta", {d});
    expect_shape(out, "out", {n, d});
    const T *xp = x.data(), *gp = gamma.data(), *bp = beta.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
    return pyengine::layer_norm(xp, gp, bp, eps, n, d, op);
}

template <class T>
std::int64_t rms_norm(const carray<T>& x, const carray<T>& gamma, double eps, carray<T>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(gamma, "gamma", {d});
    expect_shape(out, "out", {n, d});
    const T *xp = x.data(), *gp = gamma.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
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
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
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
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
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

void register_layernorm(py::module_& m) {
    def_layernorm<float>(m);
    def_layernorm<double>(m);
}

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
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
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
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
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
}

void register_spectral(py::module_& m) {
    def_spectral<float>(m);
    def_spectral<double>(m);
}

// Softmax and activations.

// (n, tq, tk) of a 3-D batch of score matrices.
std::array<index_t, 3> scores_of(const py::array& a, const char* name) {
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
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
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
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
    return pyengine::softmax_jvp(pp, dp, r, m, tq, tk, op);
}

// Elementwise activation or derivative: (x (n, d), out (n, d)) -> bad rows, for a kernel K.
template <class T, std::int64_t (*K)(const T*, index_t, index_t, T*)>
std::int64_t elementwise(const carray<T>& x, carray<T>& out) {
    const auto [n, d] = rows_of(x);
    expect_shape(out, "out", {n, d});
    const T* xp = x.data();
    T* op = out.mutable_data();  // may be x's buffer: each element is read before it is written
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
    return K(xp, n, d, op);
}

// (n, d) of a gated pre-activation u (n, 2d) = [gate | up].
std::pair<index_t, index_t> gated_of(const py::array& u) {
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
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
    return pyengine::silu_gated(up, n, d, op);
}

template <class T>
std::int64_t silu_gated_grad(const carray<T>& u, carray<T>& out_a, carray<T>& out_b) {
    const auto [n, d] = gated_of(u);
    expect_shape(out_a, "out_a", {n, d});
    expect_shape(out_b, "out_b", {n, d});
    const T* up = u.data();
    T *ap = out_a.mutable_data(), *bp = out_b.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
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

void register_activations(py::module_& m) {
    def_activations<float>(m);
    def_activations<double>(m);
}

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

void register_machine(py::module_& m) {
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

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "pyengine's compiled kernels; use them through pyengine.backends.";
    register_machine(m);
    register_layernorm(m);
    register_spectral(m);
    register_activations(m);
    register_attention(m);
}
