// Bindings of the attention kernels (attention.hpp): register_attention(m) defines one
// overload per dtype of each kernel id, with the reference's argument names; shapes are
// checked with bind_util.hpp's helpers (see there for the GIL conventions).
//
// The score gradient, the advantage and the fused backward pass take the BLAS kernels of
// attention_blas.hpp where those serve the shape (heads of width >= 16; NumPy's OpenBLAS
// found, the pointers of bind_linear.hpp's linear_state()), else the register-blocked ones
// of attention.hpp; attention_force_fallback(True) forces the latter (for tests), and
// attention_blas_info() says which path a call takes.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "attention.hpp"
#include "attention_blas.hpp"
#include "bind_linear.hpp"
#include "bind_util.hpp"

namespace pyengine::bind {

// The three extents of a 3-D array.
inline std::array<index_t, 3> dims3(const py::array& a, const char* name, const char* what) {
    if (a.ndim() != 3) {
        throw std::invalid_argument(std::string(name) + " must be 3-D " + what + ", got shape " +
                                    shape_str(a));
    }
    return {a.shape(0), a.shape(1), a.shape(2)};
}

inline bool& attention_forced() {
    static bool forced = false;
    return forced;
}

// The BLAS pointers when the BLAS kernels may run (GIL held), else ready() is false.
inline pyengine::LinearBlas attention_blas() {
    if (attention_forced()) return {};
    return linear_state().blas;
}

inline index_t check_offset(std::int64_t offset) {
    if (offset < 0) {
        throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
    }
    return static_cast<index_t>(offset);
}

template <class T>
std::int64_t attention_score_grad(const carray<T>& p, const carray<T>& u, const carray<T>& v,
                                  std::int64_t offset, carray<T>& out, carray<T>* adv) {
    const auto [n, tq, tk] = dims3(p, "p", "(N, Tq, Tk)");
    const index_t dv = dims3(u, "u", "(N, Tq, dv)")[2];
    expect_shape(u, "u", {n, tq, dv});
    expect_shape(v, "v", {n, tk, dv});
    expect_shape(out, "out", {n, tq, tk});
    if (adv) expect_shape(*adv, "advantage", {n, tq, tk});
    const index_t off = check_offset(offset);
    const T *pp = p.data(), *up = u.data(), *vp = v.data();
    T* op = out.mutable_data();
    T* ap = adv ? adv->mutable_data() : nullptr;
    const pyengine::LinearBlas blas = attention_blas();
    py::gil_scoped_release release;  // only raw buffers and BLAS from here on (see bind_util.hpp)
    if (pyengine::attention_blas_serves(blas, n, tq, tk, dv, dv, false)) {
        return pyengine::attention_score_grad_blas(blas, pp, up, vp, off, n, tq, tk, dv, op, ap);
    }
    return pyengine::attention_score_grad(pp, up, vp, off, n, tq, tk, dv, op, ap);
}

template <class T>
std::int64_t attention_forward(const carray<T>& q, const carray<T>& k, const carray<T>& v,
                               std::int64_t offset, double scale, carray<T>& out,
                               carray<double>& lse, carray<double>& entropy) {
    const auto [n, tq, dk] = dims3(q, "q", "(N, Tq, dk)");
    const index_t tk = dims3(k, "k", "(N, Tk, dk)")[1];
    const index_t dv = dims3(v, "v", "(N, Tk, dv)")[2];
    expect_shape(k, "k", {n, tk, dk});
    expect_shape(v, "v", {n, tk, dv});
    expect_shape(out, "out", {n, tq, dv});
    expect_shape(lse, "lse", {n, tq});
    expect_shape(entropy, "entropy", {n, tq});
    const index_t off = check_offset(offset);
    const T *qp = q.data(), *kp = k.data(), *vp = v.data();
    T* op = out.mutable_data();
    double *lp = lse.mutable_data(), *ep = entropy.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see bind_util.hpp)
    return pyengine::attention_forward(qp, kp, vp, off, scale, n, tq, tk, dk, dv, op, lp, ep);
}

