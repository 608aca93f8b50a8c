"""The fast paths of the stability report give the straightforward results."""

import numpy as np
import pytest

from pyengine.analysis.stability import mlp_stack, mlp_stacks, signal_propagation, signal_propagations
from pyengine.models import initialization as ini

SCHEMES = ("kaiming_normal", "xavier_normal", "torch_default", "orthogonal", "gpt2", "xavier_uniform",
           "kaiming_uniform", "spectral", "kaiming")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("residual", [False, True])
def test_mlp_stacks_equal_one_draw_per_scheme(dtype, residual):
    """Shared draws (one per family of schemes) are array for array the per-scheme draws."""
    many = mlp_stacks(3, 24, SCHEMES, residual=residual, d_mlp=40, seed=5, dtype=dtype)
    assert list(many) == list(SCHEMES)
    for s in SCHEMES:
        one = mlp_stack(3, 24, s, residual=residual, d_mlp=40, seed=5, dtype=dtype)
        assert len(one) == len(many[s]) == 3
        for a, b in zip(one, many[s]):
            assert len(a) == len(b) == (2 if residual else 1)
            for x, y in zip(a, b):
                assert x.dtype == dtype
                np.testing.assert_array_equal(x, y)
    # the families really share their numbers: xavier_normal is kaiming_normal rescaled
    k, x = many["kaiming_normal"][0][0], many["xavier_normal"][0][0]
    np.testing.assert_allclose(x / k, np.sqrt(ini.init_variance("xavier_normal", 24, k.shape[1])
                                              / ini.init_variance("kaiming_normal", 24, k.shape[1])), rtol=1e-5)


def test_init_matrices_does_not_let_one_scheme_overwrite_anothers_draws():
    shapes = [(30, 50, 0.02), (50, 30, 0.005)]
    got = ini.init_matrices([1, 2], ["orthogonal", "kaiming_normal", "gpt2"], shapes, dtype=np.float32)
    for s in ("orthogonal", "kaiming_normal", "gpt2"):
        rng = np.random.default_rng([1, 2])
        for m, (fi, fo, std) in zip(got[s], shapes):
            np.testing.assert_array_equal(m, ini.init_matrix(rng, s, fi, fo, gpt2_std=std, dtype=np.float32))


@pytest.mark.parametrize("shape", [pytest.param((768, 3072), marks=pytest.mark.slow), (3072, 768), (256, 256),
                                   (300, 500), (40, 40)])
def test_float32_orthogonal_is_orthogonal_and_the_householder_q(shape):
    """float32 CholeskyQR (one pass when the probe says it is already orthogonal, else two) gives
    the sign-fixed Householder Q of the same float32 draws to float32 rounding."""
    w = ini.init_matrix(np.random.default_rng(9), "orthogonal", *shape, dtype=np.float32)
    assert w.dtype == np.float32 and w.shape == shape
    w64 = w.astype(np.float64)
    small = min(shape)
    gram = w64.T @ w64 if shape[0] >= shape[1] else w64 @ w64.T
    assert np.abs(gram - np.eye(small)).max() < 3e-6
    z = np.random.default_rng(9).standard_normal((max(shape), small), dtype=np.float32).astype(np.float64)
    q, r = np.linalg.qr(z)
    q = q * np.sign(np.diag(r))
    np.testing.assert_allclose(w64, q if shape[0] >= shape[1] else q.T, atol=2e-4 if small == max(shape) else 2e-6)


@pytest.mark.parametrize("eps", [1e-3, 3e-4, 1e-4, 1e-5])
def test_float32_orthogonal_of_ill_conditioned_draws(eps):
    """Near-dependent columns (cond ~ 1/eps): float32 Cholesky breaks down (1e-3, 1e-5 here: the
    Householder fallback) or two passes get it orthogonal; either way QᵀQ = I to rounding and Q is
    the Householder Q to the problem's own float32 sensitivity."""
    a = np.random.default_rng(1).standard_normal((200, 50))
    a[:, 7] = a[:, 3] + eps * a[:, 7]
    a = a.astype(np.float32)
    q = ini._haar_columns(a).astype(np.float64)
    assert np.abs(q.T @ q - np.eye(50)).max() < 3e-6
    q64, r = np.linalg.qr(a.astype(np.float64))
    # Q's condition number is cond(a) ~ 1/eps: float32 arithmetic moves it by ~ cond x 6e-8 (10x margin)
    np.testing.assert_allclose(q, q64 * np.sign(np.diag(r)), atol=1e-6 + 6e-7 / eps)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_batched_norm_settings_equal_separate_runs(residual, activation):
    """signal_propagations (the settings' rows stacked through one product per layer) gives each
    setting's forward and backward RMS as its own signal_propagation run, to float32 rounding."""
    layers = mlp_stack(12, 64, "kaiming_normal", residual=residual, d_mlp=96, seed=2, dtype=np.float32)
    norms = ("none", "layernorm", "rmsnorm")
    both = signal_propagations("kaiming_normal", 12, 64, 16, activation=activation, norms=norms,
                               residual=residual, seed=2, layers=layers)
    assert [r.norm for r in both] == list(norms)
    for n, r in zip(norms, both):
        alone = signal_propagation("kaiming_normal", 12, 64, 16, activation=activation, norm=n, residual=residual,
                                   seed=2, layers=layers)
        np.testing.assert_allclose(r.forward_rms, alone.forward_rms, rtol=1e-5)
        np.testing.assert_allclose(r.backward_rms, alone.backward_rms, rtol=1e-5)
        np.testing.assert_array_equal(r.forward_pred, alone.forward_pred)
    assert not np.allclose(both[0].forward_rms, both[1].forward_rms)  # the settings do differ


