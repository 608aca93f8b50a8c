"""The attention-dynamics training step at an odd length past the kernels' blocking: its
gradient against Richardson central differences of its loss (float64, every backend,
both forward paths), and against the gradient computed on the values themselves (T x 15,
the public kernels and an explicit chain rule), which the step's V W_O form must equal."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from pyengine.kernels import attention as pa

ad = importlib.import_module("pyengine.experiments.attention_dynamics")


def _setup(T=301, seed=5, dtype="float64"):
    mu = np.random.default_rng(0).standard_normal((8, ad.D_IN))
    rng = np.random.default_rng(seed)
    X, y = ad.make_data(ad.markov_chain(8, 0.3), T, mu, rng)
    W = {k: 3 * v for k, v in ad.init_params(rng, 8, dtype).items()}  # away from the uniform start
    return X.astype(dtype), y, W


@pytest.mark.parametrize("want_z", [False, True], ids=["values", "via_z"])
def test_step_gradient_is_the_central_difference_odd_T(backend, want_z):
    X, y, W = _setup(T=301 if backend != "numpy" else 97)
    model = ad.Model(X, y, 8, backend)
    _, grads, _ = model.step(W, want_z=want_z)
    rng = np.random.default_rng(9)
    for name in W:
        d = rng.standard_normal(W[name].shape)

        def f(t, name=name, d=d):
            return model.step({**W, name: W[name] + t * d})[0]["loss"]

        h = 1e-4
        est = (4 * (f(h / 2) - f(-h / 2)) / h - (f(h) - f(-h)) / (2 * h)) / 3
        got = float((grads[name] * d).sum())
        assert abs(got - est) <= 1e-8 * max(1.0, abs(est)), (name, got, est)


def test_step_gradient_equals_the_chain_rule_on_the_values(compiled):
    X, y, W = _setup()
    T = X.shape[0]
    metrics, grads, _ = ad.Model(X, y, 8, compiled).step(W)
    Q, K, V = (X @ W["W_Q"])[None], (X @ W["W_K"])[None], (X @ W["W_V"])[None]
    f = pa.attention_forward(Q, K, V, offset=0, backend="numpy")
    logits = f.out[0] @ W["W_O"]
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = float(-(z - np.log(np.exp(z).sum(axis=1, keepdims=True)))[np.arange(T), y].sum() / T)
    dlogits = (p - np.eye(8)[y]) / T
    d_o = (dlogits @ W["W_O"].T)[None]
    b = pa.attention_backward(Q, K, V, d_o, f.lse, o=f.out, offset=0, backend="numpy")
    want = {"W_Q": X.T @ b.dq[0], "W_K": X.T @ b.dk[0], "W_V": X.T @ b.dv[0], "W_O": f.out[0].T @ dlogits}
    assert abs(metrics["loss"] - loss) < 1e-12
    assert abs(metrics["attn_entropy"] - f.entropy.mean()) < 1e-12
    assert abs(metrics["adv_spread"] - b.spread.mean() * T) < 1e-10 * max(1.0, b.spread.mean() * T)
    for name, w in want.items():
        np.testing.assert_allclose(grads[name], w, rtol=1e-10, atol=1e-13 * np.abs(w).max(), err_msg=name)