template <class T>
std::int64_t attention_backward(const carray<T>& q, const carray<T>& k, const carray<T>& v,
                                const carray<T>& o, const carray<T>& d_o,
                                const carray<double>& lse, std::int64_t offset, double scale,
                                carray<T>& dq, carray<T>& dk, carray<T>& dv,
                                carray<double>& spread) {
    const auto [n, tq, d_k] = dims3(q, "q", "(N, Tq, dk)");
    const index_t tk = dims3(k, "k", "(N, Tk, dk)")[1];
    const index_t d_v = dims3(v, "v", "(N, Tk, dv)")[2];
    expect_shape(k, "k", {n, tk, d_k});
    expect_shape(v, "v", {n, tk, d_v});
    expect_shape(o, "o", {n, tq, d_v});
    expect_shape(d_o, "d_o", {n, tq, d_v});
    expect_shape(lse, "lse", {n, tq});
    expect_shape(dq, "dq", {n, tq, d_k});
    expect_shape(dk, "dk", {n, tk, d_k});
    expect_shape(dv, "dv", {n, tk, d_v});
    expect_shape(spread, "spread", {n, tq});
    const index_t off = check_offset(offset);
    const T *qp = q.data(), *kp = k.data(), *vp = v.data(), *op = o.data(), *gp = d_o.data();
    const double* lp = lse.data();
    T *dqp = dq.mutable_data(), *dkp = dk.mutable_data(), *dvp = dv.mutable_data();
    double* sp = spread.mutable_data();
    const pyengine::LinearBlas blas = attention_blas();
    py::gil_scoped_release release;  // only raw buffers and BLAS from here on (see bind_util.hpp)
    if (pyengine::attention_blas_serves(blas, n, tq, tk, d_k, d_v, true)) {
        return pyengine::attention_backward_blas(blas, qp, kp, vp, op, gp, lp, off, scale, n, tq, tk, d_k, d_v,
                                                 dqp, dkp, dvp, sp);
    }
    return pyengine::attention_backward(qp, kp, vp, op, gp, lp, off, scale, n, tq, tk, d_k, d_v,
                                        dqp, dkp, dvp, sp);
}

template <class T>
void def_attention(py::module_& m) {
    m.def(
        "attention_score_grad",
        [](const carray<T>& p, const carray<T>& u, const carray<T>& v, std::int64_t offset,
           carray<T>& out) { return attention_score_grad<T>(p, u, v, offset, out, nullptr); },
        py::arg("p").noconvert(), py::arg("u").noconvert(), py::arg("v").noconvert(),
        py::arg("offset"), py::arg("out").noconvert(),
        "dL/ds = p * (b - sum_j p b), b = u v^T, of p (N, Tq, Tk) over keys j <= i + offset "
        "into out; returns the bad-row count.");
    m.def(
        "attention_advantage",
        [](const carray<T>& p, const carray<T>& u, const carray<T>& v, std::int64_t offset,
           carray<T>& out, carray<T>& advantage) {
            return attention_score_grad<T>(p, u, v, offset, out, &advantage);
        },
        py::arg("p").noconvert(), py::arg("u").noconvert(), py::arg("v").noconvert(),
        py::arg("offset"), py::arg("out").noconvert(), py::arg("advantage").noconvert(),
        "dL/ds into out and the advantage b - sum_j p b into advantage, in one pass; returns "
        "the bad-row count.");
    m.def("attention_forward", &attention_forward<T>, py::arg("q").noconvert(),
          py::arg("k").noconvert(), py::arg("v").noconvert(), py::arg("offset"), py::arg("scale"),
          py::arg("out").noconvert(), py::arg("lse").noconvert(), py::arg("entropy").noconvert(),
          "Fused row-streaming attention head forward: out = softmax(scale q k^T) v, lse and "
          "entropy per row (float64); returns the bad-row count.");
    m.def("attention_backward", &attention_backward<T>, py::arg("q").noconvert(),
          py::arg("k").noconvert(), py::arg("v").noconvert(), py::arg("o").noconvert(),
          py::arg("d_o").noconvert(), py::arg("lse").noconvert(), py::arg("offset"),
          py::arg("scale"), py::arg("dq").noconvert(), py::arg("dk").noconvert(),
          py::arg("dv").noconvert(), py::arg("spread").noconvert(),
          "Fused attention head backward in one pass over the visible pairs: dq, dk, dv and the "
          "advantage spread per row (float64), p recomputed from lse, D = d_o . o; returns the "
          "bad-row count.");
}

inline void register_attention(py::module_& m) {
    def_attention<float>(m);
    def_attention<double>(m);
    m.def(
        "attention_blas_info", [] {
            if (attention_forced()) return std::string("register-blocked kernels (forced by attention_force_fallback)");
            const LinearState& s = linear_state();
            if (!s.blas.ready()) return "register-blocked kernels (" + s.info + ")";
            return "BLAS for heads of width >= 16: " + s.info;
        },
        "Which path the attention backward kernels' products take, in words.");
    m.def(
        "attention_force_fallback", [](bool on) { attention_forced() = on; }, py::arg("on"),
        "Force (True) or release (False) the register-blocked attention kernels instead of BLAS (for tests).");
}

}  // namespace pyengine::bind
