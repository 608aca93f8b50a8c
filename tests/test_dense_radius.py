"""spectral_radius's fall-backs: the dense path (linalg/_dense_radius.py), where operators of
moderate size that power iteration cannot settle are formed and solved by LAPACK, exactly;
and the Arnoldi path outside that range, whose converged answers must be the radius."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine.linalg import _dense_radius as dr


def block(d, batch, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, d))
    g = rng.uniform(0.5, 1.5, d)
    W = scale * rng.standard_normal((d, d)) / np.sqrt(d)
    op = pe.Identity(d) + pe.DenseOperator(W) @ pe.LayerNormJacobian(x, g)
    dense = np.eye(d)[None] + W[None] @ pe.layer_norm_jacobian(x, g)
    return op, dense


def with_complex_pair(n, seed):
    """A real n x n matrix whose dominant eigenvalues are the pair 1.2 +- 1.1i (power iteration stalls)."""
    rng = np.random.default_rng(seed)
    D = np.diag(rng.uniform(-0.9, 0.9, n))
    D[:2, :2] = [[1.2, -1.1], [1.1, 1.2]]
    S = rng.standard_normal((n, n)) + 3 * np.eye(n)
    return S @ D @ np.linalg.inv(S)


def test_complex_pair_goes_dense_and_is_exact():
    n = dr.DENSE_RADIUS_MIN
    A = np.stack([with_complex_pair(n, s) for s in range(3)])
    res = pe.spectral_radius(A, tol=1e-9)
    assert res.method.tolist() == ["dense"] * 3
    assert res.all_converged and (res.residual <= 1e-9).all()
    np.testing.assert_allclose(res.rho, np.hypot(1.2, 1.1), rtol=1e-10)
    assert (np.abs(res.eigenvalue.imag) > 1.0).all()  # found as the complex pair
    assert (res.iterations >= n).all()  # the n products that formed each matrix are counted
    for i in range(3):  # the thread pool (3 operators) and the single-operator path agree
        one = pe.spectral_radius(A[i], tol=1e-9)
        assert one.method[0] == "dense"
        np.testing.assert_allclose(one.rho[0], res.rho[i], rtol=1e-13)


@pytest.mark.slow
def test_random_pre_ln_block_at_d768_is_exact():
    """A random pre-LN block: I + W J_LN, random W, d = 768 (ARPACK needed ~1000 products)."""
    op, dense = block(768, 2, seed=1)
    res = pe.spectral_radius(op, tol=1e-8)
    exact = np.abs(np.linalg.eigvals(dense)).max(-1)
    assert res.all_converged and (res.residual <= 1e-8).all()
    assert set(res.method.tolist()) <= {"power", "dense"}
    np.testing.assert_allclose(res.rho, exact, rtol=1e-10)
    assert (res.rho >= 1.0 - 1e-12).all()  # DESIGN: rho(A_L) >= 1


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "scale"), [(0, 1.0), (3, 3.0)])
def test_rim_cases_where_one_wanted_eigenvalue_stopped_short(seed, scale, monkeypatch):
    """Two operators I + W J_LN at d = 768 on which ARPACK asked for one eigenvalue (k=1, the
    Arnoldi path before 2026-12-05) returned another eigenvalue of the rim with a passing
    residual: 2.0125 for 2.0174 and 4.1129 for 4.1554. The dense path (n in its range) and
    the Arnoldi path (n outside it, forced here) must both give the true radius."""
    op, dense = block(768, 1, seed=seed, scale=scale)
    exact = np.abs(np.linalg.eigvals(dense[0])).max()
    res = pe.spectral_radius(op, tol=1e-8)
    assert res.method[0] == "dense" and res.all_converged
    np.testing.assert_allclose(res.rho[0], exact, rtol=1e-10)
    monkeypatch.setattr(dr, "DENSE_RADIUS_MAX", 0)
    arn = pe.spectral_radius(op, tol=1e-8)
    assert arn.method[0] == "arnoldi" and arn.all_converged
    np.testing.assert_allclose(arn.rho[0], exact, rtol=1e-9)


def test_arnoldi_cut_short_is_not_converged():
    """max_iter = 3 stops ARPACK before all ARNOLDI_WANTED eigenvalues converge. The largest of
    those it has can be a smaller one with a passing residual (n = 127, seed 6: 1.0217 for
    1.0276): such a result must say converged=False, and a converged one must be the radius."""
    seen_cut = False
    for seed in (6, 10, 17, 18):
        A = np.random.default_rng(seed).standard_normal((127, 127)) / np.sqrt(127)
        res = pe.spectral_radius(A, tol=1e-8, max_iter=3)
        assert res.method[0] == "arnoldi"
        exact = np.abs(np.linalg.eigvals(A)).max()
        if res.converged[0]:
            np.testing.assert_allclose(res.rho[0], exact, rtol=1e-7)
        else:
            seen_cut = True
            assert res.rho[0] <= exact * (1 + 1e-12)
    assert seen_cut


def test_dense_eigpair_is_an_eigenpair():
    rng = np.random.default_rng(3)
    A = rng.standard_normal((200, 200))
    lam, x = dr.dense_eigpair(A)
    assert abs(abs(lam) - np.abs(np.linalg.eigvals(A)).max()) <= 1e-12 * abs(lam)
    assert np.linalg.norm(A @ x - lam * x) <= 1e-10 * abs(lam)
    assert abs(np.linalg.norm(x) - 1.0) <= 1e-12


def test_non_finite_matrix_gives_nan():
    A = np.eye(5)
    A[1, 2] = np.nan
    lam, x = dr.dense_eigpair(A)
    assert np.isnan(lam) and not x.any()


def test_size_range():
    assert not dr.use_dense(dr.DENSE_RADIUS_MIN - 1) and dr.use_dense(dr.DENSE_RADIUS_MIN)
    assert dr.use_dense(dr.DENSE_RADIUS_MAX) and not dr.use_dense(dr.DENSE_RADIUS_MAX + 1)
