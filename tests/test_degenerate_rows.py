"""LayerNorm / RMSNorm spectral norms on degenerate rows (d = 2 and 3, eps = 0): every method and
backend agrees with the exact one, with no NaN, and reports the same contract: converged, and
iterations in [1, max_iter], or 0 for the zero operator (LayerNorm, eps = 0, d = 2, full mode)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pyengine as pe
from pyengine.backends import resolve

TOL, MAX_ITER = 1e-6, 1000


def degenerate_rows(d, seed):
    """Rows of two distinct values (d = 2: any row; d = 3: two entries equal), 8 copies of each."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(2) * rng.lognormal(0, 2, 2)
    pats = [(a, b), (b, a)] if d == 2 else sorted(set(itertools.permutations((a, a, b))))
    return np.repeat(np.array(pats, dtype=np.float64), 8, axis=0)


def gammas(d, seed):
    return [np.ones(d), np.random.default_rng(seed).lognormal(0, 0.5, d)]


def check_contract(sigma, residual, iterations, exact, zero):
    assert np.isfinite(sigma).all() and np.isfinite(residual).all()
    np.testing.assert_allclose(sigma, exact, rtol=1e-6, atol=1e-12)
    assert (residual <= TOL).all()
    if zero:
        assert (sigma == 0).all() and (residual == 0).all() and (iterations == 0).all()
    else:
        assert ((iterations >= 1) & (iterations <= MAX_ITER)).all()


CASES = list(itertools.product(["layer_norm", "rms_norm"], [2, 3], ["full", "frozen_scale"], [0, 1]))


@pytest.mark.parametrize("method", ["power", "lanczos"])
@pytest.mark.parametrize("norm, d, mode, seed", CASES, ids=lambda v: str(v))
def test_public_methods_agree_with_exact(backend, method, norm, d, mode, seed):
    fn = pe.layer_norm_spectral_norm if norm == "layer_norm" else pe.rms_norm_spectral_norm
    x = degenerate_rows(d, seed)
    zero = norm == "layer_norm" and d == 2 and mode == "full"
    for g in gammas(d, seed):
        exact = fn(x, g, eps=0.0, mode=mode, method="exact", backend=backend)
        res = fn(x, g, eps=0.0, mode=mode, method=method, tol=TOL, max_iter=MAX_ITER, backend=backend)
        assert res.all_converged
        check_contract(res.sigma, res.residual, res.iterations, exact.sigma, zero)
        assert np.isfinite(res.upper).all() and (res.upper >= res.sigma).all()


@pytest.mark.parametrize("kernel", ["power_iteration", "lanczos"])
@pytest.mark.parametrize("norm, d, mode, seed", CASES, ids=lambda v: str(v))
def test_kernels_agree_with_exact(backend, kernel, norm, d, mode, seed):
    x = degenerate_rows(d, seed)
    n = x.shape[0]
    frozen = mode == "frozen_scale"
    zero = norm == "layer_norm" and d == 2 and not frozen
    v0 = np.random.default_rng(seed).standard_normal((n, d))
    v0 /= np.linalg.norm(v0, axis=1, keepdims=True)
    for g in gammas(d, seed):
        exact = np.empty(n)
        assert resolve(norm + "_sigma_max", backend)(x, g, 0.0, frozen, exact) == 0
        sigma, residual, iterations = np.empty(n), np.empty(n), np.empty(n, np.int64)
        nbad = resolve(f"{norm}_{kernel}", backend)(x, g, 0.0, frozen, v0.copy(), TOL, MAX_ITER, sigma, residual,
                                                   iterations)
        assert nbad == 0
        check_contract(sigma, residual, iterations, exact, zero)


def test_the_reported_cases(backend):
    x = np.tile([[1.0, 2.0]], (8, 1))
    for method in ("power", "lanczos"):
        res = pe.layer_norm_spectral_norm(x, eps=0.0, method=method, backend=backend)
        assert (res.sigma == 0).all() and (res.upper == 0).all() and res.all_converged
        res = pe.layer_norm_spectral_norm([[0.3, -1.2]], eps=0.0, method=method, backend=backend)
        assert res.all_converged and res.residual[0] == 0 and res.iterations[0] == 0
