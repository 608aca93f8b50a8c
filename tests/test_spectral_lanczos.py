"""The fused per-token Lanczos kernels (``*_lanczos``) and their dispatch.

Kernel level (through the registry): every backend against the exact sigma_max, the
compiled ones against the NumPy reference; the result contract (sigma a lower bound,
iterations <= max_iter, converged tokens within tol of the exact value, unconverged ones
reported so); rows of extreme magnitude, constant rows, eps = 0, a near-degenerate top
pair, bad rows. Public level: ``layer_norm_spectral_norm(method="lanczos")`` and
``spectral_norm`` on norm Jacobians use the kernel and agree with the generic batched
Golub-Kahan-Lanczos (the ``"numpy"`` backend).
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine import backends
from pyengine.linalg import LayerNormJacobian, RMSNormJacobian

NORMS = ("layer_norm", "rms_norm")


def exact(norm, x, gamma, eps, frozen):
    out = np.full(x.shape[0], -1.0)
    assert backends.resolve(f"{norm}_sigma_max", "numpy")(x, gamma, eps, frozen, out) == 0
    return out


def lanczos(norm, x, gamma, eps, frozen, v0, tol, max_iter, backend):
    n = x.shape[0]
    sig, res, its = np.full(n, -1.0), np.full(n, -1.0), np.full(n, -1, np.int64)
    nbad = backends.resolve(f"{norm}_lanczos", backend)(x, gamma, eps, frozen, v0, tol, max_iter, sig, res, its)
    return nbad, sig, res, its


def floor(norm, x, gamma, eps):
    """The rounding of the formed operator K = s J (entries up to max|gamma|), in sigma: a few
    ulps of max|gamma| / s. For LayerNorm at d = 2, where K is the difference of two nearly
    equal projectors, this is all that separates sigma from 0."""
    xd = np.asarray(x, np.float64)
    ms = xd.var(-1) if norm == "layer_norm" else np.mean(xd * xd, -1)
    return 1e-14 * float(np.abs(np.asarray(gamma, np.float64)).max()) / np.sqrt(ms + eps)


def check_contract(sig, res, its, want, tol, max_iter, fl=0.0):
    """Lower bound (up to the rounding fl of the operator); 1 <= iterations <= max_iter;
    converged => sigma^2 within ~tol of exact."""
    assert (sig <= want * (1 + 1e-12) + fl).all(), ("sigma must be a lower bound", sig - want)
    assert ((its >= 1) & (its <= max_iter)).all(), its
    conv = res <= tol
    assert (1 - (sig[conv] / want[conv]) ** 2 <= 1.01 * tol + 1e-12).all()
    return conv


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("frozen", [False, True], ids=["full", "frozen"])
@pytest.mark.parametrize("d", [2, 3, 17, 768])
def test_lanczos_matches_exact(backend, dtype, norm, frozen, d):
    rng = np.random.default_rng(d)
    n = 1 if (backend == "numpy" and d == 768) else 12  # the reference is a Python loop
    x = (rng.standard_normal((n, d)) + rng.uniform(-2, 2, (n, 1))).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, d).astype(dtype)
    v0 = rng.standard_normal((n, d))
    x0, g0, v00 = x.copy(), gamma.copy(), v0.copy()
    want = exact(norm, x, gamma, 1e-5, frozen)
    nbad, sig, res, its = lanczos(norm, x, gamma, 1e-5, frozen, v0, 1e-8, 1000, backend)
    assert nbad == 0
    fl = floor(norm, x, gamma, 1e-5)
    conv = check_contract(sig, res, its, want, 1e-8, 1000, fl)
    assert conv.all(), res
    assert (np.abs(sig - want) <= 1e-8 * want + fl).all(), (sig, want)
    for a, b in ((x, x0), (gamma, g0), (v0, v00)):
        assert np.array_equal(a, b), "inputs must not be modified"


@pytest.mark.parametrize("norm", NORMS)
def test_compiled_matches_reference(compiled, dtype, norm):
    """The same algorithm: the same sigma to rounding, iterations equal up to the schedule."""
    rng = np.random.default_rng(11)
    for d in (3, 17, 130):
        x = (rng.standard_normal((6, d)) + 1.0).astype(dtype)
        gamma = (1 + 0.3 * rng.standard_normal(d)).astype(dtype)
        v0 = rng.standard_normal((6, d))
        for frozen in (False, True):
            ref = lanczos(norm, x, gamma, 1e-5, frozen, v0, 1e-9, 400, "numpy")
            got = lanczos(norm, x, gamma, 1e-5, frozen, v0, 1e-9, 400, compiled)
            assert got[0] == ref[0] == 0
            np.testing.assert_allclose(got[1], ref[1], rtol=1e-9)
            assert (got[2] <= 1e-9).all() and (ref[2] <= 1e-9).all()
            assert np.abs(got[3] - ref[3]).max() <= 8


@pytest.mark.parametrize("max_iter", [1, 2, 3, 7])
def test_lanczos_small_budget(backend, max_iter):
    """iterations <= max_iter always; a tight tol in a tiny budget is reported unconverged."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((10, 40))
    gamma = rng.uniform(0.5, 1.5, 40)
    v0 = rng.standard_normal((10, 40))
    for norm in NORMS:
        nbad, sig, res, its = lanczos(norm, x, gamma, 1e-5, False, v0, 1e-12, max_iter, backend)
        assert nbad == 0
        check_contract(sig, res, its, exact(norm, x, gamma, 1e-5, False), 1e-12, max_iter)
        assert (res > 1e-12).all() and (its == max_iter).all()


