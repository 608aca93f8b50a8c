"""The spectral kernels: exact sigma_max against dense SVDs, every backend against the
reference, and the guarantees of the fused power iteration.

The kernels are called through the registry (kernel contract: C-contiguous arrays of
one dtype, preallocated float64 / int64 outputs, the bad-row count returned); the
public functions built on them are tested in test_spectral.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

import pyengine as pe
from pyengine import backends

NORMS = ("layer_norm", "rms_norm")
#: Agreement in lambda = (s sigma)^2: relative, plus an absolute floor of a few ulps of
#: max(gamma^2), the rounding of the data that any method inherits (module docstring of
#: pyengine.kernels._numba.spectral). Typical errors are 1e-15.
LAM_RTOL = 1e-12
LAM_ATOL = 1e-14


def kernel(norm, what, backend):
    return backends.resolve(f"{norm}_{what}", backend)


def scale2(norm, x, eps):
    """s^2 (LayerNorm) or r^2 (RMSNorm) per row, float64."""
    xd = np.asarray(x, np.float64)
    ms = xd.var(-1) if norm == "layer_norm" else np.mean(xd * xd, -1)
    return ms + eps


def sigma_max(norm, x, gamma, eps, frozen, backend="numpy"):
    out = np.full(x.shape[0], -1.0)
    nbad = kernel(norm, "sigma_max", backend)(x, gamma, eps, frozen, out)
    assert nbad == 0
    return out


def dense_sigma(norm, x, gamma, eps, frozen):
    """sigma_max by SVD of the dense float64 Jacobians (the reference's dense kernel)."""
    xd, gd = np.asarray(x, np.float64), np.asarray(gamma, np.float64)
    jac = getattr(pe, norm + "_jacobian")(xd, gd, eps, "frozen_scale" if frozen else "full", backend="numpy")
    return np.array([scipy.linalg.svdvals(j)[0] for j in jac])


def assert_sigma_close(got, want, norm, x, gamma, eps, rtol=LAM_RTOL, atol=LAM_ATOL):
    """|lambda - lambda_ref| <= rtol lambda_ref + atol max(gamma^2), lambda = s^2 sigma^2."""
    s2 = scale2(norm, x, eps)
    lam, ref = got**2 * s2, want**2 * s2
    bound = rtol * ref + atol * float(np.max(np.asarray(gamma, np.float64) ** 2))
    bad = np.abs(lam - ref) > bound
    assert not bad.any(), (
        f"rows {np.flatnonzero(bad)}: got {got[bad]}, want {want[bad]}, "
        f"relative {np.abs(got[bad] / want[bad] - 1)}"
    )


# --------------------------------------------------------------------------- #
# Test data: awkward gamma and awkward rows
# --------------------------------------------------------------------------- #

GAMMAS = ["random", "constant", "top_repeated", "zeros", "all_but_one", "dyadic"]


def make_gamma(kind, d, rng):
    g = 1.0 + 0.5 * rng.standard_normal(d)
    if kind == "constant":
        g[:] = -0.7
    elif kind == "top_repeated":  # the two largest |gamma| equal (opposite signs)
        g[0], g[-1] = 2.5, -2.5
    elif kind == "zeros":
        g[: d // 2] = 0.0
    elif kind == "all_but_one":
        g[:] = 1.3
        g[d // 2] = 2.0 if d % 2 else 0.4  # the odd one largest, or smallest
    elif kind == "dyadic":  # many equal values
        g = np.round(rng.uniform(-2, 2, d) * 2) / 2
        if not g.any():
            g[0] = 1.0
    return g


def make_rows(d, eps, rng):
    """Random rows, a large-mean row, an outlier at the largest |gamma| index (set by the
    caller), a row with two equal entries, and a constant row when eps > 0."""
    rows = [rng.standard_normal(d), 1e4 + rng.standard_normal(d), rng.standard_normal(d),
            3.0 * rng.standard_normal(d)]
    if d > 2:
        rows[3][:2] = 0.75  # equal entries (deflation when they meet equal gamma)
    if eps > 0:
        rows.append(np.full(d, 1.5))
    return np.array(rows)


# --------------------------------------------------------------------------- #
# The reference against dense SVDs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("gkind", GAMMAS)
@pytest.mark.parametrize("d", [2, 3, 5, 17, 64])
def test_sigma_max_reference_matches_svd(d, gkind):
    rng = np.random.default_rng(d * 31 + GAMMAS.index(gkind))
    gamma = make_gamma(gkind, d, rng)
    for eps in (0.0, 1e-5, 10.0):
        x = make_rows(d, eps, rng)
        x[2, np.argmax(np.abs(gamma))] += 40.0  # an outlier where gamma is largest
        for dtype in (np.float64, np.float32):
            xt, gt = x.astype(dtype), gamma.astype(dtype)
            for norm in NORMS:
                for frozen in (False, True):
                    if d == 2 and norm == "layer_norm" and not frozen and eps == 0.0:
                        continue  # J = 0 exactly: checked in test_sigma_max_closed_forms
                    got = sigma_max(norm, xt, gt, eps, frozen)
                    want = dense_sigma(norm, xt, gt, eps, frozen)
                    assert_sigma_close(got, want, norm, xt, gt, eps)


def test_sigma_max_closed_forms(backend):
    """|g|/s for constant gamma (d >= 3), max|gamma|/r for frozen RMSNorm, and LayerNorm at
    d = 2: (eps/s^2) sqrt(mean gamma^2)/s (0 when eps = 0), sqrt(mean gamma^2)/s frozen."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 9)) * [[1], [10], [1e-3], [1], [5], [1]] + [[0], [0], [0], [1e4], [0], [-3]]
    for g in (0.8, -1.7):
        gamma = np.full(9, g)
        for eps in (0.0, 1e-5, 2.0):
            s = np.sqrt(scale2("layer_norm", x, eps))
            for frozen in (False, True):
                got = sigma_max("layer_norm", x, gamma, eps, frozen, backend)
                np.testing.assert_allclose(got, abs(g) / s, rtol=1e-14)
    gamma = rng.uniform(-2, 2, 9)
    r = np.sqrt(scale2("rms_norm", x, 1e-5))
    got = sigma_max("rms_norm", x, gamma, 1e-5, True, backend)
    np.testing.assert_allclose(got, np.abs(gamma).max() / r, rtol=1e-14)
    x2 = rng.standard_normal((5, 2)) * np.logspace(-3, 1, 5)[:, None]
    g2 = np.array([0.7, -1.9])
    for eps in (0.0, 1e-5, 1.0):
        s2 = scale2("layer_norm", x2, eps)
        want = (eps / s2) * np.sqrt(np.mean(g2**2)) / np.sqrt(s2)
        np.testing.assert_allclose(sigma_max("layer_norm", x2, g2, eps, False, backend), want,
                                   rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(sigma_max("layer_norm", x2, g2, eps, True, backend),
                                   np.sqrt(np.mean(g2**2) / s2), rtol=1e-14)


# --------------------------------------------------------------------------- #
# Every compiled backend against the reference
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("gkind", GAMMAS)
@pytest.mark.parametrize("d", [2, 3, 5, 17, 64, 300])
def test_sigma_max_matches_reference(compiled, dtype, d, gkind):
    rng = np.random.default_rng(d + 7 * GAMMAS.index(gkind))
    gamma = make_gamma(gkind, d, rng).astype(dtype)
    for eps in (0.0, 1e-5, 10.0):
        x = make_rows(d, eps, rng)
        x[2, np.argmax(np.abs(gamma))] += 40.0
        x = x.astype(dtype)
        for norm in NORMS:
            for frozen in (False, True):
                want = sigma_max(norm, x, gamma, eps, frozen)
                got = sigma_max(norm, x, gamma, eps, frozen, compiled)
                assert_sigma_close(got, want, norm, x, gamma, eps)


def test_sigma_max_large_rows_match_reference(compiled):
    """Realistic widths, dense gamma near the top (roots between close poles)."""
    rng = np.random.default_rng(5)
    for d in (768, 4096):
        x = (1.0 + rng.standard_normal((6, d))).astype(np.float32)
        x[1, 7] = 300.0  # a massive activation
        gamma = rng.uniform(0.5, 1.5, d).astype(np.float32)
        for norm in NORMS:
            want = sigma_max(norm, x, gamma, 1e-5, False)
            got = sigma_max(norm, x, gamma, 1e-5, False, compiled)
            assert_sigma_close(got, want, norm, x, gamma, 1e-5)


def test_sigma_max_bad_rows(backend):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 8))
    x[1, 3] = np.nan
    x[3] = 2.0  # constant: zero variance, bad for LayerNorm with eps = 0
    x[4] = 0.0  # zero: bad for RMSNorm with eps = 0
    gamma = rng.uniform(0.5, 1.5, 8)
    for norm, bad in (("layer_norm", [1, 3, 4]), ("rms_norm", [1, 4])):
        out = np.zeros(5)
        assert kernel(norm, "sigma_max", backend)(x, gamma, 0.0, False, out) == len(bad)
        assert np.isnan(out[bad]).all()
        good = np.setdiff1d(np.arange(5), bad)
        assert_sigma_close(out[good], dense_sigma(norm, x[good], gamma, 0.0, False), norm,
                           x[good], gamma, 0.0)


# --------------------------------------------------------------------------- #
# Power iteration
# --------------------------------------------------------------------------- #


def power(norm, x, gamma, eps, frozen, v0, tol, max_iter, backend):
    n = x.shape[0]
    sig, res, its = np.full(n, -1.0), np.full(n, -1.0), np.full(n, -1, np.int64)
    nbad = kernel(norm, "power_iteration", backend)(x, gamma, eps, frozen, v0, tol, max_iter, sig, res, its)
    return nbad, sig, res, its


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("frozen", [False, True], ids=["full", "frozen"])
def test_power_iteration_bounds_and_convergence(backend, dtype, norm, frozen):
    """sigma <= exact for every token; converged tokens within tol of exact; iterations <= max_iter."""
    rng = np.random.default_rng(2)
    n, d = 24, 48
    x = (rng.standard_normal((n, d)) + rng.uniform(-2, 2, (n, 1))).astype(dtype)
    gamma = rng.uniform(0.2, 2.0, d).astype(dtype)
    v0 = rng.standard_normal((n, d)).astype(dtype)
    exact = sigma_max(norm, x, gamma, 1e-5, frozen)
    for tol, max_iter in ((1e-8, 3000), (1e-4, 40), (1e-12, 5)):
        nbad, sig, res, its = power(norm, x, gamma, 1e-5, frozen, v0, tol, max_iter, backend)
        assert nbad == 0
        assert (sig <= exact * (1 + 1e-12)).all(), "sigma must be a lower bound"
        assert ((its >= 1) & (its <= max_iter)).all()
        conv = res <= tol
        assert (its[~conv] == max_iter).all()
        # A converged residual r puts sigma^2 within r of an eigenvalue; from a random start
        # that is the largest one: 0 <= 1 - (sigma/exact)^2 <= ~r.
        assert (1 - (sig[conv] / exact[conv]) ** 2 <= 1.01 * tol + 1e-13).all()
    assert conv.sum() < n  # the last setting (1e-12 in 5 products) leaves tokens unconverged


def test_power_iteration_hard_case_is_not_converged(backend):
    """Two nearly equal top gammas (a tiny spectral gap) and few iterations: not converged."""
    rng = np.random.default_rng(3)
    d = 64
    gamma = 1.0 + 0.1 * rng.standard_normal(d)
    gamma[5], gamma[40] = 2.0, 2.0 * (1 + 1e-7)
    x = rng.standard_normal((8, d))
    v0 = rng.standard_normal((8, d))
    for norm in NORMS:
        exact = sigma_max(norm, x, gamma, 1e-5, False)
        nbad, sig, res, its = power(norm, x, gamma, 1e-5, False, v0, 1e-10, 20, backend)
        assert nbad == 0
        assert (res > 1e-10).all() and (its == 20).all()
        assert (sig <= exact * (1 + 1e-12)).all()


@pytest.mark.parametrize("norm", NORMS)
def test_power_iteration_matches_reference(compiled, dtype, norm):
    """A fixed number of products (tol < 0): the same iterates as the reference, to rounding."""
    rng = np.random.default_rng(4)
    for d in (3, 17, 130):
        n = 7
        x = (rng.standard_normal((n, d)) + 1.5).astype(dtype)
        gamma = (1 + 0.4 * rng.standard_normal(d)).astype(dtype)
        v0 = rng.standard_normal((n, d)).astype(dtype)
        for frozen in (False, True):
            ref = power(norm, x, gamma, 1e-5, frozen, v0, -1.0, 9, "numpy")
            got = power(norm, x, gamma, 1e-5, frozen, v0, -1.0, 9, compiled)
            assert got[0] == ref[0] == 0
            np.testing.assert_array_equal(got[3], ref[3])
            np.testing.assert_allclose(got[1], ref[1], rtol=1e-10)
            np.testing.assert_allclose(got[2], ref[2], rtol=1e-6, atol=1e-12)


def test_power_iteration_is_deterministic(compiled):
    """Bit-identical reruns for the same v0, with any number of threads."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((300, 200)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, 200).astype(np.float32)
    v0 = rng.standard_normal((300, 200)).astype(np.float32)
    for norm in NORMS:
        first = power(norm, x, gamma, 1e-5, False, v0, 1e-9, 60, compiled)
        again = power(norm, x, gamma, 1e-5, False, v0, 1e-9, 60, compiled)
        with backends.num_threads(1):
            single = power(norm, x, gamma, 1e-5, False, v0, 1e-9, 60, compiled)
        for other in (again, single):
            for a, b in zip(first[1:], other[1:]):
                assert np.array_equal(a, b)


def test_power_iteration_bad_rows_and_zero_start(backend):
    rng = np.random.default_rng(7)
    n, d = 6, 10
    x = rng.standard_normal((n, d))
    v0 = rng.standard_normal((n, d))
    gamma = rng.uniform(0.5, 1.5, d)
    x[1, 2] = np.inf
    v0[2, 5] = np.nan
    x[3] = 1.0  # constant row, eps = 0: bad for LayerNorm
    v0[4] = 0.0  # a zero start: not bad, but no estimate
    for norm, bad in (("layer_norm", [1, 2, 3]), ("rms_norm", [1, 2])):
        nbad, sig, res, its = power(norm, x, gamma, 0.0, False, v0, 1e-8, 500, backend)
        assert nbad == len(bad)
        assert np.isnan(sig[bad]).all() and np.isnan(res[bad]).all() and (its[bad] == 0).all()
        assert sig[4] == 0.0 and res[4] == np.inf and its[4] == 0
        good = [i for i in range(n) if i not in bad and i != 4]
        assert (res[good] <= 1e-8).all()
        exact = sigma_max(norm, x[good], gamma, 0.0, False)
        np.testing.assert_allclose(sig[good], exact, rtol=1e-7)
