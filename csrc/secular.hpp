// A single algorithm, longer than ~400 lines by exception: its specification is the
// docstring of pyengine/kernels/_numba/_secular.py, whose solver this file mirrors step
// by step. lambda_max of one token's normalization Jacobian by the secular equation.
//
// Pure C++17 on raw pointers, templated on T (float or double); used by spectral.hpp
// (the *_sigma_max kernels), whose header states the kernel contract.
//
// Per token, lambda_max of A = D^1/2 (I - U U^T) D^1/2 (D = diag(gamma^2),
// U = [a, b], at most two orthogonal columns) from the 2 x 2 secular matrix
// G(lam) = diag(kappa)/lam - sum_i u_i u_i^T/(delta_i - lam). The three largest distinct
// delta (D1 > D2 > D3) and their index groups are found once per call (make_poles);
// groups g1, g2 are summed exactly per token, everything else ("bulk") in vectorized
// passes over d. A rational model of the bulk, anchored at the last evaluated point, is
// solved exactly (O(1) steps); each bulk pass re-anchors it. 2-3 passes per token in
// practice.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "rows.hpp"

namespace pyengine {
namespace spectral_detail {

// Secular solver: stop when the root of the model anchored at the last evaluated point lies
// within kStop of the offset from the nearer pole of that point (error ~ kStop^2).
inline constexpr double kStop = 1e-7;
// The model's own root is iterated to this relative step.
inline constexpr double kInnerStop = 1e-15;
// Both stop at a step below this fraction of lambda too: the result is lambda, and a finer
// offset from a pole would not show in it (rounding noise could stall the tests).
inline constexpr double kLamStop = 1e-15;
// Cap on iterations, inner and outer (the bracket halves at worst).
inline constexpr int kMaxIt = 100;

// ---------------------------------------------------------------------------------------
// Per-call data on gamma

struct Poles {
    std::vector<double> delta;  // gamma^2
    double top[3] = {0.0, 0.0, 0.0};
    std::vector<index_t> g1, g2;
    std::vector<double> offs;  // (3, d): delta - top[k], +inf on g1 and g2 (1/inf = 0)
    index_t order[2] = {0, 0};  // the two largest delta (stable)
    double mean_delta = 0.0;
};

template <class T>
Poles make_poles(const T* gamma, index_t d) {
    Poles p;
    const auto du = static_cast<std::size_t>(d);
    p.delta.resize(du);
    for (std::size_t i = 0; i < du; ++i) {
        const double g = static_cast<double>(gamma[i]);
        p.delta[i] = g * g;
        p.mean_delta += p.delta[i];
    }
    p.mean_delta /= static_cast<double>(d);
    std::vector<double> vals;
    for (double v : p.delta) {
        if (v > 0.0) {
            vals.push_back(v);
        }
    }
    std::sort(vals.begin(), vals.end(), [](double a, double b) { return a > b; });
    vals.erase(std::unique(vals.begin(), vals.end()), vals.end());
    for (std::size_t k = 0; k < 3 && k < vals.size(); ++k) {
        p.top[k] = vals[k];
    }
    for (index_t i = 0; i < d; ++i) {
        const double v = p.delta[static_cast<std::size_t>(i)];
        if (p.top[0] > 0.0 && v == p.top[0]) {
            p.g1.push_back(i);
        } else if (p.top[1] > 0.0 && v == p.top[1]) {
            p.g2.push_back(i);
        }
    }
    p.offs.resize(3 * du);
    for (std::size_t k = 0; k < 3; ++k) {
        for (std::size_t i = 0; i < du; ++i) {
            p.offs[k * du + i] = p.delta[i] - p.top[k];
        }
        for (index_t i : p.g1) {
            p.offs[k * du + static_cast<std::size_t>(i)] = kInf;
        }
        for (index_t i : p.g2) {
            p.offs[k * du + static_cast<std::size_t>(i)] = kInf;
        }
    }
    std::vector<index_t> idx(du);
    for (index_t i = 0; i < d; ++i) {
        idx[static_cast<std::size_t>(i)] = i;
    }
    std::stable_sort(idx.begin(), idx.end(), [&](index_t a, index_t b) {
        return p.delta[static_cast<std::size_t>(a)] > p.delta[static_cast<std::size_t>(b)];
    });
    p.order[0] = idx[0];
    p.order[1] = idx[d > 1 ? 1 : 0];
    return p;
}

// ---------------------------------------------------------------------------------------
// One token's columns: a_i, b_i

enum class Cols { kLN2, kLN1, kRMS1 };  // LayerNorm; constant column (frozen LN); RMSNorm

template <class T>
struct Row {
    Cols kind;
    const T* x;  // unused for kLN1
    double mu, ca, cb;

