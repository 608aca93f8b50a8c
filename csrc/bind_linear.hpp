// Bindings of the dense-layer kernels (linear.hpp): register_linear(m) defines one overload per
// dtype of linear, linear_act, linear_mul, linear_attention_jvp and linear_attention_forward,
// with the reference's argument names, linear_epilogue (the epilogue alone), and set_blas /
// linear_blas_info / linear_force_fallback (which path the products take).
//
// BLAS: MKL from the mkl package (its threading layer sequential) or NumPy's own OpenBLAS,
// found once in Python (pyengine.kernels._blas.find(), ctypes) and handed over by
// pyengine.kernels._cpp through set_blas: the CBLAS sgemm/dgemm entry points and the
// library's per-thread count setter. The libraries stay loaded, so the pointers stay valid.
// Until set_blas is called every kernel that reads them raises. Without them (NumPy on MKL or
// Accelerate, an OpenBLAS older than 0.3.27, or linear_force_fallback(True)) the kernels
// return -1 and leave out untouched: the Python side then takes numpy.matmul and
// linear_epilogue. Nothing here imports a Python module.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bind_util.hpp"
#include "linear.hpp"
#include "linear_attention.hpp"

namespace pyengine::bind {

struct LinearState {
    pyengine::LinearBlas blas;
    bool set = false;
    bool forced = false;
    std::string info;
};

inline LinearState& linear_state_unchecked() {
    static LinearState s;
    return s;
}

// The state the kernels read (GIL held: every caller is a bound function); raises until
// set_blas has been called.
inline LinearState& linear_state() {
    LinearState& s = linear_state_unchecked();
    if (!s.set) {
        throw std::runtime_error(
            "pyengine._core: no BLAS handed over yet (pyengine.kernels._cpp calls set_blas when it is imported)");
    }
    return s;
}

// Whether the products go to the BLAS handed over (else the kernels return -1).
inline bool linear_fast() {
    const LinearState& s = linear_state();
    return !s.forced && s.blas.ready();
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

// x @ w with k = 0 is a product of zeros (what numpy.matmul gives): zeros, then the epilogue.
template <class T>
std::int64_t empty_product(index_t N, index_t n, T* p, const T* b, const T* r, pyengine::Act act, const T* coef,
                           index_t M, T* out) {
    std::fill_n(p, N * n, T(0));
    py::gil_scoped_release release;
    return pyengine::linear_epilogue<T>(p, b, r, act, coef, M, N, n, out);
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
    if (!linear_fast()) return -1;
    const T *xp = x.data(), *wp = w.data(), *bp = ptr(b), *rp = ptr(r);
    T* op = out.mutable_data();
    if (k == 0) {
        if (inplace) {  // the product (zeros) added to out
            std::vector<T> zeros(static_cast<std::size_t>(N * n));
            return empty_product<T>(N, n, zeros.data(), bp, op, pyengine::Act::none, nullptr, 1, op);
        }
        return empty_product<T>(N, n, op, bp, rp, pyengine::Act::none, nullptr, 1, op);
    }
    const pyengine::LinearBlas blas = linear_state().blas;
    py::gil_scoped_release release;  // only raw buffers and BLAS from here on (see bind_util.hpp)
    return pyengine::linear(blas, xp, wp, bp, rp, N, k, n, op);
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
    if (!linear_fast()) return -1;
    const T *xp = x.data(), *wp = w.data(), *bp = ptr(b);
    T* up = u ? u->mutable_data() : nullptr;
    T* op = out.mutable_data();
    if (k == 0) return empty_product<T>(N, n, up != nullptr ? up : op, bp, nullptr, act, nullptr, 1, op);
    const pyengine::LinearBlas blas = linear_state().blas;
    py::gil_scoped_release release;
    return pyengine::linear_act(blas, xp, wp, bp, act, N, k, n, up, op);
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
    if (!linear_fast()) return -1;
    const T *xp = x.data(), *wp = w.data(), *cp = coef.data();
    T* op = out.mutable_data();
    if (k == 0) return empty_product<T>(N, n, op, nullptr, nullptr, pyengine::Act::none, cp, M, op);
    const pyengine::LinearBlas blas = linear_state().blas;
    py::gil_scoped_release release;
    return pyengine::linear_mul(blas, xp, wp, cp, M, N, k, n, op);
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
    if (!linear_fast()) return -1;
    if (K == 0 || dh == 0 || tq == 0 || H == 0) return 0;
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
    if (!linear_fast()) return -1;
    if (B == 0 || dh == 0 || tq == 0) return 0;
    const pyengine::LinearBlas blas = linear_state().blas;
    const T *qp = qkv.data(), *kpp = kp.data(), *vpp = vp.data();
    T* op = out.mutable_data();
    py::gil_scoped_release release;
    return pyengine::linear_attention_forward<T>(blas, qp, kpp, vpp, B, tq, s, H, Hkv, dh, offset,
                                                 static_cast<T>(scale), op);
}

// The epilogue alone, for the Python side's numpy.matmul fallback: p (N, n) holds the product;
// p += b, p += r, then out = activation(p), or p * coef (coef (M, n), row i uses coef[i % M]);
// out may be p, and r may be out. Returns the rows of p with NaN/Inf.
template <class T>
std::int64_t linear_epilogue(carray<T>& p, const std::optional<carray<T>>& b, const std::optional<carray<T>>& r,
                             const std::string& activation, const std::optional<carray<T>>& coef, carray<T>& out) {
    if (p.ndim() != 2) throw std::invalid_argument("p must be 2-D (N, n), got shape " + shape_str(p));
    const index_t N = p.shape(0), n = p.shape(1);
    const pyengine::Act act = parse_act(activation);
    if (b) expect_shape(*b, "b", {n});
    if (r) expect_shape(*r, "r", {N, n});
    expect_shape(out, "out", {N, n});
    index_t M = 1;
    if (coef) {
        if (coef->ndim() != 2 || coef->shape(1) != n || (N > 0 && (coef->shape(0) == 0 || N % coef->shape(0) != 0))) {
            throw std::invalid_argument("coef must have shape (M, " + std::to_string(n) + ") with M dividing N = " +
                                        std::to_string(N) + ", got " + shape_str(*coef));
        }
        M = coef->shape(0);
        if (act != pyengine::Act::none) throw std::invalid_argument("coef is applied with activation 'none' only");
    }
    if (N == 0 || n == 0) return 0;
    T* pp = p.mutable_data();
    const T *bp = ptr(b), *rp = ptr(r), *cp = ptr(coef);
    T* op = out.mutable_data();
    py::gil_scoped_release release;
    return pyengine::linear_epilogue<T>(pp, bp, rp, act, cp, M, N, n, op);
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
    m.def("linear_epilogue", &linear_epilogue<T>, py::arg("p").noconvert(), py::arg("b").noconvert().none(true),
          py::arg("r").noconvert().none(true), py::arg("activation"), py::arg("coef").noconvert().none(true),
          py::arg("out").noconvert(),
          "p += b, p += r, out = activation(p) or p * coef (the numpy.matmul fallback's epilogue); returns the rows "
          "of p with NaN/Inf.");
}

inline void register_linear(py::module_& m) {
    def_linear<float>(m);
    def_linear<double>(m);
    m.def(
        "set_blas",
        [](std::uintptr_t sgemm, std::uintptr_t dgemm, std::uintptr_t set_threads_local, bool ilp64,
           const std::string& info) {
            LinearState& s = linear_state_unchecked();
            s.blas.sgemm = reinterpret_cast<void*>(sgemm);
            s.blas.dgemm = reinterpret_cast<void*>(dgemm);
            s.blas.set_threads_local = reinterpret_cast<pyengine::LinearBlas::local_t>(set_threads_local);
            s.blas.ilp64 = ilp64;
            s.info = info;
            s.set = true;
        },
        py::arg("sgemm"), py::arg("dgemm"), py::arg("set_threads_local"), py::arg("ilp64"), py::arg("info"),
        "Hand over the BLAS of the linear and attention kernels: the addresses of CBLAS sgemm, dgemm and the "
        "library's per-thread count setter (0: none, the kernels return -1), ILP64 or LP64, and its description.");
    m.def(
        "linear_blas_info", [] {
            const LinearState& s = linear_state();
            if (s.forced) return std::string("numpy matmul + separate epilogue (forced by linear_force_fallback)");
            return s.info;
        },
        "Which path the linear kernels' products take, in words.");
    m.def(
        "linear_blas_ready", [] { return linear_fast(); },
        "Whether the linear kernels' products take the BLAS handed over (found, and not forced off).");
    m.def(
        "linear_force_fallback", [](bool on) { linear_state_unchecked().forced = on; }, py::arg("on"),
        "Make the linear kernels return -1, as without a BLAS (True), or release that (False) (for tests).");
}

}  // namespace pyengine::bind
