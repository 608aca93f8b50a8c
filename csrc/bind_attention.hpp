// Python bindings of the attention kernels (csrc/attention.hpp): register_attention(m),
// called from bindings.cpp's module definition. Self-contained (its own small shape
// helpers), so that it can be included anywhere in bindings.cpp.
//
// Same conventions as bindings.cpp: each kernel is bound under its registry id with the
// reference's argument names, one overload per dtype; arrays are noconvert c_style (the
// Python layer has converted them, so a mismatch is a bug and raises TypeError); shapes are
// checked with the GIL held (std::invalid_argument -> ValueError), then the GIL is released
// for the kernel, which touches only the raw buffers of arrays the caller keeps alive.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "attention.hpp"

namespace pyengine_bind_attention {

namespace py = pybind11;
using pyengine::index_t;

template <class T>
using carray = py::array_t<T, py::array::c_style>;

inline std::string shape_of(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t k = 0; k < a.ndim(); ++k) {
        s += (k ? ", " : "") + std::to_string(a.shape(k));
    }
    return s + (a.ndim() == 1 ? ",)" : ")");
}

// The three extents of a 3-D array.
inline std::array<index_t, 3> dims3(const py::array& a, const char* name, const char* what) {
    if (a.ndim() != 3) {
        throw std::invalid_argument(std::string(name) + " must be 3-D " + what + ", got shape " +
                                    shape_of(a));
    }
    return {a.shape(0), a.shape(1), a.shape(2)};
}

inline void expect(const py::array& a, const char* name, std::initializer_list<index_t> shape) {
    bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
    py::ssize_t k = 0;
    std::string want = "(";
    for (index_t s : shape) {
        ok = ok && a.shape(k++) == s;
        want += (want.size() > 1 ? ", " : "") + std::to_string(s);
    }
    if (!ok) {
        throw std::invalid_argument(std::string(name) + " must have shape " + want + "), got " +
                                    shape_of(a));
    }
}

inline index_t check_offset(std::int64_t offset) {
    if (offset < 0) {
        throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
    }
    return static_cast<index_t>(offset);
}

template <class T>
std::int64_t score_grad(const carray<T>& p, const carray<T>& u, const carray<T>& v,
                        std::int64_t offset, carray<T>& out, carray<T>* adv) {
    const auto [n, tq, tk] = dims3(p, "p", "(N, Tq, Tk)");
    const index_t dv = dims3(u, "u", "(N, Tq, dv)")[2];
    expect(u, "u", {n, tq, dv});
    expect(v, "v", {n, tk, dv});
    expect(out, "out", {n, tq, tk});
    if (adv) expect(*adv, "advantage", {n, tq, tk});
    const index_t off = check_offset(offset);
    const T *pp = p.data(), *up = u.data(), *vp = v.data();
    T* op = out.mutable_data();
    T* ap = adv ? adv->mutable_data() : nullptr;
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
    return pyengine::attention_score_grad(pp, up, vp, off, n, tq, tk, dv, op, ap);
}

template <class T>
std::int64_t forward(const carray<T>& q, const carray<T>& k, const carray<T>& v, std::int64_t offset,
                     double scale, carray<T>& out, carray<double>& lse, carray<double>& entropy) {
    const auto [n, tq, dk] = dims3(q, "q", "(N, Tq, dk)");
    const index_t tk = dims3(k, "k", "(N, Tk, dk)")[1];
    const index_t dv = dims3(v, "v", "(N, Tk, dv)")[2];
    expect(k, "k", {n, tk, dk});
    expect(v, "v", {n, tk, dv});
    expect(out, "out", {n, tq, dv});
    expect(lse, "lse", {n, tq});
    expect(entropy, "entropy", {n, tq});
    const index_t off = check_offset(offset);
    const T *qp = q.data(), *kp = k.data(), *vp = v.data();
    T* op = out.mutable_data();
    double *lp = lse.mutable_data(), *ep = entropy.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
    return pyengine::attention_forward(qp, kp, vp, off, scale, n, tq, tk, dk, dv, op, lp, ep);
}

