"""pyengine.analysis.block_spectra: the whole-block Jacobian as a BatchedOperator (matvec = block_jvp,
rmatvec = block_vjp) and block_jacobian_norm, against the dense Jacobian's SVD on tiny blocks."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine.analysis import BlockJacobian, block_jacobian_norm
from pyengine.models import StackConfig, init_weights

D, T = 8, 4


def _stack(dtype=np.float64, **kw):
    base = dict(d_model=D, n_heads=2, n_layers=2, d_mlp=12, max_seq_len=8, vocab_size=13)
    base.update(kw)
    return init_weights(StackConfig(**base), "xavier", seed=5, dtype=dtype, gamma_jitter=0.3, bias_std=0.1)


def dense(stack, h, k, mode="full"):
    """J (T*d, T*d) of block k at h from T*d JVPs, column c = J e_c."""
    n = h.size
    return stack.block_jvp(k, h, np.eye(n).reshape((n,) + h.shape), mode).reshape(n, n).T


CASES = [dict(), dict(causal=False, norm="rmsnorm", positions="rotary", n_kv_heads=1, activation="silu_gated"),
         dict(layout="parallel", placement="post", positions="none")]


@pytest.mark.parametrize("kw", CASES, ids=["pre-ln-causal", "rms-rotary-gqa-bidir", "parallel-post"])
@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_block_jacobian_norm_matches_dense_svd(kw, method):
    stack = _stack(**kw)
    ids = np.random.default_rng(0).integers(0, 13, (3, T))
    res = block_jacobian_norm(stack, ids, 1, method=method, tol=1e-10, max_iter=3000)
    hidden = stack.hidden_states(ids)
    want = [np.linalg.svd(dense(stack, hidden[1, b], 1), compute_uv=False)[0] for b in range(3)]
    assert res.sigma.shape == (3,) and res.converged.all()
    np.testing.assert_allclose(res.sigma, want, rtol=1e-8)
    assert np.all(res.upper == np.inf)


def test_operator_products_are_the_dense_jacobian_and_its_transpose():
    stack = _stack(causal=False)
    h = 0.3 + np.random.default_rng(1).standard_normal((2, T, D))
    op = BlockJacobian(stack, h, -1, mode="frozen_scale")
    assert op.batch == 2 and op.shape == (T * D, T * D) and op.dtype == np.float64
    V = np.random.default_rng(2).standard_normal((2, T * D))
    J = [dense(stack, h[b], 1, "frozen_scale") for b in range(2)]
    np.testing.assert_allclose(op.matvec(V), [J[b] @ V[b] for b in range(2)], rtol=1e-12, atol=1e-13)
    out = np.empty((2, T * D))
    assert op.rmatvec(V, out=out) is out
    np.testing.assert_allclose(out, [J[b].T @ V[b] for b in range(2)], rtol=1e-12, atol=1e-13)
    one = op.take([1])
    assert one.batch == 1 and one.caches[0] is op.caches[1]
    np.testing.assert_allclose(one.matvec(V[1:]), op.matvec(V)[1:], rtol=0, atol=0)
    # the spectral norm of the operator as a whole, through pe.spectral_norm
    res = pe.spectral_norm(op, method="lanczos", tol=1e-10)
    np.testing.assert_allclose(res.sigma, [np.linalg.norm(j, 2) for j in J], rtol=1e-8)


def test_float32_operator_and_a_float_stream():
    stack = _stack(np.float32)
    h0 = (0.3 + np.random.default_rng(3).standard_normal((T, D))).astype(np.float32)
    res = block_jacobian_norm(stack, h0, 0, tol=1e-5)
    want = np.linalg.norm(dense(stack.astype(np.float64), stack.hidden_states(h0)[0].astype(np.float64), 0), 2)
    assert res.sigma.shape == (1,)
    np.testing.assert_allclose(res.sigma[0], want, rtol=1e-4)


def test_bad_calls_name_the_argument():
    stack = _stack()
    ids = np.zeros((2, T), int)
    for call, exc, match in [
        (lambda: block_jacobian_norm(stack, ids, 2), ValueError, "^k "),
        (lambda: block_jacobian_norm(stack, ids, 0, method="svd"), ValueError, "^method "),
        (lambda: block_jacobian_norm(stack, ids, 0, mode="bogus"), ValueError, "mode"),
        (lambda: block_jacobian_norm(object(), ids, 0), TypeError, "^stack must be a pyengine Stack"),
        (lambda: block_jacobian_norm(stack, ids, 0, tol=2.0), ValueError, "tol"),
        (lambda: BlockJacobian(stack, np.zeros((T, D + 1)), 0), ValueError, "^h must have shape"),
        (lambda: BlockJacobian(stack, np.zeros((2, T, D)), 0).matvec(np.zeros((3, T * D))), ValueError, "^V must"),
    ]:
        with pytest.raises(exc, match=match):
            call()