def test_near_degenerate_top_pair(backend):
    """Top gammas 2 and 2(1 + 1e-7): few products leave it unconverged (and say so); enough
    products converge to the exact sigma."""
    rng = np.random.default_rng(3)
    d = 64
    gamma = 1.0 + 0.1 * rng.standard_normal(d)
    gamma[5], gamma[40] = 2.0, 2.0 * (1 + 1e-7)
    x = rng.standard_normal((6, d))
    v0 = rng.standard_normal((6, d))
    for norm in NORMS:
        want = exact(norm, x, gamma, 1e-5, False)
        nbad, sig, res, its = lanczos(norm, x, gamma, 1e-5, False, v0, 1e-13, 6, backend)
        assert nbad == 0 and (res > 1e-13).all() and (its <= 6).all()
        assert (sig <= want * (1 + 1e-12)).all()
        nbad, sig, res, its = lanczos(norm, x, gamma, 1e-5, False, v0, 1e-10, 1000, backend)
        assert (res <= 1e-10).all()
        np.testing.assert_allclose(sig, want, rtol=1e-9)


@pytest.mark.parametrize("norm", NORMS)
def test_extreme_rows_rescaled(backend, norm):
    """Rows of 2^+-500 (float64), 2^+-100 (float32), eps = 0: sigma scales exactly as 1/c."""
    rng = np.random.default_rng(13)
    d = 33
    base = rng.standard_normal((4, d)) + 0.5
    gamma = rng.uniform(0.5, 1.5, d)
    v0 = rng.standard_normal((4, d))
    for dtype, e in ((np.float64, 500), (np.float64, -500), (np.float32, 100), (np.float32, -100)):
        x, g = base.astype(dtype), gamma.astype(dtype)
        ref = lanczos(norm, x, g, 0.0, False, v0, 1e-9, 500, backend)
        got = lanczos(norm, (x * dtype(2.0**e)).astype(dtype), g, 0.0, False, v0, 1e-9, 500, backend)
        assert got[0] == ref[0] == 0
        assert (got[2] <= 1e-9).all() and np.isfinite(got[1]).all() and (got[1] > 0).all()
        np.testing.assert_allclose(got[1] * 2.0**e, ref[1], rtol=1e-12)


