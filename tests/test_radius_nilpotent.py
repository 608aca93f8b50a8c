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


def shift_operator(n, diagonal=None, step=1.0):
    """The strictly upper-triangular shift (A v)_i = step v_{i+1} (plus ``diagonal``), matrix-free."""
    from scipy.sparse.linalg import LinearOperator

    d = np.zeros(n) if diagonal is None else diagonal

    def mv(v):
        v = np.asarray(v).reshape(n, -1)
        y = d[:, None] * v
        y[:-1] += step * v[1:]
        return y

    def rmv(u):
        u = np.asarray(u).reshape(n, -1)
        y = d[:, None] * u
        y[1:] += step * u[:-1]
        return y

    return LinearOperator((n, n), matvec=mv, matmat=mv, rmatvec=rmv, rmatmat=rmv, dtype=np.float64)


def test_nilpotent_operator_above_the_dense_size_has_radius_zero(monkeypatch):
    """n = 3000 > DENSE_RADIUS_MAX: the stalled shift (nilpotent of index n) is answered by its power
    sequence reaching a zero image, neither by ARPACK nor by a formed matrix."""
    from pyengine.linalg import _dense_radius

    n = 3000
    assert n > _dense_radius.DENSE_RADIUS_MAX
    monkeypatch.setattr(_solvers, "_arnoldi", lambda *a: pytest.fail("ARPACK was asked"))
    monkeypatch.setattr(_dense_radius, "dense_matrix", lambda *a: pytest.fail("a matrix was formed"))
    L = shift_operator(n)
    single = pe.spectral_radius(L)
    assert_zero_radius(single)
    assert single.method.tolist() == ["power"] and single.iterations[0] > 2 * _solvers.STALL_WINDOW
    batch = pe.spectral_radius(pe.Scaled(np.array([1.0, 2.5, -0.5]), pe.from_linear_operator(L)), seed=3)
    assert_zero_radius(batch)
    assert (batch.iterations <= _solvers.STALL_WINDOW * 4 + n).all()


def test_stalled_operator_above_the_dense_size_still_goes_to_arnoldi():
    n = 2100
    diagonal = np.zeros(n)
    # tied +-1 (power iteration stalls, rho = 1) and ten more distinct eigenvalues, so ARPACK's
    # ARNOLDI_WANTED converge: the rest, 0, is a Jordan block of the half shift
    diagonal[:12] = 1, -1, 0.95, -0.9, 0.85, -0.8, 0.75, -0.7, 0.65, -0.6, 0.55, -0.5
    res = pe.spectral_radius(shift_operator(n, diagonal, 0.5), tol=1e-9)
    assert res.method.tolist() == ["arnoldi"] and res.all_converged
    np.testing.assert_allclose(res.rho, 1.0, rtol=1e-7)
    assert res.iterations[0] > n  # the zero-image search's n products are counted