template <class T>
std::int64_t backward(const carray<T>& q, const carray<T>& k, const carray<T>& v,
                      const carray<T>& d_o, const carray<double>& lse, std::int64_t offset,
                      double scale, carray<T>& dq, carray<T>& dk, carray<T>& dv,
                      carray<double>& spread) {
    const auto [n, tq, d_k] = dims3(q, "q", "(N, Tq, dk)");
    const index_t tk = dims3(k, "k", "(N, Tk, dk)")[1];
    const index_t d_v = dims3(v, "v", "(N, Tk, dv)")[2];
    expect(k, "k", {n, tk, d_k});
    expect(v, "v", {n, tk, d_v});
    expect(d_o, "d_o", {n, tq, d_v});
    expect(lse, "lse", {n, tq});
    expect(dq, "dq", {n, tq, d_k});
    expect(dk, "dk", {n, tk, d_k});
    expect(dv, "dv", {n, tk, d_v});
    expect(spread, "spread", {n, tq});
    const index_t off = check_offset(offset);
    const T *qp = q.data(), *kp = k.data(), *vp = v.data(), *gp = d_o.data();
    const double* lp = lse.data();
    T *dqp = dq.mutable_data(), *dkp = dk.mutable_data(), *dvp = dv.mutable_data();
    double* sp = spread.mutable_data();
    py::gil_scoped_release release;  // only raw buffers from here on (see above)
    return pyengine::attention_backward(qp, kp, vp, gp, lp, off, scale, n, tq, tk, d_k, d_v, dqp,
                                        dkp, dvp, sp);
}

template <class T>
void def_attention(py::module_& m) {
    m.def(
        "attention_score_grad",
        [](const carray<T>& p, const carray<T>& u, const carray<T>& v, std::int64_t offset,
           carray<T>& out) { return score_grad<T>(p, u, v, offset, out, nullptr); },
        py::arg("p").noconvert(), py::arg("u").noconvert(), py::arg("v").noconvert(),
        py::arg("offset"), py::arg("out").noconvert(),
        "dL/ds = p * (b - sum_j p b), b = u v^T, of p (N, Tq, Tk) over keys j <= i + offset "
        "into out; returns the bad-row count.");
    m.def(
        "attention_advantage",
        [](const carray<T>& p, const carray<T>& u, const carray<T>& v, std::int64_t offset,
           carray<T>& out, carray<T>& advantage) {
            return score_grad<T>(p, u, v, offset, out, &advantage);
        },
        py::arg("p").noconvert(), py::arg("u").noconvert(), py::arg("v").noconvert(),
        py::arg("offset"), py::arg("out").noconvert(), py::arg("advantage").noconvert(),
        "dL/ds into out and the advantage b - sum_j p b into advantage, in one pass; returns "
        "the bad-row count.");
    m.def("attention_forward", &forward<T>, py::arg("q").noconvert(), py::arg("k").noconvert(),
          py::arg("v").noconvert(), py::arg("offset"), py::arg("scale"),
          py::arg("out").noconvert(), py::arg("lse").noconvert(), py::arg("entropy").noconvert(),
          "Fused row-streaming attention head forward: out = softmax(scale q k^T) v, lse and "
          "entropy per row (float64); returns the bad-row count.");
    m.def("attention_backward", &backward<T>, py::arg("q").noconvert(), py::arg("k").noconvert(),
          py::arg("v").noconvert(), py::arg("d_o").noconvert(), py::arg("lse").noconvert(),
          py::arg("offset"), py::arg("scale"), py::arg("dq").noconvert(),
          py::arg("dk").noconvert(), py::arg("dv").noconvert(), py::arg("spread").noconvert(),
          "Fused row-streaming attention head backward: dq, dk, dv and the advantage spread per "
          "row (float64), p recomputed from lse; returns the bad-row count.");
}

}  // namespace pyengine_bind_attention

inline void register_attention(pybind11::module_& m) {
    pyengine_bind_attention::def_attention<float>(m);
    pyengine_bind_attention::def_attention<double>(m);
}
