"""Signal propagation: the formulas against measurement, the backward pass against a directional
derivative, weight spectra of a Stack and of a real model, the report and the CLI."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine.analysis.stability import mlp_stack, signal_propagation
from pyengine.analysis.weight_spectra import weight_spectra


def test_kaiming_keeps_relu_rms_within_a_factor_2_over_50_layers():
    r = signal_propagation("kaiming_normal", 50, 1024, 32, activation="relu")
    assert np.all(r.forward_rms < 2 * r.forward_rms[0]) and np.all(r.forward_rms > r.forward_rms[0] / 2)
    assert np.all(r.backward_rms < 2 * r.backward_rms[-1]) and np.all(r.backward_rms > r.backward_rms[-1] / 2)
    np.testing.assert_allclose(r.forward_pred, 1.0)  # sqrt(n_in * 2/n_in * 1/2) = 1 per layer


def test_xavier_and_torch_default_collapse_with_relu_as_predicted():
    for scheme, per_layer in (("xavier_normal", np.sqrt(0.5)), ("torch_default", np.sqrt(1 / 6))):
        r = signal_propagation(scheme, 50, 512, 32, activation="relu")
        np.testing.assert_allclose(r.forward_pred[1:] / r.forward_pred[:-1], per_layer, rtol=1e-10)
        assert r.forward_rms[-1] < 1e-6
        f, b = r.departure()
        assert f < 0.5 and b < 0.5  # within a factor 1.65 over 50 layers, at width 512


@pytest.mark.parametrize(("norm", "residual"), [("none", False), ("layernorm", False), ("rmsnorm", True),
                                                 ("layernorm", True)])
def test_measurement_follows_the_mean_field_prediction(norm, residual):
    r = signal_propagation("kaiming_normal", 20, 512, 32, activation="relu", norm=norm, residual=residual)
    f, b = r.departure()
    assert f < 0.3 and b < 0.4


@pytest.mark.parametrize("scheme", ["kaiming_normal", "torch_default", "orthogonal"])
def test_mlp_stack_is_the_same_for_any_thread_count(scheme):
    """The layers are drawn in parallel (one seeded stream per layer): the same weights as one thread."""
    many = mlp_stack(5, 32, scheme, residual=True, dtype=np.float32, seed=3)
    with pe.num_threads(1):
        one = mlp_stack(5, 32, scheme, residual=True, dtype=np.float32, seed=3)
    assert len(many) == len(one) == 5
    for a, b in zip(many, one):
        assert len(a) == 2 and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(many[0][0], many[1][0])  # every layer its own stream


def test_backward_is_the_exact_vjp():
    """<dL/dh_0, δ> = d/dε <u, h_L(h_0 + ε δ)> with the same cotangent u (central difference, float64)."""
    from pyengine.analysis import stability as st

    for norm, residual in (("none", False), ("layernorm", True)):
        depth, width, tokens = 4, 16, 5
        layers = mlp_stack(depth, width, "kaiming_normal", residual=residual, d_mlp=24)
        rng = np.random.default_rng([0, 1 << 30])
        h0 = rng.standard_normal((tokens, width))
        u = rng.standard_normal((tokens, width))

        def forward(h):
            for ws in layers:
                a = st._phi("gelu", st._norm_fwd(norm, h) @ ws[0])
                h = h + a @ ws[1] if residual else a
            return h

        g = h0.copy()  # recompute the backward pass by hand through signal_propagation's pieces
        hs, pre = [h0], []
        for ws in layers:
            pre.append(st._norm_fwd(norm, hs[-1]) @ ws[0])
            a = st._phi("gelu", pre[-1])
            hs.append(hs[-1] + a @ ws[1] if residual else a)
        g = u
        for k in range(depth - 1, -1, -1):
            gb = g @ layers[k][1].T if residual else g
            gh = st._norm_vjp(norm, hs[k], (gb * st._dphi("gelu", pre[k])) @ layers[k][0].T)
            g = g + gh if residual else gh
        delta = np.random.default_rng(9).standard_normal(h0.shape)
        eps = 1e-6
        fd = (np.sum(u * forward(h0 + eps * delta)) - np.sum(u * forward(h0 - eps * delta))) / (2 * eps)
        assert np.sum(g * delta) == pytest.approx(fd, rel=1e-6)
        r = signal_propagation("kaiming_normal", depth, width, tokens, activation="gelu", norm=norm,
                               residual=residual, d_mlp=24, layers=layers)
        assert r.backward_rms[0] == pytest.approx(np.sqrt(np.mean(g * g)), rel=1e-12)
        assert r.forward_rms[-1] == pytest.approx(np.sqrt(np.mean(hs[-1] ** 2)), rel=1e-12)


def test_weight_spectra_of_a_stack():
    cfg = pe.StackConfig(d_model=64, n_heads=4, n_layers=2, d_mlp=128, n_kv_heads=2, activation="silu_gated")
    ws = weight_spectra(pe.init_weights(cfg, "spectral", dtype=np.float64))
    assert ws.kind[:7] == ("q", "k", "v", "o", "gate", "up", "down")
    np.testing.assert_allclose(ws.rms_to_rms, 1.0, rtol=1e-6)  # the spectral scheme meets the condition exactly
    assert ws.d_out[1] == 32 and ws.d_in[1] == 64  # k of 2 kv heads
    assert np.all(ws.stable_rank >= 1) and np.all(ws.stable_rank <= np.minimum(ws.d_out, ws.d_in))
    assert "gate" in ws.to_text() and set(ws.by_kind()) == {"q", "k", "v", "o", "gate", "up", "down"}
    with pytest.raises(TypeError, match="Stack"):
        weight_spectra({"a": np.eye(3)})


def test_weight_spectra_of_minilm(tmp_path):
    try:
        model = pe.load_pretrained("all-MiniLM-L6-v2")
    except (OSError, ValueError, ImportError) as exc:
        pytest.skip(f"MiniLM not installed: {exc}")
    ws = weight_spectra(model, include_embeddings=False)
    assert len(ws) == 6 * 6 and np.all(ws.rms_to_rms > 1)  # trained weights are far above Theta(1) = 1
    assert ws.plot(str(tmp_path / "w.png")).endswith("w.png")


def test_report_and_cli(tmp_path, capsys):
    from pyengine.cli import main

    assert main(["stability", "--depth", "6", "--width", "32", "--tokens", "8", "--schemes", "kaiming_normal,gpt2",
                 "--stack-depth", "3", "--stack-width", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kaiming_normal relu pre-layernorm residual" in out and "spectral" in out
    assert "gpt2 gelu post-layernorm sequential causal attn" in out and "transformer stacks" in out
    assert (tmp_path / "stability.png").exists() and (tmp_path / "descent.png").exists()
    assert (tmp_path / "stack_stability.png").exists()
    assert main(["stability", "--schemes", "he", "--out", str(tmp_path), "--no-demo", "--depth", "2"]) == 2
    assert "--schemes: unknown scheme 'he'" in capsys.readouterr().err


def test_cli_default_includes_the_real_model_table(tmp_path, capsys):
    """The default run has the spectral-condition table of MiniLM (or says why it skipped it)."""
    from pyengine.cli import main

    assert main(["stability", "--depth", "3", "--width", "16", "--tokens", "4", "--schemes", "kaiming_normal",
                 "--no-stacks", "--no-demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    try:
        pe.load_pretrained("all-MiniLM-L6-v2")
    except (OSError, ImportError):
        assert "spectral condition of a real model: skipped" in out
        return
    assert "Spectral condition of all-MiniLM-L6-v2" in out and "down" in out
    assert main(["stability", "--depth", "3", "--width", "16", "--tokens", "4", "--schemes", "kaiming_normal",
                 "--no-stacks", "--no-demo", "--model", "none", "--out", str(tmp_path)]) == 0
    assert "Spectral condition of" not in capsys.readouterr().out


@pytest.mark.parametrize("kw", [dict(), dict(placement="post", positions="rotary"), dict(layout="parallel", causal=False),
                                dict(residual=False, norm="rmsnorm"), dict(activation="silu_gated", n_kv_heads=2)])
def test_stack_backward_rms_is_the_stack_vjp(kw):
    """Transformer stacks: the backward RMS per layer equals that of Stack.vjp(from_layer=L, to_layer=l) of the
    same cotangent, the forward RMS that of hidden_states, in every architecture."""
    from pyengine.analysis import stack_signal_propagation

    cfg = pe.StackConfig(d_model=32, n_heads=4, n_layers=4, d_mlp=48, **kw)
    st = pe.init_weights(cfg, "kaiming_normal", seed=3, dtype=np.float64)
    rng = np.random.default_rng(7)
    h0, u = rng.standard_normal((2, 9, 32))
    r = stack_signal_propagation(st, h0=h0, cotangent=u, scheme="kaiming_normal")
    hidden = st.hidden_states(h0)
    for layer in range(cfg.n_layers + 1):
        direct = st.vjp(h0, u, from_layer=cfg.n_layers, to_layer=layer)
        assert r.backward_rms[layer] == pytest.approx(np.sqrt(np.mean(direct**2)), rel=1e-12)
        assert r.forward_rms[layer] == pytest.approx(np.sqrt(np.mean(hidden[layer] ** 2)), rel=1e-12)
    assert r.backward_rms[-1] == pytest.approx(np.sqrt(np.mean(u**2)), rel=1e-12)
    assert r.forward_pred.shape == r.backward_pred.shape == (5,) and np.all(np.isfinite(r.backward_pred))
    assert "attn" in r.label
    with pytest.raises(TypeError, match="stack"):
        stack_signal_propagation(object())
    with pytest.raises(ValueError, match="cotangent"):
        stack_signal_propagation(st, h0=h0, cotangent=u[:3])


def test_stack_prediction_holds_where_its_assumptions_do():
    """gpt2 init, pre-LN: branches are small, attention near uniform, so the mean field holds to 2 %; with
    kaiming weights the branches grow, tokens correlate through attention and the forward departs."""
    from pyengine.analysis import stack_signal_propagation

    cfg = pe.StackConfig(d_model=128, n_heads=4, n_layers=8, positions="none")
    small = stack_signal_propagation(pe.init_weights(cfg, "gpt2", dtype=np.float64), 32, scheme="gpt2")
    assert max(small.departure()) < 0.02
    big = stack_signal_propagation(pe.init_weights(cfg, "kaiming_normal", dtype=np.float64), 32,
                                   scheme="kaiming_normal")
    assert big.departure()[0] > 0.1 and big.forward_rms[-1] > 2 * big.forward_rms[0]


def test_gelu_second_moment_is_exact_and_not_relus_half():
    from scipy import integrate, special

    from pyengine.analysis.stability import gelu_second_moment

    for q in (1e-3, 0.3, 1.0, 2.0, 7.5):
        dens = lambda z, q=q: (z * special.ndtr(z)) ** 2 * np.exp(-z * z / (2 * q)) / np.sqrt(2 * np.pi * q)
        assert gelu_second_moment(q) == pytest.approx(integrate.quad(dens, -np.inf, np.inf, epsabs=0,
                                                                     epsrel=1e-13)[0], rel=1e-10)
    z = np.random.default_rng(0).standard_normal(2_000_000)
    assert np.mean((z * special.ndtr(z)) ** 2) == pytest.approx(gelu_second_moment(1.0), rel=5e-3)
    assert gelu_second_moment(1.0) == pytest.approx(0.4252214826, rel=1e-9)  # 1/4 + 1/12 + 1/(2 pi sqrt 3)
    assert gelu_second_moment(1e-6) / 1e-6 == pytest.approx(0.25, rel=1e-3)
    assert gelu_second_moment(1e6) / 1e6 == pytest.approx(0.5, rel=1e-3)
    with pytest.raises(ValueError, match="q"):
        gelu_second_moment(-1.0)


def test_report_states_the_departures():
    from pyengine.experiments.stability import format_stability, stability

    rep = stability(("kaiming_normal",), 6, 64, 16, demo=False)
    text = format_stability(rep)
    assert "Departures from the init formula" in text and "GELU is not ReLU" in text
    assert text.count("kaiming_normal relu") >= 8 and "0.4252" in text
    assert rep.gelu_runs and rep.gelu_runs[0].activation == "gelu"


def test_one_blas_thread_limits_every_blas_library_and_restores():
    """NumPy's and SciPy's OpenBLAS are separate pools: both are single-threaded inside, as before after."""
    import scipy.linalg  # noqa: F401  (its BLAS loaded)
    from threadpoolctl import threadpool_info

    from pyengine.backends import one_blas_thread

    before = {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
    assert before
    with one_blas_thread():
        inside = {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
    after = {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
    assert set(inside) == set(before) and all(n == 1 for n in inside.values())
    assert after == before


@pytest.mark.parametrize("bad", [2, 0])
def test_stack_backward_checks_once_and_names_the_block(monkeypatch, bad):
    """The block VJPs run unchecked (the cotangent is checked once); NaN from block ``bad``'s
    VJP, a middle one (the next kernel refuses it) or the last one run (found by the
    check at the end), is one error naming that block."""
    from pyengine.analysis import stack_signal_propagation
    from pyengine.models import Stack

    st = pe.init_weights(pe.StackConfig(d_model=16, n_heads=4, n_layers=4, d_mlp=24), seed=1, dtype=np.float64)

    def refuse(*a, **k):
        raise AssertionError("a cotangent was checked again")

    monkeypatch.setattr(Stack, "_linearize", refuse)
    assert np.isfinite(stack_signal_propagation(st, 6).backward_rms).all()
    real = Stack.vjp_rows

    def spoiled(self, c, *args):
        out = real(self, c, *args)
        return out * np.nan if c.block == bad else out

    monkeypatch.setattr(Stack, "vjp_rows", spoiled)
    with pytest.raises(ValueError, match=rf"first in dL/dh_{bad} \(the VJP of block {bad}, 0-based\)"):
        stack_signal_propagation(st, 6)