def test_fast_forward_backward_equals_a_float64_straightforward_computation():
    """The report's float32 forward/backward RMS against a direct float64 computation of the same net."""
    layers = mlp_stack(6, 48, "kaiming_normal", residual=True, d_mlp=80, seed=4, dtype=np.float32)
    (r,) = signal_propagations("kaiming_normal", 6, 48, 20, norms=("layernorm",), residual=True, seed=4,
                               layers=layers)
    rng = np.random.default_rng([4, 1 << 30])
    h = rng.standard_normal((20, 48)).astype(np.float32).astype(np.float64)
    g = rng.standard_normal((20, 48)).astype(np.float32).astype(np.float64)

    def ln(x):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    hs, cache = [h], []
    for w1, w2 in layers:
        w1, w2 = w1.astype(np.float64), w2.astype(np.float64)
        u = ln(h) @ w1
        cache.append((h, u, w1, w2))
        h = h + np.maximum(u, 0) @ w2
        hs.append(h)
    gs = [g]
    for h_in, u, w1, w2 in reversed(cache):
        gz = ((g @ w2.T) * (u > 0)) @ w1.T
        # LayerNorm VJP by hand: (1/s)(gz - mean(gz) - x̂ mean(gz x̂))
        mu = h_in.mean(-1, keepdims=True)
        sd = np.sqrt(((h_in - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        xh = (h_in - mu) / sd
        g = g + (gz - gz.mean(-1, keepdims=True) - xh * (gz * xh).mean(-1, keepdims=True)) / sd
        gs.append(g)
    rms = lambda a: np.sqrt(np.mean(a * a))
    np.testing.assert_allclose(r.forward_rms, [rms(x) for x in hs], rtol=1e-4)
    np.testing.assert_allclose(r.backward_rms, [rms(x) for x in gs[::-1]], rtol=1e-4)


def test_signal_propagations_rejects_bad_norms():
    with pytest.raises(ValueError, match="norm"):
        signal_propagations("kaiming_normal", 2, 8, 4, norms=("none", "batchnorm"))
    with pytest.raises(ValueError, match="norms"):
        signal_propagations("kaiming_normal", 2, 8, 4, norms=())


def test_report_draws_one_schemes_stack_at_a_time_with_the_shared_draws_numbers(monkeypatch):
    """The report holds one scheme's weights at a time (memory), and its runs are those of the
    schemes' shared draw (mlp_stacks of all schemes at once), bit for bit."""
    import importlib

    es = importlib.import_module("pyengine.experiments.stability")  # the module, not the function

    schemes = ("kaiming_normal", "xavier_normal", "orthogonal", "torch_default")
    calls = []
    real = es.mlp_stacks
    monkeypatch.setattr(es, "mlp_stacks", lambda *a, **k: calls.append(tuple(a[2])) or real(*a, **k))
    rep = es.stability(schemes, 3, 32, 8, demo=False, gelu_check=True)
    assert sorted(calls) == sorted([(s,) for s in schemes] * 2)  # plain and residual, one scheme per call
    for residual in (False, True):
        shared = real(3, 32, schemes, residual=residual, dtype=np.float32)
        for s in schemes:
            ref = signal_propagations(s, 3, 32, 8, norms=("none", "layernorm"), residual=residual, dtype=np.float32,
                                      layers=shared[s])
            got = [r for r in rep.runs if r.scheme == s and r.residual == residual]
            assert [r.norm for r in got] == ["none", "layernorm"]
            for a, b in zip(got, ref):
                np.testing.assert_array_equal(a.forward_rms, b.forward_rms)
                np.testing.assert_array_equal(a.backward_rms, b.backward_rms)
    gelu = signal_propagation("kaiming_normal", 3, 32, 8, activation="gelu", dtype=np.float32,
                              layers=real(3, 32, schemes, dtype=np.float32)["kaiming_normal"])
    assert len(rep.gelu_runs) == 1
    np.testing.assert_array_equal(rep.gelu_runs[0].forward_rms, gelu.forward_rms)
