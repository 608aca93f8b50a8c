"""Batched linear operators: products against dense algebra, adjointness, bounds, scipy interop."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
import scipy.sparse.linalg

import pyengine as pe
from pyengine.linalg import operators as po

NORMS = {"layer_norm": pe.LayerNormJacobian, "rms_norm": pe.RMSNormJacobian}
MODES = ["full", "frozen_scale"]


def dense_of(op):
    """The (B, m, n) matrices of ``op``, column by column through matvec."""
    B, n = op.batch, op.shape[1]
    cols = [op.matvec(np.broadcast_to(e, (B, n)).copy()) for e in np.eye(n, dtype=op.dtype)]
    return np.stack(cols, axis=2).astype(np.float64)


def sigma_max(mats):
    return np.linalg.norm(mats, 2, axis=(-2, -1))


def ln_case(B=4, d=9, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = (0.5 + rng.standard_normal((B, d)) * rng.lognormal(0, 0.5, d)).astype(dtype)
    gamma = rng.lognormal(0, 0.3, d).astype(dtype)
    return x, gamma


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_dense_operator_matches_numpy(rng, dtype):
    A = rng.standard_normal((3, 5, 4)).astype(dtype)
    op = pe.DenseOperator(A)
    assert (op.batch, op.shape, op.dtype) == (3, (5, 4), np.dtype(dtype))
    V, U = rng.standard_normal((3, 4)), rng.standard_normal((3, 5))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(op.matvec(V), np.einsum("bij,bj->bi", A, V), rtol=tol, atol=tol)
    np.testing.assert_allclose(op.rmatvec(U), np.einsum("bij,bi->bj", A, U), rtol=tol, atol=tol)
    assert op.matvec(V).dtype == dtype


def test_dense_single_matrix_is_shared_by_all_rows(rng):
    W = rng.standard_normal((6, 4))
    op = pe.DenseOperator(W)
    assert op.batch == 1
    V = rng.standard_normal((7, 4))
    np.testing.assert_allclose(op.matvec(V), V @ W.T, rtol=1e-13)
    np.testing.assert_allclose(op.rmatvec(V @ W.T), V @ W.T @ W, rtol=1e-13)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm", list(NORMS))
def test_norm_jacobian_matches_dense_jacobian(backend, norm, mode):
    x, gamma = ln_case(B=5, d=7)
    op = NORMS[norm](x, gamma, 1e-3, mode, backend)
    jac = getattr(pe, norm + "_jacobian")(x, gamma, 1e-3, mode, backend="numpy")
    np.testing.assert_allclose(dense_of(op), jac, rtol=1e-12, atol=1e-12)
    U = np.random.default_rng(2).standard_normal((5, 7))
    np.testing.assert_allclose(op.rmatvec(U), np.einsum("bij,bi->bj", jac, U), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("norm", list(NORMS))
def test_one_token_norm_jacobian_is_shared_by_k_rows(backend, norm):
    x, gamma = ln_case(B=1, d=7)
    op = NORMS[norm](x, gamma, 1e-3, "full", backend)
    jac = getattr(pe, norm + "_jacobian")(x, gamma, 1e-3, backend="numpy")[0]
    rng = np.random.default_rng(3)
    for k in (4, 4, 2, 1):  # the tiled copy of x is kept for a repeated row count, rebuilt otherwise
        V = rng.standard_normal((k, 7))
        np.testing.assert_allclose(op.matvec(V), V @ jac.T, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(op.rmatvec(V), V @ jac, rtol=1e-12, atol=1e-12)
        out = np.empty((k, 7))
        assert op.matvec(V, out=out) is out
        np.testing.assert_allclose(out, V @ jac.T, rtol=1e-12, atol=1e-12)


def test_norm_jacobian_keeps_leading_shape_and_bound():
    x, gamma = ln_case(B=6, d=5)
    op = pe.LayerNormJacobian(x.reshape(2, 3, 5), gamma)
    assert op.batch == 6 and op.batch_shape == (2, 3) and op.shape == (5, 5)
    s = np.sqrt(x.var(axis=1) + 1e-5)
    np.testing.assert_allclose(op.upper_bound(), np.abs(gamma).max() / s, rtol=1e-11)  # + bound slack
    np.testing.assert_allclose(op.scale(), s, rtol=1e-12)


def compositions(rng):
    """(name, operator) pairs covering every built-in operator and composition."""
    x, gamma = ln_case(B=3, d=6)
    J = pe.LayerNormJacobian(x, gamma)
    R = pe.RMSNormJacobian(x, gamma, mode="frozen_scale")
    W = pe.DenseOperator(rng.standard_normal((6, 6)))
    S = pe.DenseOperator(rng.standard_normal((3, 6, 6)))
    T = pe.DenseOperator(rng.standard_normal((3, 4, 6)))
    return [
        ("dense", S),
        ("wide", T),
        ("layernorm", J),
        ("I+W@J", pe.Identity(6) + W @ J),
        ("sum", J + R),
        ("difference", S - J),
        ("scaled", -2.5 * J),
        ("per-op scale", np.array([1.0, -2.0, 0.5]) * S),
        ("product chain", T @ J @ R),
        ("transpose", T.T @ T),
        ("J@J", J @ J),
        ("negative", -(W @ J)),
        ("from scipy", pe.from_linear_operator(scipy.sparse.random(6, 6, density=0.5, random_state=3))),
    ]


def test_compositions_match_dense_algebra(rng):
    ops = dict(compositions(rng))
    x, gamma = ln_case(B=3, d=6)
    Jd = pe.layer_norm_jacobian(x, gamma)
    Rd = pe.rms_norm_jacobian(x, gamma, mode="frozen_scale")
    Wd, Sd, Td = ops["I+W@J"].B.A.A[0], ops["dense"].A, ops["wide"].A
    expect = {
        "I+W@J": np.eye(6) + Wd @ Jd,
        "sum": Jd + Rd,
        "difference": Sd - Jd,
        "scaled": -2.5 * Jd,
        "per-op scale": np.array([1.0, -2.0, 0.5])[:, None, None] * Sd,
        "product chain": Td @ Jd @ Rd,
        "transpose": np.swapaxes(Td, 1, 2) @ Td,
        "J@J": Jd @ Jd,
        "negative": -(Wd @ Jd),
    }
    for name, want in expect.items():
        np.testing.assert_allclose(dense_of(ops[name]), want, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("case", range(13))
def test_adjointness_and_bounds(rng, case):
    name, op = compositions(rng)[case]
    B, (m, n) = op.batch, op.shape
    V, U = rng.standard_normal((B, n)), rng.standard_normal((B, m))
    lhs = np.einsum("bi,bi->b", op.matvec(V), U)
    rhs = np.einsum("bi,bi->b", V, op.rmatvec(U))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-11, atol=1e-11, err_msg=name)
    true = sigma_max(dense_of(op))
    assert op.upper_bound().shape == (B,)
    assert (op.upper_bound() >= true * (1 - 1e-14)).all(), name


def test_bounds_compose(rng):
    x, gamma = ln_case(B=3, d=6)
    J = pe.LayerNormJacobian(x, gamma)
    W = pe.DenseOperator(rng.standard_normal((6, 6)))
    bj, bw = J.upper_bound(), W.upper_bound()
    np.testing.assert_allclose((W @ J).upper_bound(), bw * bj)
    np.testing.assert_allclose((pe.Identity(6) + W @ J).upper_bound(), 1 + bw * bj)
    np.testing.assert_allclose((-3 * J).upper_bound(), 3 * bj)
    assert np.isinf(pe.from_linear_operator(np.eye(3)).upper_bound()).all()


def test_take_selects_operators(rng):
    for name, op in compositions(rng):
        if op.batch == 1:
            continue
        full = dense_of(op)
        sub = op.take(np.array([2, 0]))
        assert sub.batch == 2, name
        np.testing.assert_allclose(dense_of(sub), full[[2, 0]], rtol=1e-13, atol=1e-13, err_msg=name)
        np.testing.assert_allclose(sub.upper_bound(), op.upper_bound()[[2, 0]], err_msg=name)


def test_out_buffer_is_used_and_inputs_unchanged(rng):
    x, gamma = ln_case(B=3, d=6)
    x0, g0 = x.copy(), gamma.copy()
    op = pe.Identity(6) + pe.DenseOperator(rng.standard_normal((6, 6))) @ pe.LayerNormJacobian(x, gamma)
    V = rng.standard_normal((3, 6))
    V0 = V.copy()
    out = np.empty((3, 6))
    res = op.matvec(V, out=out)
    assert res is out
    np.testing.assert_array_equal(out, op.matvec(V))
    assert (V == V0).all() and (x == x0).all() and (gamma == g0).all()


def test_linear_operator_round_trip(rng):
    x, gamma = ln_case(B=3, d=8)
    J = pe.LayerNormJacobian(x, gamma)
    jac = pe.layer_norm_jacobian(x, gamma)
    L = pe.as_linear_operator(J, 1)
    assert L.shape == (8, 8)
    v = rng.standard_normal(8)
    np.testing.assert_allclose(L @ v, jac[1] @ v, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(L.rmatvec(v), jac[1].T @ v, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(L @ np.eye(8), jac[1], rtol=1e-12, atol=1e-14)
    s = scipy.sparse.linalg.svds(L, k=1, return_singular_vectors=False, random_state=0)
    np.testing.assert_allclose(s[0], np.linalg.norm(jac[1], 2), rtol=1e-10)
    back = pe.from_linear_operator(L)
    assert back.batch == 1 and back.shape == (8, 8)
    np.testing.assert_allclose(dense_of(back)[0], jac[1], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(back.rmatvec(np.eye(8)), jac[1], rtol=1e-12, atol=1e-14)


def test_bad_shapes_and_types(rng):
    x, gamma = ln_case(B=3, d=6)
    J = pe.LayerNormJacobian(x, gamma)
    with pytest.raises(ValueError, match=r"A @ B needs A's columns to match B's rows.*\(4, 5\).*\(6, 6\)"):
        pe.DenseOperator(np.ones((4, 5))) @ J
    with pytest.raises(ValueError, match=r"A \+ B needs operators of the same shape"):
        pe.DenseOperator(np.ones((6, 5))) + J
    with pytest.raises(ValueError, match=r"batch sizes must be equal or 1.*4, 3"):
        pe.DenseOperator(np.ones((4, 6, 6))) @ J
    with pytest.raises(ValueError, match=r"V must have shape \(B, 6\) = \(3, 6\).*got \(2, 6\)"):
        J.matvec(np.ones((2, 6)))
    with pytest.raises(ValueError, match=r"U must have shape"):
        J.rmatvec(np.ones(6))
    with pytest.raises(TypeError, match="V must be a float32 or float64 array"):
        J.matvec(np.ones((3, 6), dtype=np.int64))
    with pytest.raises(ValueError, match="out must have shape"):
        J.matvec(np.ones((3, 6)), out=np.empty((3, 5)))
    with pytest.raises(ValueError, match=r"A must have shape \(m, n\) or \(B, m, n\)"):
        pe.DenseOperator(np.ones(3))
    with pytest.raises(TypeError, match="A must be a float32 or float64 array"):
        pe.DenseOperator(np.ones((3, 3), dtype=int))
    bad = np.ones((2, 2))
    bad[1, 0] = np.nan
    with pytest.raises(ValueError, match=r"A contains NaN or Inf \(first at index \(1, 0\): nan\)"):
        pe.DenseOperator(bad)
    with pytest.raises(ValueError, match=r"c must be a scalar or have shape \(B,\) = \(3,\)"):
        pe.Scaled(np.ones(2), J)
    with pytest.raises(ValueError, match=r"c contains NaN or Inf \(first at index 1: nan\)"):
        pe.Scaled(np.array([1.0, np.nan, 2.0]), J)
    with pytest.raises(ValueError, match=r"out must have dtype float64 \(the dtype of the operator\)"):
        J.matvec(np.ones((3, 6)), out=np.empty((3, 6), np.float32))
    with pytest.raises(IndexError, match=r"idx must lie in \[0, 3\)"):
        J.take(np.array([0, 3]))
    with pytest.raises(TypeError, match="must be a pyengine BatchedOperator"):
        pe.Product(np.eye(6), J)
    with pytest.raises(ValueError, match=r"i must be an integer in \[0, 3\)"):
        pe.as_linear_operator(J, 3)
    with pytest.raises(ValueError, match="shape must be a tuple"):
        pe.Identity(0)
    no_adjoint = pe.from_linear_operator(scipy.sparse.linalg.LinearOperator((3, 3), matvec=lambda v: v))
    with pytest.raises(TypeError, match="could not multiply by A\\^T"):
        no_adjoint.rmatvec(np.ones((1, 3)))
    xbad = x.copy()
    xbad[2, 1] = np.inf
    with pytest.raises(ValueError, match=r"x contains NaN or Inf .*row \(2,\)"):
        pe.LayerNormJacobian(xbad, gamma)
    Vbad = np.ones((3, 6))
    Vbad[1, 4] = np.nan
    with pytest.raises(ValueError, match=r"V contains NaN or Inf .*row \(1,\), entry 4"):
        J.matvec(Vbad)
    with pytest.raises(ValueError, match=r"U contains NaN or Inf .*row \(1,\), entry 4"):
        pe.RMSNormJacobian(x, gamma, backend="numpy").rmatvec(Vbad)
    with pytest.raises(ValueError, match="out must not overlap"):
        J.matvec(np.ones((3, 6)), out=J.x)
    with pytest.raises(ValueError, match="mode must be"):
        pe.RMSNormJacobian(x, gamma, mode="frozen")
    with pytest.raises(ValueError, match="backend must be one of"):
        pe.LayerNormJacobian(x, gamma, backend="cuda")
    with pytest.raises(ValueError, match=r"gamma must have shape \(d,\)"):
        pe.LayerNormJacobian(x, gamma[:3])


def test_float32_operator_computes_in_float32(rng):
    x, gamma = ln_case(B=3, d=6, dtype=np.float32)
    op = pe.Identity(6, dtype=np.float32) + pe.LayerNormJacobian(x, gamma)
    assert op.dtype == np.float32
    res = op.matvec(rng.standard_normal((3, 6)))
    assert res.dtype == np.float32
    want = np.eye(6) + pe.layer_norm_jacobian(x.astype(np.float64), gamma.astype(np.float64))
    np.testing.assert_allclose(dense_of(op), want, rtol=2e-6, atol=2e-6)
