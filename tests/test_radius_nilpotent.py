"""spectral_radius of nilpotent operators: a zero image A v = 0 is the answer rho = 0, on every path."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine.linalg import _solvers


def strictly_triangular(n, seed, batch=3):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((batch, n, n)) * rng.lognormal(0, 1, (batch, 1, 1))
    upper = np.triu(A, 1)
    upper[1::2] = np.tril(A[1::2], -1)  # odd operators lower triangular
    return upper


def assert_zero_radius(res):
    assert res.all_converged
    assert (res.rho == 0).all() and (res.eigenvalue == 0).all() and (res.residual == 0).all()
    assert set(res.method.tolist()) <= {"power", "dense", "arnoldi"}


def test_the_reported_case():
    res = pe.spectral_radius(pe.DenseOperator(np.triu(np.ones((5, 5)), 1)))
    assert_zero_radius(res)
    assert res.method.tolist() == ["power"] and 1 <= res.iterations[0] <= 5


# 3..24: the power sequence reaches zero before the stall test; 26..127: the stalled path,
# Arnoldi's (which ARPACK cannot answer); 128..2048: the dense path.
@pytest.mark.parametrize("n", [2, 3, 5, 24, 40, 127, 128, 200])
@pytest.mark.parametrize("seed", [0, 1])
def test_strictly_triangular_operators_have_radius_zero(n, seed):
    A = strictly_triangular(n, seed)
    assert_zero_radius(pe.spectral_radius(A, seed=seed))
    assert_zero_radius(pe.spectral_radius(pe.as_linear_operator(pe.DenseOperator(A[1])), seed=seed))


@pytest.mark.parametrize("n", [40, 150])
def test_forced_arnoldi_path_answers_zero(n, monkeypatch):
    monkeypatch.setattr(_solvers, "use_dense", lambda n: False)
    called = []
    monkeypatch.setattr(_solvers, "_arnoldi", lambda *a: called.append(1) or (np.nan, None, 0, False))
    A = strictly_triangular(n, 3)
    assert_zero_radius(pe.spectral_radius(A))
    assert not called  # ARPACK's pseudo-eigenvalues of a nilpotent operator are not asked for


def test_dense_eigpair_of_a_nilpotent_matrix_is_a_null_vector():
    from pyengine.linalg._dense_radius import dense_eigpair

    A = strictly_triangular(150, 4, batch=1)[0]
    lam, x = dense_eigpair(A)
    assert lam == 0 and np.isfinite(x).all() and np.linalg.norm(x) > 0
    assert np.linalg.norm(A @ x) == 0


def test_non_nilpotent_operators_still_use_arnoldi():
    rng = np.random.default_rng(5)
    A = np.triu(rng.standard_normal((40, 40)), 1)
    A[0, 0], A[1, 1] = 1.0, -1.0  # tied +-1: power iteration stalls
    res = pe.spectral_radius(A, tol=1e-9)
    assert res.method.tolist() == ["arnoldi"] and res.all_converged
    np.testing.assert_allclose(res.rho, 1.0, rtol=1e-7)