    // (a_i, b_i): kLN2: (ca, cb (x_i - mu)); kRMS1: (ca x_i, 0); kLN1: (ca, 0).
    std::pair<double, double> col(index_t i) const {
        if (kind == Cols::kLN2) {
            return {ca, cb * (static_cast<double>(x[i]) - mu)};
        }
        if (kind == Cols::kRMS1) {
            return {ca * static_cast<double>(x[i]), 0.0};
        }
        return {ca, 0.0};
    }
};

// N = sum q u u^T and N' = sum q^2 u u^T over the bulk, q_i = 1/(e_i + off).
struct Bulk {
    double naa = 0.0, nab = 0.0, nbb = 0.0, paa = 0.0, pab = 0.0, pbb = 0.0;
};

template <class T>
Bulk bulk(const Row<T>& r, const double* e, index_t d, double off) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0, s5 = 0.0;
    index_t j = 0;
    const bool ln2 = r.kind == Cols::kLN2;
    const bool rms = r.kind == Cols::kRMS1;
#ifdef __AVX__
    {
        const __m256d vo = _mm256_set1_pd(off);
        const __m256d one = _mm256_set1_pd(1.0);
        __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        if (ln2) {
            const __m256d vm = _mm256_set1_pd(r.mu);
            for (; j + 4 <= d; j += 4) {
                const __m256d q = one / (_mm256_loadu_pd(e + j) + vo);
                const __m256d t = Lanes4::load(r.x + j) - vm;
                const __m256d qt = q * t;
                const __m256d q2 = q * q;
                const __m256d q2t = q2 * t;
                a0 += q;
                a1 += qt;
                a2 += qt * t;
                a3 += q2;
                a4 += q2t;
                a5 += q2t * t;
            }
        } else if (rms) {
            for (; j + 4 <= d; j += 4) {
                const __m256d q = one / (_mm256_loadu_pd(e + j) + vo);
                const __m256d t = Lanes4::load(r.x + j);
                const __m256d qt2 = q * t * t;
                a2 += qt2;
                a5 += q * qt2;
            }
        } else {
            for (; j + 4 <= d; j += 4) {
                const __m256d q = one / (_mm256_loadu_pd(e + j) + vo);
                a0 += q;
                a3 += q * q;
            }
        }
        s0 = sum_lanes(a0), s1 = sum_lanes(a1), s2 = sum_lanes(a2);
        s3 = sum_lanes(a3), s4 = sum_lanes(a4), s5 = sum_lanes(a5);
    }
#endif
    for (; j < d; ++j) {
        const double q = 1.0 / (e[j] + off);
        if (ln2) {
            const double t = static_cast<double>(r.x[j]) - r.mu;
            const double qt = q * t;
            const double q2 = q * q;
            const double q2t = q2 * t;
            s0 += q;
            s1 += qt;
            s2 += qt * t;
            s3 += q2;
            s4 += q2t;
            s5 += q2t * t;
        } else if (rms) {
            const double t = static_cast<double>(r.x[j]);
            const double qt2 = q * t * t;
            s2 += qt2;
            s5 += q * qt2;
        } else {
            s0 += q;
            s3 += q * q;
        }
    }
    Bulk b;
    if (ln2) {
        b.naa = r.ca * r.ca * s0, b.nab = r.ca * r.cb * s1, b.nbb = r.cb * r.cb * s2;
        b.paa = r.ca * r.ca * s3, b.pab = r.ca * r.cb * s4, b.pbb = r.cb * r.cb * s5;
    } else if (rms) {
        b.naa = r.ca * r.ca * s2, b.paa = r.ca * r.ca * s5;
    } else {
        b.naa = r.ca * r.ca * s0, b.paa = r.ca * r.ca * s3;
    }
    return b;
}

// S = sum_{i in g} u_i u_i^T with its exact rank and determinant.
struct Group {
    double aa = 0.0, ab = 0.0, bb = 0.0, det = 0.0;
    int rank = 0;
};

template <class T>
Group group(const Row<T>& r, const std::vector<index_t>& g) {
    Group s;
    for (index_t i : g) {
        const auto [a, b] = r.col(i);
        s.aa += a * a;
        s.ab += a * b;
        s.bb += b * b;
    }
    if (g.empty()) {
        return s;
    }
    if (r.kind == Cols::kLN2) {  // a constant: rank 1 iff x (so b) is constant on g, or cb = 0
        s.rank = 1;
        if (r.cb != 0.0) {
            for (index_t i : g) {
                if (r.x[i] != r.x[g[0]]) {
                    s.rank = 2;
                    break;
                }
            }
        }
    } else if (r.kind == Cols::kRMS1) {
        if (r.ca != 0.0) {
            for (index_t i : g) {
                if (r.x[i] != T(0)) {
                    s.rank = 1;
                    break;
                }
            }
        }
    } else {
        s.rank = r.ca != 0.0 ? 1 : 0;
    }
    if (s.rank == 2) {
        if (g.size() == 2) {  // Lagrange: (a_i b_j - a_j b_i)^2, no cancellation
            const auto [ai, bi] = r.col(g[0]);
            const auto [aj, bj] = r.col(g[1]);
            const double c = ai * bj - aj * bi;
            s.det = c * c;
        } else {
            s.det = std::max(s.aa * s.bb - s.ab * s.ab, 0.0);
        }
    }
    return s;
}

// Upper bound on D1 - lambda_max: lambda_min(D1 I - A_sub), A_sub the principal 2 x 2
// submatrix of A on the two largest delta (Cauchy interlacing), without cancellation.
template <class T>
double tau_bound(const Row<T>& r, const Poles& p) {
    const auto [a1, b1] = r.col(p.order[0]);
    const auto [a2, b2] = r.col(p.order[1]);
    const double d1 = p.delta[static_cast<std::size_t>(p.order[0])];
    const double d2 = p.delta[static_cast<std::size_t>(p.order[1])];
    const double n1 = a1 * a1 + b1 * b1;
    const double n2 = a2 * a2 + b2 * b2;
    const double gap = p.top[0] - d2;
    const double t11 = d1 * n1;
    const double t22 = gap + d2 * n2;
    const double t12 = std::sqrt(d1 * d2) * (a1 * a2 + b1 * b2);
    const double c = a1 * b2 - a2 * b1;
    const double det = d1 * (n1 * gap + d2 * c * c);
    const double big = 0.5 * (t11 + t22) + std::hypot(0.5 * (t11 - t22), t12);
    return big > 0.0 ? det / big : 0.0;
}

// (mu_min, mu_max, v_max) of [[p, q], [q, r]] with determinant det: the eigenvalue of larger
// magnitude from the trace, the other as det / it.
struct Eig2 {
    double lo, hi, v0, v1;
};

inline Eig2 eig2(double p, double q, double r, double det) {
    const double h = 0.5 * (p - r);
    const double m = 0.5 * (p + r);
    const double rad = std::hypot(h, q);
    double lo, hi;
    if (m >= 0.0) {
        hi = m + rad;
        lo = hi != 0.0 ? det / hi : m - rad;
    } else {
        lo = m - rad;
        hi = det / lo;
    }
    double v0, v1;
    if (h >= 0.0) {
        v0 = h + rad, v1 = q;
    } else {
        v0 = q, v1 = rad - h;
    }
    const double nv = std::hypot(v0, v1);
    if (nv == 0.0) {
        return {lo, hi, 1.0, 0.0};
    }
    return {lo, hi, v0 / nv, v1 / nv};
}

// ---------------------------------------------------------------------------------------
// The secular solver. Points of (lo, hi) are pairs (y, tau) = (lam - lo, hi - lam); the
// smaller one is the exact one.

struct Interval {
    double lo, hi, d1, d2, p, ka, kb;
    bool two, want_max, g2_right;
    index_t m2;
    double lam(double y, double tau) const { return tau <= y ? hi - tau : lo + y; }
};

struct Bracket {
    double ylo, tlo, yhi, thi;
    void narrow(double y, double tau, double target) {
        if (target > 0.0) {
            ylo = y, tlo = tau;
        } else if (target < 0.0) {
            yhi = y, thi = tau;
        }
    }
    bool inside(double y, double tau) const {
        return tau <= y ? (thi < tau && tau < tlo) : (ylo < y && y < yhi);
    }
    bool done(const Interval& iv) const {
        const double lam_lo = iv.lo + ylo;
        return yhi - ylo <= 4e-16 * lam_lo || tlo - thi <= 4e-16 * lam_lo;
    }
};

struct Target {
    double target, psi, dpsi, dphi;
};

// The target eigenvalue of G at (y, tau) given the bulk's N and N' there, and the pieces of
// the rational step: psi = -v^T R v (R: right-pole terms), dpsi, dphi the right and left
// parts of d(v^T G v)/dlam at the target's eigenvector v.
inline Target target(const Interval& iv, const Group& s1, const Group& s2, double y, double tau,
                     const Bulk& n) {
    const bool near_hi = tau <= y;
    double lam, den1, den2;
    if (near_hi) {
        lam = iv.hi - tau;
        den1 = (iv.d1 - iv.hi) + tau;
        den2 = (iv.d2 - iv.hi) + tau;
    } else {
        lam = iv.lo + y;
        den1 = (iv.d1 - iv.lo) - y;
        den2 = (iv.d2 - iv.lo) - y;
    }
    const double i1 = 1.0 / den1;
    const double i2 = iv.m2 > 0 ? 1.0 / den2 : 0.0;
    const double t2aa = s2.aa * i2, t2ab = s2.ab * i2, t2bb = s2.bb * i2;
    double raa = s1.aa * i1, rab = s1.ab * i1, rbb = s1.bb * i1;
    double qaa = raa * i1, qab = rab * i1, qbb = rbb * i1;
    double daa = n.paa + iv.ka / (lam * lam);
    double dab = n.pab;
    double dbb = n.pbb + iv.kb / (lam * lam);
    if (iv.g2_right) {
        raa += t2aa, rab += t2ab, rbb += t2bb;
        qaa += t2aa * i2, qab += t2ab * i2, qbb += t2bb * i2;
    } else {
        daa += t2aa * i2, dab += t2ab * i2, dbb += t2bb * i2;
    }
    const double gaa = iv.ka / lam - n.naa - s1.aa * i1 - t2aa;
    const double gab = -n.nab - s1.ab * i1 - t2ab;
    const double gbb = iv.kb / lam - n.nbb - s1.bb * i1 - t2bb;
    double tg, v0, v1;
    if (iv.two) {
        // det G with the group at the nearer pole split off:
        // det(K - S/den) = det K - tr(adj(K) S)/den + det(S)/den^2.
        int o = 0;
        if (near_hi) {
            o = iv.g2_right ? 2 : 1;
        } else if (!iv.g2_right && iv.m2 > 0) {
            o = 2;
        }
        double det;
        if (o > 0) {
            const Group& so = o == 1 ? s1 : s2;
            const double io = o == 1 ? i1 : i2;
            const double kaa = gaa + so.aa * io, kab = gab + so.ab * io, kbb = gbb + so.bb * io;
            det = (kaa * kbb - kab * kab) - (kbb * so.aa - 2.0 * kab * so.ab + kaa * so.bb) * io;
            det += so.det * io * io;
        } else {
            det = gaa * gbb - gab * gab;
        }
        const Eig2 e = eig2(gaa, gab, gbb, det);
        if (iv.want_max) {
            tg = e.hi, v0 = e.v0, v1 = e.v1;
        } else {
            tg = e.lo, v0 = -e.v1, v1 = e.v0;
        }
    } else {
        tg = gaa, v0 = 1.0, v1 = 0.0;
    }
    const double psi = -(v0 * v0 * raa + 2.0 * v0 * v1 * rab + v1 * v1 * rbb);
    const double dpsi = -(v0 * v0 * qaa + 2.0 * v0 * v1 * qab + v1 * v1 * qbb);
    const double dphi = -(v0 * v0 * daa + 2.0 * v0 * v1 * dab + v1 * v1 * dbb);
    return {tg, psi, dpsi, dphi};
}

// Root eta in (-y, tau) of the "middle way" model a0 - s_R/(tau - eta) + s_L/(y + eta),
// fitted to the target's value and split derivative at eta = 0; NaN if none.
inline double step(double y, double tau, const Target& t) {
    const double s_r = -t.dpsi * tau * tau;
    const double s_l = -t.dphi * y * y;
    const double a0 = (t.psi + s_r / tau) + ((t.target - t.psi) - s_l / y);
    // -a0 eta^2 + b1 eta + c0 = 0 with c0 = tau y target (the model is exact at eta = 0).
    const double c0 = tau * y * t.target;
    const double b1 = a0 * (tau - y) - s_r - s_l;
    const double disc = b1 * b1 + 4.0 * a0 * c0;
    const double sq = disc > 0.0 ? std::sqrt(disc) : 0.0;
    const double qq = 0.5 * (b1 + std::copysign(sq, b1));
    if (qq != 0.0) {
        const double eta = -c0 / qq;
        if (-y < eta && eta < tau) {
            return eta;
        }
    }
    if (a0 != 0.0) {
        const double eta = qq / a0;
        if (-y < eta && eta < tau) {
            return eta;
        }
    }
    return kNaN;
}

// The point moved by eta if that stays strictly inside the bracket (moved = true), else the
// bracket's midpoint.
inline bool advance(const Interval& iv, const Bracket& br, double& y, double& tau, double eta) {
    const double w = iv.hi - iv.lo;
    if (!std::isnan(eta)) {
        double ny, nt;
        if (tau <= y) {
            nt = tau - eta;
            ny = w - nt;
        } else {
            ny = y + eta;
            nt = w - ny;
        }
        if (br.inside(ny, nt)) {
            y = ny, tau = nt;
            return true;
        }
    }
    y = 0.5 * (br.ylo + br.yhi);
    tau = 0.5 * (br.tlo + br.thi);
    return false;
}

// The anchor of the bulk model: the point and N, N' there.
struct Anchor {
    double y, tau;
    Bulk n;
};

// Root of the model secular function (the bulk replaced by its rational fit at the anchor,
// N(lam) ~ N_a + N'_a (lam_a - p)(lam - lam_a)/(lam - p), exact in value and derivative at
// lam_a; groups and the kappa term exact), iterated to full precision in O(1) steps.
inline void model_root(const Interval& iv, const Group& s1, const Group& s2, const Anchor& an,
                       const Bracket& outer, double& y, double& tau) {
    Bracket br = outer;
    const double la_p = an.y < an.tau ? (iv.lo - iv.p) + an.y : (iv.hi - iv.p) - an.tau;
    for (int it = 0; it < kMaxIt; ++it) {
        double dl, l_p;
        if (tau <= y) {
            dl = an.tau - tau;
            l_p = (iv.hi - iv.p) - tau;
        } else {
            dl = y - an.y;
            l_p = (iv.lo - iv.p) + y;
        }
        const double r = la_p / l_p;
        const double f = r * dl;
        const double r2 = r * r;
        Bulk m;
        m.naa = an.n.naa + an.n.paa * f, m.nab = an.n.nab + an.n.pab * f;
        m.nbb = an.n.nbb + an.n.pbb * f;
        m.paa = an.n.paa * r2, m.pab = an.n.pab * r2, m.pbb = an.n.pbb * r2;
        const Target t = target(iv, s1, s2, y, tau, m);
        br.narrow(y, tau, t.target);
        if (t.target == 0.0) {
            return;
        }
        const double eta = step(y, tau, t);
        // Converged: the point is within |eta| of the model's root. (Tested before the
        // bracket: the point itself may have just become an end of it. NaN fails it.)
        if (std::abs(eta) <= std::max(kInnerStop * std::min(y, tau), kLamStop * iv.lam(y, tau))) {
            return;
        }
        if (!advance(iv, br, y, tau, eta) && br.done(iv)) {
            return;
        }
    }
}

// lambda_max of D^1/2 (I - U U^T) D^1/2 for one token (pyengine/_numba/spectral.py).
template <class T>
double lambda_max(const Row<T>& r, double ka, double kb, const Poles& p, index_t d) {
    const double d1 = p.top[0], d2 = p.top[1], d3 = p.top[2];
    if (d1 == 0.0) {
        return 0.0;
    }
    const auto du = static_cast<std::size_t>(d);
    const double* offs[3] = {p.offs.data(), p.offs.data() + du, p.offs.data() + 2 * du};
    const auto m1 = static_cast<index_t>(p.g1.size());
    const auto m2 = static_cast<index_t>(p.g2.size());
    const Group s1 = group(r, p.g1);
    if (m1 > s1.rank) {
        return d1;
    }
    const Group s2 = group(r, p.g2);
    const bool two = r.kind == Cols::kLN2;
    const double tau_r = tau_bound(r, p);
    const double gap = d1 - d2;
    // The first anchor: D2 when the interval must be decided there (or the bound is of no
    // use), else the lower bound lam_R = D1 - tau_R, else D1/2.
    const bool need_limit = m1 == 1 && s2.rank < 2 && d2 > 0.0 && !(tau_r < gap);
    int at;
    Bulk n;
    if (d2 > 0.0 && (need_limit || !(0.0 < tau_r && tau_r < gap))) {
        at = 0;
        n = bulk(r, offs[1], d, 0.0);
    } else if (0.0 < tau_r && tau_r < gap) {
        at = 1;
        n = bulk(r, offs[0], d, tau_r);
    } else {
        at = 2;
        n = bulk(r, offs[0], d, 0.5 * d1);
    }
    bool in_top = true;
    if (need_limit) {
        // The eigenvalue of G that stays finite as lam -> D2+ (g2 removed, at lam = D2).
        const double inv = 1.0 / gap;
        const double kaa = ka / d2 - n.naa - s1.aa * inv;
        const double kab = -n.nab - s1.ab * inv;
        const double kbb = kb / d2 - n.nbb - s1.bb * inv;
        double lim;
        if (s2.rank == 1) {
            double pa = 0.0, pb = 0.0;
            for (index_t i : p.g2) {
                std::tie(pa, pb) = r.col(i);
                if (pa != 0.0 || pb != 0.0) {
                    break;
                }
            }
            lim = pb * pb * kaa - 2.0 * pa * pb * kab + pa * pa * kbb;  // u_perp = (-pb, pa)
        } else {
            lim = two ? 0.5 * (kaa + kbb) - std::hypot(0.5 * (kaa - kbb), kab) : kaa;
        }
        in_top = lim > 0.0;
    }
    Interval iv{};
    const double *e_hi, *e_lo;
    if (in_top) {
        iv.lo = d2, iv.hi = d1;
        e_hi = offs[0], e_lo = offs[1];
        iv.want_max = m1 != 1;
        iv.g2_right = false;
    } else {
        if (m2 > s2.rank) {
            return d2;
        }
        iv.lo = d3, iv.hi = d2;
        e_hi = offs[1], e_lo = offs[2];
        iv.want_max = true;
        iv.g2_right = true;
    }
    iv.d1 = d1, iv.d2 = d2, iv.p = d3, iv.ka = ka, iv.kb = kb, iv.two = two, iv.m2 = m2;
    const double w = iv.hi - iv.lo;
    Bracket br{0.0, w, w, 0.0};
    Anchor an{};
    if (at == 0) {
        an.y = in_top ? 0.0 : w;
        an.tau = in_top ? w : 0.0;
    } else if (at == 1) {
        an.y = w - tau_r, an.tau = tau_r;
    } else {
        an.y = 0.5 * w, an.tau = 0.5 * w;
    }
    an.n = n;
    bool evaluated = at != 0;  // an interior anchor: its true target is known
    double y, tau;
    if (evaluated) {
        br.narrow(an.y, an.tau, target(iv, s1, s2, an.y, an.tau, n).target);
        y = an.y, tau = an.tau;
    } else if (in_top && 0.0 < tau_r && tau_r < w) {
        y = w - tau_r, tau = tau_r;
    } else {
        y = 0.5 * w, tau = 0.5 * w;
    }
    for (int it = 0; it < kMaxIt; ++it) {
        model_root(iv, s1, s2, an, br, y, tau);
        if (evaluated) {
            const double dist = tau <= y ? std::abs(an.tau - tau) : std::abs(y - an.y);
            if (dist <= std::max(kStop * std::min(y, tau), kLamStop * iv.lam(y, tau))) {
                return iv.lam(y, tau);
            }
        }
        if (!br.inside(y, tau)) {
            y = 0.5 * (br.ylo + br.yhi);
            tau = 0.5 * (br.tlo + br.thi);
            if (br.done(iv)) {
                return iv.lam(y, tau);
            }
        }
        n = tau <= y ? bulk(r, e_hi, d, tau) : bulk(r, e_lo, d, -y);
        const double tg = target(iv, s1, s2, y, tau, n).target;
        if (tg == 0.0) {
            return iv.lam(y, tau);
        }
        br.narrow(y, tau, tg);
        an.y = y, an.tau = tau, an.n = n;
        evaluated = true;
    }
    return iv.lam(y, tau);
}

}  // namespace spectral_detail
}  // namespace pyengine
