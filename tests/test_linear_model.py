"""The seed's linear model: the scaling fit of composed Jacobians (exact and Hutchinson)
against dense Jacobians, and the uniform split of a delta."""

import numpy as np
import pytest

import pyengine as pe
from pyengine.analysis.linear_model import scaling_fit, scaling_terms, uniform_split


def _stack(seed=0, scheme="xavier_normal", **kw):
    """xavier_normal: O(1) blocks, J_k far from alpha I + beta 11^T/d; gpt2: near the identity."""
    base = dict(d_model=16, n_heads=4, n_layers=4, d_mlp=32, vocab_size=256, max_seq_len=64)
    base.update(kw)
    return pe.init_weights(pe.StackConfig(**base), scheme, seed=seed, dtype=np.float64, gamma_jitter=0.3,
                           bias_std=0.1)


def _composed(st, ids, layer, t):
    """Dense d x d blocks (t, t) of d h_k / d h_layer for every k >= layer (full T*d Jacobians)."""
    h = st.hidden_states(ids)
    T, d = h.shape[1:]
    E = np.eye(T * d).reshape(T * d, T, d)
    J, out = np.eye(T * d), [np.eye(d)]
    for k in range(layer, st.config.n_layers):
        A = st.block_jvp(k, h[k], E).reshape(T * d, T * d).T  # column j = A e_j
        J = A @ J
        out.append(J[t * d:(t + 1) * d, t * d:(t + 1) * d])
    return np.array(out)


def _lstsq(J):
    """alpha, beta, unexplained of J ~ alpha I + beta 11^T/d by a direct least-squares solve."""
    d = J.shape[0]
    B = np.stack([np.eye(d).ravel(), np.full(d * d, 1.0 / d)], axis=1)
    coef, *_ = np.linalg.lstsq(B, J.ravel(), rcond=None)
    res = J.ravel() - B @ coef
    return coef[0], coef[1], (res @ res) / (J.ravel() @ J.ravel())


@pytest.mark.parametrize("kw, token", [(dict(), -1), (dict(), 4), (dict(norm="rmsnorm", positions="rotary"), -1),
                                       (dict(causal=False), 2), (dict(layout="parallel"), -1)],
                         ids=["last", "middle", "rmsnorm", "bidirectional", "parallel"])
def test_exact_scaling_fit_matches_dense_composed_jacobians(kw, token):
    st = _stack(**kw)
    ids = np.arange(5, 12)
    J = _composed(st, ids, 1, token % 7)
    f = scaling_fit(st, ids, 1, token, n_probes=16)  # n_probes >= d: exact
    assert f.exact and f.n_probes == 0 and f.token == token % 7 and f.alpha.shape == (4,)
    np.testing.assert_allclose(f.trace, np.trace(J, axis1=1, axis2=2), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f.frob2, (J**2).sum(axis=(1, 2)), rtol=1e-12)
    want = np.array([_lstsq(j) for j in J])
    np.testing.assert_allclose(f.alpha, want[:, 0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(f.beta, want[:, 1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(f.unexplained, want[:, 2], rtol=1e-8, atol=1e-13)
    drift = np.abs(J @ np.ones(16) - 1).max(axis=1)
    np.testing.assert_allclose(f.ones_drift, drift, atol=1e-12)
    if kw.get("norm", "layernorm") == "layernorm":  # J_LN 1 = 0, so a pre-LN J_k carries 1 unchanged
        assert f.ones_drift.max() < 1e-12
    else:
        assert f.ones_drift[1:].min() > 1e-3
    assert f.unexplained[1:].min() > 1e-4  # a real stack is not exactly alpha I + beta 11^T/d


def test_scaling_terms_recover_a_scaled_identity_plus_ones():
    d, alpha, beta = 10, 0.7, -0.4
    J = alpha * np.eye(d) + beta * np.ones((d, d)) / d
    a, b, u = scaling_terms(np.trace(J), (J**2).sum(), J.sum(), d)
    assert (a, b) == pytest.approx((alpha, beta), rel=1e-13) and abs(u) < 1e-14


def test_hutchinson_is_within_a_few_standard_errors():
    """The standard errors are first order: alpha must be resolved (alpha_se << |alpha|), as here."""
    st = _stack(scheme="gpt2", d_model=32, n_heads=4, d_mlp=64)
    ids = np.arange(30, 40)
    ex = scaling_fit(st, ids, 0, -1, n_probes=32)
    est = scaling_fit(st, ids, 0, -1, n_probes=24, seed=3)
    assert ex.exact and not est.exact and est.n_probes == 24
    row0 = slice(1, None)  # row 0 is J = I: every probe gives tr and |J|_F^2 exactly
    assert est.trace[0] == 32 and est.trace_se[0] == 0 and est.frob2[0] == 32
    for name in ("trace", "frob2", "alpha", "unexplained"):
        se = getattr(est, "alpha_se" if name == "alpha" else f"{name}_se")[row0]
        z = np.abs(getattr(est, name)[row0] - getattr(ex, name)[row0]) / se
        assert (se > 0).all() and z.max() < 4, (name, z)
    assert (est.alpha_se[row0] < 0.01 * np.abs(est.alpha[row0])).all()
    np.testing.assert_allclose(est.beta + est.alpha, ex.beta + ex.alpha, rtol=1e-12)  # b = 1^T J 1 / d is exact


def test_scaling_fit_bad_arguments():
    st = _stack()
    with pytest.raises(ValueError, match="n_probes must be a positive integer"):
        scaling_fit(st, np.arange(5), 0, -1, n_probes=0)
    with pytest.raises(ValueError, match="layer must be"):
        scaling_fit(st, np.arange(5), 9, -1)
    with pytest.raises(ValueError, match="positions must lie in"):
        scaling_fit(st, np.arange(5), 0, 5)


def test_uniform_split_against_a_direct_computation():
    x = np.random.default_rng(0).standard_normal((3, 2, 8)) + 0.5
    u, r = uniform_split(x)
    for i in np.ndindex(3, 2):
        m = x[i].mean()
        assert u[i] == pytest.approx(np.linalg.norm(np.full(8, m)), rel=1e-14)
        assert r[i] == pytest.approx(np.linalg.norm(x[i] - m), rel=1e-14)
    np.testing.assert_allclose(u**2 + r**2, (x**2).sum(axis=-1), rtol=1e-13)
    assert uniform_split(np.ones(5))[1] == 0 and uniform_split(np.arange(4.0) - 1.5)[0] == 0
    with pytest.raises(ValueError, match="width d >= 2"):
        uniform_split(np.ones((3, 1)))
