"""Every BatchedOperator applied to k vectors at once equals the same operator applied to each.

A batch-1 operator is shared by all the rows of a product (``matvec(V)`` with V of shape
(k, n)); ``as_linear_operator(op) @ M`` multiplies the k columns of M through it. Both must
equal the k single-vector products stacked, for every operator class in pyengine.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine.analysis import BlockJacobian, TokenJacobian
from pyengine.linalg import operators as po
from pyengine.linalg.convert import _FromLinearOperator
from pyengine.linalg.norm_jacobians import _NormJacobian
from pyengine.models import StackConfig, init_weights

N = 6
RNG = np.random.default_rng(7)
W = RNG.standard_normal((N, N))
X = RNG.standard_normal((3, N))


def _stack():
    return init_weights(StackConfig(d_model=4, n_heads=2, n_layers=2, vocab_size=11), seed=4, dtype=np.float64)


def _block_jacobian(prompts):
    st = _stack()
    h = st.hidden_states(np.random.default_rng(10).integers(0, 11, (prompts, 3)))[1]
    return BlockJacobian(st, h, 1)


#: class -> a batch-1 instance. Every concrete subclass of BatchedOperator must be here.
FACTORIES = {
    pe.DenseOperator: lambda: pe.DenseOperator(W),
    pe.LayerNormJacobian: lambda: pe.LayerNormJacobian(X[:1], gamma=1 + X[1] ** 2, eps=1e-5),
    pe.RMSNormJacobian: lambda: pe.RMSNormJacobian(X[:1], gamma=1 + X[2] ** 2, eps=1e-5),
    _FromLinearOperator: lambda: pe.from_linear_operator(W),
    po._Taken: lambda: po._Taken(pe.DenseOperator(np.stack([W, W.T, -W])), np.array([1])),
    po._Transposed: lambda: pe.DenseOperator(W).T,
    po.Identity: lambda: po.Identity(N),
    po.Scaled: lambda: po.Scaled(np.array([2.5]), pe.DenseOperator(W)),
    po.Sum: lambda: pe.DenseOperator(W) + pe.LayerNormJacobian(X[:1]),
    po.Product: lambda: pe.DenseOperator(W) @ pe.LayerNormJacobian(X[:1]),
    BlockJacobian: lambda: _block_jacobian(1),
    TokenJacobian: lambda: _token_jacobian(),
}


def _token_jacobian():
    st = _stack()
    h = st.hidden_states(np.random.default_rng(10).integers(0, 11, 3))[1]
    return TokenJacobian(st, h, 1, "last")


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_operator_class_is_covered():
    found = {c for c in _subclasses(po.BatchedOperator) if c is not _NormJacobian and c.__module__.startswith("pyengine.")}
    assert found <= set(FACTORIES), f"add a factory for {sorted(c.__name__ for c in found - set(FACTORIES))}"


@pytest.mark.parametrize("k", [1, 2, 7])
@pytest.mark.parametrize("cls", list(FACTORIES), ids=lambda c: c.__name__)
def test_k_rows_equal_k_single_products(cls, k):
    op = FACTORIES[cls]()
    assert type(op) is cls and op.batch == 1
    m, n = op.shape
    rng = np.random.default_rng(k)
    V, U = rng.standard_normal((k, n)), rng.standard_normal((k, m))
    for name, A in (("matvec", V), ("rmatvec", U)):
        one = np.concatenate([getattr(op, name)(a[None]) for a in A])
        np.testing.assert_allclose(getattr(op, name)(A), one, rtol=1e-12, atol=1e-12, err_msg=name)
        out = np.full_like(one, np.nan)
        getattr(op, name)(A, out=out)
        np.testing.assert_allclose(out, one, rtol=1e-12, atol=1e-12, err_msg=f"{name}, out=")
    L = pe.as_linear_operator(op)
    np.testing.assert_allclose(L @ V.T, np.stack([L @ v for v in V], axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(L.rmatmat(U.T), np.stack([L.rmatvec(u) for u in U], axis=1), rtol=1e-12, atol=1e-12)


def test_block_jacobian_rows_of_a_batch_use_their_own_prompt():
    op = _block_jacobian(3)
    V = np.random.default_rng(0).standard_normal((3, op.shape[1]))
    np.testing.assert_allclose(op.matvec(V), np.concatenate([op.take([b]).matvec(V[b : b + 1]) for b in range(3)]),
                               rtol=1e-12, atol=1e-12)


def test_batch1_block_jacobian_spectral_radius_is_the_dense_one():
    st = init_weights(StackConfig(d_model=16, n_heads=2, n_layers=2, vocab_size=30), seed=4, dtype=np.float64)
    h = st.hidden_states(np.random.default_rng(10).integers(0, 30, 10))[1]
    op = BlockJacobian(st, h, 1)
    J = np.stack([op.matvec(e[None])[0] for e in np.eye(op.shape[1])], axis=1)
    true = np.abs(np.linalg.eigvals(J)).max()
    res = pe.spectral_radius(op)
    assert res.converged.all()
    np.testing.assert_allclose(res.rho, true, rtol=1e-6)
