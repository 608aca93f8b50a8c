// Bindings of the dense-layer kernels (linear.hpp): register_linear(m) defines one overload per
// dtype of linear, linear_act and linear_mul, with the reference's argument names, and
// linear_blas_info / linear_force_fallback (which path the products take).
//
// BLAS: MKL from the mkl package (its threading layer sequential) or NumPy's own OpenBLAS,
// found at run time by pyengine.kernels._blas.find() (ctypes): the CBLAS sgemm/dgemm entry
// points and the library's per-thread count setter. They are looked up once, on the first
// call, with the GIL held; the libraries stay loaded, so the pointers stay valid. Without
// them (NumPy on MKL or Accelerate, an OpenBLAS older than 0.3.27, or
// linear_force_fallback(True)) the product is numpy.matmul's (called here, with the GIL)
// and the epilogue a separate parallel pass.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "bind_util.hpp"
#include "linear.hpp"
#include "linear_attention.hpp"

namespace pyengine::bind {

struct LinearState {
    pyengine::LinearBlas blas;
    bool looked_up = false;
    bool forced = false;
    std::string info;
};

inline LinearState& linear_state() {
    static LinearState s;
    if (!s.looked_up) {  // GIL held: every caller is a bound function
        // find() raises on a bad PYENGINE_BLAS: then every call raises, none falls back silently.
        py::tuple t = py::module_::import("pyengine.kernels._blas").attr("find")();
        s.blas.sgemm = reinterpret_cast<void*>(t[0].cast<std::uintptr_t>());
        s.blas.dgemm = reinterpret_cast<void*>(t[1].cast<std::uintptr_t>());
        s.blas.set_threads_local = reinterpret_cast<pyengine::LinearBlas::local_t>(t[2].cast<std::uintptr_t>());
        s.blas.ilp64 = t[3].cast<bool>();
        s.info = t[4].cast<std::string>();
        s.looked_up = true;
    }
    return s;
}

inline bool linear_fast(index_t k) {
    const LinearState& s = linear_state();
    return !s.forced && s.blas.ready() && k > 0;
}

inline pyengine::Act parse_act(const std::string& a) {
    if (a == "none") return pyengine::Act::none;
    if (a == "gelu") return pyengine::Act::gelu;
    if (a == "gelu_tanh") return pyengine::Act::gelu_tanh;
    if (a == "relu") return pyengine::Act::relu;
    throw std::invalid_argument("activation must be one of 'none', 'gelu', 'gelu_tanh', 'relu', got '" + a + "'");
}

inline bool overlaps(const py::array& a, const py::array& b) {
    const auto* a0 = static_cast<const char*>(a.data());
    const auto* b0 = static_cast<const char*>(b.data());
    return a.nbytes() > 0 && b.nbytes() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

inline void no_overlap(const py::array& out, const char* oname, const py::array& other, const char* name) {
    if (overlaps(out, other)) {
        throw std::invalid_argument(std::string(oname) + " must not overlap " + name);
    }
}

// (N, k, n) of x (N, k) @ w (k, n); checks w, b and out.
template <class T>
std::array<index_t, 3> linear_dims(const carray<T>& x, const carray<T>& w, const std::optional<carray<T>>& b,
                                   const carray<T>& out) {
    if (x.ndim() != 2) throw std::invalid_argument("x must be 2-D (N, k), got shape " + shape_str(x));
    const index_t N = x.shape(0), k = x.shape(1);
    if (w.ndim() != 2 || w.shape(0) != k) {
        throw std::invalid_argument("w must have shape (" + std::to_string(k) + ", n) to match x " +
                                    shape_str(x) + ", got " + shape_str(w));
    }
    const index_t n = w.shape(1);
    if (b) expect_shape(*b, "b", {n});
    expect_shape(out, "out", {N, n});
    no_overlap(out, "out", x, "x");
    no_overlap(out, "out", w, "w");
    if (b) no_overlap(out, "out", *b, "b");
    return {N, k, n};
}

template <class T>
const T* ptr(const std::optional<carray<T>>& a) {
    return a ? a->data() : nullptr;
}

// numpy.matmul(x, w) into dst (GIL held): the fallback product.
template <class T>
void matmul_into(const carray<T>& x, const carray<T>& w, carray<T>& dst) {
    py::module_::import("numpy").attr("matmul")(x, w, py::arg("out") = dst);
}

template <class T>
std::int64_t linear(const carray<T>& x, const carray<T>& w, const std::optional<carray<T>>& b,
                    const std::optional<carray<T>>& r, carray<T>& out) {
    const auto [N, k, n] = linear_dims(x, w, b, out);
    const bool inplace = r && r->data() == out.data();
    if (r) {
        expect_shape(*r, "r", {N, n});
        if (!inplace) no_overlap(out, "out", *r, "r (unless r is out itself)");
    }
    if (N == 0 || n == 0) return 0;
    const T *xp = x.data(), *wp = w.data(), *bp = ptr(b), *rp = ptr(r);
    T* op = out.mutable_data();
    if (linear_fast(k)) {
        const pyengine::LinearBlas blas = linear_state().blas;
        py::gil_scoped_release release;  // only raw buffers and BLAS from here on (see bind_util.hpp)
        return pyengine::linear(blas, xp, wp, bp, rp, N, k, n, op);
    }
    if (inplace) {  // the product first, then added to out
        carray<T> prod({N, n});
        matmul_into(x, w, prod);
        T* pp = prod.mutable_data();
        py::gil_scoped_release release;
        return pyengine::linear_epilogue<T>(pp, bp, op, pyengine::Act::none, nullptr, 1, N, n, op);
    }
    matmul_into(x, w, out);
    py::gil_scoped_release release;
    return pyengine::linear_epilogue<T>(op, bp, rp, pyengine::Act::none, nullptr, 1, N, n, op);
}

template <class T>
std::int64_t linear_act(const carray<T>& x, const carray<T>& w, const std::optional<carray<T>>& b,
                        const std::string& activation, std::optional<carray<T>>& u, carray<T>& out) {
    const auto [N, k, n] = linear_dims(x, w, b, out);
    const pyengine::Act act = parse_act(activation);
    if (u) {
        expect_shape(*u, "u", {N, n});
        no_overlap(out, "out", *u, "u");
        no_overlap(*u, "u", x, "x");
        no_overlap(*u, "u", w, "w");
        if (b) no_overlap(*u, "u", *b, "b");
    }
    if (N == 0 || n == 0) return 0;
    const T *xp = x.data(), *wp = w.data(), *bp = ptr(b);
    T* up = u ? u->mutable_data() : nullptr;
    T* op = out.mutable_data();
    if (linear_fast(k)) {
        const pyengine::LinearBlas blas = linear_state().blas;
        py::gil_scoped_release release;
        return pyengine::linear_act(blas, xp, wp, bp, act, N, k, n, up, op);
    }
    matmul_into(x, w, u ? *u : out);
    T* pp = up != nullptr ? up : op;
    py::gil_scoped_release release;
    return pyengine::linear_epilogue<T>(pp, bp, nullptr, act, nullptr, 1, N, n, op);
}

template <class T>
std::int64_t linear_mul(const carray<T>& x, const carray<T>& w, const carray<T>& coef, carray<T>& out) {
    const auto [N, k, n] = linear_dims(x, w, std::optional<carray<T>>(), out);
    if (coef.ndim() != 2 || coef.shape(1) != n || (N > 0 && (coef.shape(0) == 0 || N % coef.shape(0) != 0))) {
        throw std::invalid_argument("coef must have shape (M, " + std::to_string(n) + ") with M dividing N = " +
                                    std::to_string(N) + ", got " + shape_str(coef));
    }
    const index_t M = coef.shape(0);
    no_overlap(out, "out", coef, "coef");
    if (N == 0 || n == 0) return 0;
    const T *xp = x.data(), *wp = w.data(), *cp = coef.data();
    T* op = out.mutable_data();
    if (linear_fast(k)) {
        const pyengine::LinearBlas blas = linear_state().blas;
        py::gil_scoped_release release;
        return pyengine::linear_mul(blas, xp, wp, cp, M, N, k, n, op);
    }
    matmul_into(x, w, out);
    py::gil_scoped_release release;
    return pyengine::linear_epilogue<T>(op, nullptr, nullptr, pyengine::Act::none, cp, M, N, n, op);
}


// linear_attention_jvp (linear_attention.hpp): -1 when the BLAS path is off (the caller then
// takes its numpy products); else the bad-row count.
template <class T>
std::int64_t linear_attention_jvp(const carray<T>& dqkv, const carray<T>& q, const carray<T>& k,
                                  const carray<T>& v, const carray<T>& p, index_t start, double scale,
                                  carray<T>& out) {
    if (q.ndim() != 4) throw std::invalid_argument("q must be 4-D (Hkv, g, tq, dh), got shape " + shape_str(q));
    const index_t Hkv = q.shape(0), g = q.shape(1), tq = q.shape(2), dh = q.shape(3), H = Hkv * g;
    if (start < 0) throw std::invalid_argument("start must be >= 0, got " + std::to_string(start));
    const index_t tk = start + tq;
    if (dqkv.ndim() != 4 || dqkv.shape(1) != tq || dqkv.shape(2) != H + 2 * Hkv || dqkv.shape(3) != dh) {
        throw std::invalid_argument("dqkv must have shape (K, " + std::to_string(tq) + ", " +
                                    std::to_string(H + 2 * Hkv) + ", " + std::to_string(dh) + ") to match q " +
                                    shape_str(q) + ", got " + shape_str(dqkv));
    }
    const index_t K = dqkv.shape(0);
    expect_shape(k, "k", {Hkv, tk, dh});
    expect_shape(v, "v", {Hkv, tk, dh});
    expect_shape(p, "p", {Hkv, g, tq, tk});
    expect_shape(out, "out", {K, tq, H, dh});
    no_overlap(out, "out", dqkv, "dqkv");
    no_overlap(out, "out", q, "q");
    no_overlap(out, "out", k, "k");
    no_overlap(out, "out", v, "v");
    no_overlap(out, "out", p, "p");
    if (!linear_fast(dh)) return -1;
    if (K == 0 || tq == 0 || H == 0) return 0;
    const pyengine::LinearBlas blas = linear_state().blas;
    const T *dp = dqkv.data(), *qp = q.data(), *kp = k.data(), *vp = v.data(), *pp = p.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;
    return pyengine::linear_attention_jvp<T>(blas, dp, qp, kp, vp, pp, K, tq, tk, H, Hkv, dh, start,
                                             static_cast<T>(scale), op);
}

// linear_attention_forward (linear_attention.hpp): -1 when the BLAS path is off.
template <class T>
std::int64_t linear_attention_forward(const carray<T>& qkv, const carray<T>& kp, const carray<T>& vp,
                                      index_t n_heads, index_t offset, double scale, carray<T>& out) {
    if (kp.ndim() != 3) throw std::invalid_argument("kp must be 3-D (Hkv, s, dh), got shape " + shape_str(kp));
    const index_t Hkv = kp.shape(0), s = kp.shape(1), dh = kp.shape(2), H = n_heads;
    if (Hkv == 0 || H <= 0 || H % Hkv != 0) {
        throw std::invalid_argument("n_heads must be a positive multiple of kp.shape[0] = " + std::to_string(Hkv) +
                                    ", got " + std::to_string(H));
    }
    if (qkv.ndim() != 4 || qkv.shape(2) != H + 2 * Hkv || qkv.shape(3) != dh) {
        throw std::invalid_argument("qkv must have shape (B, tq, " + std::to_string(H + 2 * Hkv) + ", " +
                                    std::to_string(dh) + ") to match kp " + shape_str(kp) + ", got " + shape_str(qkv));
    }
    const index_t B = qkv.shape(0), tq = qkv.shape(1);
    expect_shape(vp, "vp", {Hkv, s, dh});
    expect_shape(out, "out", {B, tq, H, dh});
    if (offset < 0) throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
    no_overlap(out, "out", qkv, "qkv");
    no_overlap(out, "out", kp, "kp");
    no_overlap(out, "out", vp, "vp");
    if (!linear_fast(dh)) return -1;
    if (B == 0 || tq == 0) return 0;
    const pyengine::LinearBlas blas = linear_state().blas;
    const T *qp = qkv.data(), *kpp = kp.data(), *vpp = vp.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;
    return pyengine::linear_attention_forward<T>(blas, qp, kpp, vpp, B, tq, s, H, Hkv, dh, offset,
                                                 static_cast<T>(scale), op);
}

template <class T>
void def_linear(py::module_& m) {
    m.def("linear", &linear<T>, py::arg("x").noconvert(), py::arg("w").noconvert(),
          py::arg("b").noconvert().none(true), py::arg("r").noconvert().none(true), py::arg("out").noconvert(),
          "out = x @ w (+ b) (+ r) (b, r None: omitted; r may be out); returns the rows with NaN/Inf.");
    m.def("linear_act", &linear_act<T>, py::arg("x").noconvert(), py::arg("w").noconvert(),
          py::arg("b").noconvert().none(true), py::arg("activation"), py::arg("u").noconvert().none(true),
          py::arg("out").noconvert(),
          "u = x @ w (+ b) (kept in u unless None), out = activation(u); returns the rows of u with NaN/Inf.");
    m.def("linear_mul", &linear_mul<T>, py::arg("x").noconvert(), py::arg("w").noconvert(),
          py::arg("coef").noconvert(), py::arg("out").noconvert(),
          "out = (x @ w) * coef (coef (M, n), M | N: row i uses coef[i % M]); returns the rows of x @ w with NaN/Inf.");
    m.def("linear_attention_jvp", &linear_attention_jvp<T>, py::arg("dqkv").noconvert(), py::arg("q").noconvert(),
          py::arg("k").noconvert(), py::arg("v").noconvert(), py::arg("p").noconvert(), py::arg("start"),
          py::arg("scale"), py::arg("out").noconvert(),
          "The attention JVP's head outputs (K, tq, H, dh) from the projections' tangents dqkv and the base q, k, v, p "
          "(linear_attention.hpp); -1 when the BLAS path is off, else the rows with NaN/Inf.");
    m.def("linear_attention_forward", &linear_attention_forward<T>, py::arg("qkv").noconvert(),
          py::arg("kp").noconvert(), py::arg("vp").noconvert(), py::arg("n_heads"), py::arg("offset"),
          py::arg("scale"), py::arg("out").noconvert(),
          "softmax(scale q k^T, keys j <= offset + t) v per sequence and head, the first kp.shape[1] keys and values "
          "shared (linear_attention.hpp); -1 when the BLAS path is off, else the bad rows.");
}

inline void register_linear(py::module_& m) {
    def_linear<float>(m);
    def_linear<double>(m);
    m.def(
        "linear_blas_info", [] {
            const LinearState& s = linear_state();
            if (s.forced) return std::string("numpy matmul + separate epilogue (forced by linear_force_fallback)");
            return s.info;
        },
        "Which path the linear kernels' products take, in words.");
    m.def(
        "linear_force_fallback", [](bool on) { linear_state().forced = on; }, py::arg("on"),
        "Force (True) or release (False) the numpy.matmul fallback of the linear kernels (for tests).");
}

}  // namespace pyengine::bind