def test_constant_rows_and_eps_zero(backend):
    """A constant row: its Jacobian is the frozen one (eps > 0); with eps = 0 it is bad for
    LayerNorm. NaN/Inf rows and NaN start vectors are bad; a zero start gives 0, inf."""
    rng = np.random.default_rng(7)
    n, d = 6, 10
    x = rng.standard_normal((n, d))
    gamma = rng.uniform(0.5, 1.5, d)
    v0 = rng.standard_normal((n, d))
    x[3] = 1.0
    want = exact("layer_norm", x, gamma, 1e-5, False)
    nbad, sig, res, its = lanczos("layer_norm", x, gamma, 1e-5, False, v0, 1e-10, 500, backend)
    assert nbad == 0 and (res <= 1e-10).all()
    np.testing.assert_allclose(sig, want, rtol=1e-9)
    x[1, 2] = np.inf
    v0[2, 5] = np.nan
    v0[4] = 0.0
    for norm, bad in (("layer_norm", [1, 2, 3]), ("rms_norm", [1, 2])):
        nbad, sig, res, its = lanczos(norm, x, gamma, 0.0, False, v0, 1e-8, 500, backend)
        assert nbad == len(bad)
        assert np.isnan(sig[bad]).all() and np.isnan(res[bad]).all() and (its[bad] == 0).all()
        assert sig[4] == 0.0 and res[4] == np.inf and its[4] == 0
        good = [i for i in range(n) if i not in bad and i != 4]
        assert (res[good] <= 1e-8).all()
        np.testing.assert_allclose(sig[good], exact(norm, x[good], gamma, 0.0, False), rtol=1e-7)


def test_deterministic_across_threads(compiled):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, 96).astype(np.float32)
    v0 = rng.standard_normal((40, 96))
    first = lanczos("layer_norm", x, gamma, 1e-5, False, v0, 1e-9, 300, compiled)
    with backends.num_threads(1):
        single = lanczos("layer_norm", x, gamma, 1e-5, False, v0, 1e-9, 300, compiled)
    for a, b in zip(first[1:], single[1:]):
        assert np.array_equal(a, b)


# --------------------------------------------------------------------------- #
# Dispatch: the public functions
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("norm", NORMS)
def test_public_lanczos_uses_kernel_and_agrees_with_generic(compiled, dtype, norm, monkeypatch):
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((2, 5, 64)) + 0.3).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, 64).astype(dtype)
    fn = getattr(pe, norm + "_spectral_norm")
    # The generic solver multiplies in the dtype of x: in float32 its residual stalls near
    # 1e-7, where the fused kernels (float64 throughout) reach 1e-8.
    gtol = 1e-8 if dtype == np.float64 else 1e-5
    generic = fn(x, gamma, method="lanczos", tol=gtol, backend="numpy")
    fused = fn(x, gamma, method="lanczos", tol=1e-8, backend=compiled)
    want = fn(x, gamma, method="exact")
    assert fused.sigma.shape == (2, 5)
    assert np.array_equal(fused.converged, fused.residual <= 1e-8) and fused.converged.all()
    assert generic.converged.all()
    np.testing.assert_allclose(fused.sigma, want.sigma, rtol=1e-8)
    np.testing.assert_allclose(fused.sigma, generic.sigma, rtol=gtol)
    assert (fused.upper >= fused.sigma).all() and np.array_equal(fused.lower, fused.sigma)
    assert (fused.iterations <= 1000).all()
    chunked = fn(x, gamma, method="lanczos", tol=1e-8, backend=compiled, chunk_size=3)
    assert np.array_equal(chunked.sigma, fused.sigma)
    cls = LayerNormJacobian if norm == "layer_norm" else RMSNormJacobian
    via_op = pe.spectral_norm(cls(x, gamma, backend=compiled), method="lanczos", tol=1e-8)
    assert np.array_equal(via_op.sigma.reshape(2, 5), fused.sigma)
    # The kernel is what runs: with it replaced, the answer changes.
    calls = []
    real = backends.resolve(norm + "_lanczos", compiled)

    def spy(*a):
        calls.append(a[0].shape)
        return real(*a)

    monkeypatch.setitem(backends._TABLE, (norm + "_lanczos", compiled), spy)
    backends._RESOLVED.clear()
    fn(x, gamma, method="lanczos", tol=1e-8, backend=compiled)
    assert calls == [(10, 64)]


def test_public_lanczos_bad_input_named(compiled):
    x = np.random.default_rng(0).standard_normal((4, 16))
    x[2, 3] = np.nan
    with pytest.raises(ValueError, match="x"):
        pe.layer_norm_spectral_norm(x, method="lanczos", backend=compiled)
    with pytest.raises(ValueError, match="max_iter"):
        pe.layer_norm_spectral_norm(x[:2], method="lanczos", max_iter=0, backend=compiled)
