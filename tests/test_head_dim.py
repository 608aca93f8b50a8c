"""A head dimension decoupled from d_model / n_heads (``StackConfig.head_dim``, H dh != d).

The config (default, validation, JSON, replace), the arrays (shapes, init, .npz), and every
attention path with heads narrower or wider than d / H: a Stack with narrow heads equals one
with d / H heads whose extra heads write nothing (forward, JVP, VJP, sites; every backend,
float32 and float64); with wide heads the JVP matches central differences and the VJP is its
adjoint, and every backend agrees. The transformers comparisons (Llama, Mistral, Qwen3 and Gemma
with head_dim != hidden_size / heads) are in tests/test_families.py, the HF folder and GGUF
readers against a hand-written Llama in tests/test_pretrained.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import pyengine as pe
from pyengine.models.config import StackConfig, expected_arrays
from pyengine.models.initialization import SCHEMES
from pyengine.models.pretrained import load_pretrained
from pretrained_files import TINY_LLAMA, need_libs, tiny_llama_tensors, write_llama_gguf

D, IDS = 16, np.array([3, 14, 15, 9, 26, 5, 35, 8, 2, 7])
ATTN = [
    dict(),
    dict(positions="rotary", n_kv_heads=1, norm="rmsnorm", qk_norm=True, bias=False, activation="silu_gated"),
    dict(layout="parallel", causal=False, positions="sinusoidal"),
    dict(positions="rotary", rotary_dim=2, sliding_window=3, layout="parallel2"),
]


def _ids(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


def _cfg(head_dim=None, n_heads=2, **kw):
    return StackConfig(d_model=D, n_heads=n_heads, n_layers=2, d_mlp=24, vocab_size=40, max_seq_len=16, lm_head="tied",
                       head_dim=head_dim, **kw)


def _stack(head_dim, dtype=np.float64, **kw):
    return pe.init_weights(_cfg(head_dim, **kw), "xavier", seed=1, dtype=dtype, gamma_jitter=0.3, bias_std=0.1)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_config_default_explicit_and_errors():
    c = _cfg()
    assert c.head_dim == 8 and c.head_dim_is_default
    wide = _cfg(12, n_kv_heads=1)
    assert wide.head_dim == 12 and not wide.head_dim_is_default
    shapes = expected_arrays(_cfg(12, n_kv_heads=1, qk_norm=True))
    assert shapes["blocks.0.attn.w_qkv"] == (D, (2 + 2 * 1) * 12) and shapes["blocks.0.attn.w_o"] == (24, D)
    assert shapes["blocks.0.attn.b_qkv"] == (48,) and shapes["blocks.0.attn.q_norm"] == (12,)
    assert StackConfig(d_model=D, n_heads=3, n_layers=1, head_dim=5).head_dim == 5  # 3 does not divide 16
    with pytest.raises(ValueError, match=r"n_heads = 3 must divide d_model = 16 \(or give head_dim\)"):
        StackConfig(d_model=D, n_heads=3, n_layers=1)
    for bad, exc, match in ((0, ValueError, "head_dim must be >= 1; got 0"),
                            (2.0, TypeError, "head_dim must be an int"), (True, TypeError, "head_dim must be an int")):
        with pytest.raises(exc, match=match):
            _cfg(bad)
    with pytest.raises(ValueError, match="'rotary' needs an even head dim .head_dim.; got 5"):
        _cfg(5, positions="rotary")
    with pytest.raises(ValueError, match="rotary_dim = 8 must be even and <= the head dim 6"):
        _cfg(6, positions="rotary", rotary_dim=8)


def test_json_round_trip_and_replace():
    plain, wide = _cfg(), _cfg(12)
    assert "head_dim" not in json.loads(plain.to_json())  # the JSON of H dh = d configs is unchanged
    assert json.loads(wide.to_json())["head_dim"] == 12
    for c in (plain, wide, _cfg(8)):
        assert StackConfig.from_json(c.to_json()) == c and StackConfig.from_dict(c.to_dict()) == c
        assert list(c.to_dict()) == [k for k in c.__dataclass_fields__ if k in c.to_dict()]  # field order
    assert wide.to_dict()["head_dim"] == 12 and "head_dim" not in plain.to_dict()
    with pytest.raises(ValueError, match="unknown field.*head_dims"):
        StackConfig.from_dict({**wide.to_dict(), "head_dims": 12})
    with pytest.raises(ValueError, match="must be an object"):
        StackConfig.from_dict([1])
    assert _cfg(8) == plain
    # a default head_dim follows d_model and n_heads; a given one stays
    assert plain.replace(n_heads=4).head_dim == 4 and wide.replace(n_heads=4).head_dim == 12
    assert plain.replace(n_heads=4, head_dim=6).head_dim == 6
    st = _stack(12)
    assert st.replace(causal=False).config.head_dim == 12
    with pytest.raises(ValueError, match="must have shape"):  # other heads: other arrays
        st.replace(head_dim=6)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_init_weights_shapes_and_scale(scheme):
    W = pe.init_weights(_cfg(12, n_kv_heads=1), scheme, seed=0, dtype=np.float64).weights
    assert W["blocks.0.attn.w_qkv"].shape == (D, 48) and W["blocks.0.attn.w_o"].shape == (24, D)
    # q, k and v are drawn as separate (d, n dh) matrices: q (16, 24), k and v (16, 12); w_o (24, 16)
    q, k, v = np.split(W["blocks.0.attn.w_qkv"], [24, 36], axis=1)
    for a in (q, k, v, W["blocks.0.attn.w_o"]):
        assert np.all(np.isfinite(a)) and a.std() > 0
    if scheme == "xavier_normal":  # std sqrt(2 / (fan_in + fan_out)) of each matrix's own fans
        for a, fans in ((q, 40), (k, 28), (v, 28), (W["blocks.0.attn.w_o"], 40)):
            assert abs(a.std() / np.sqrt(2 / fans) - 1) < 0.15


def test_save_load_npz(tmp_path):
    st = _stack(12, np.float32, n_kv_heads=1, positions="rotary", qk_norm=True)
    st.save(tmp_path / "w.npz")
    back = pe.Stack.load(tmp_path / "w.npz")
    assert back.config == st.config and back.config.head_dim == 12
    for name, a in st.weights.items():
        np.testing.assert_array_equal(back.weights[name], a)
    np.testing.assert_array_equal(back.hidden_states(IDS), st.hidden_states(IDS))


def _padded(st):
    """The narrow-headed ``st`` (H dh < d) as a Stack with 2H heads of the same dh (= d / 2H, the
    default): the extra query, key and value heads are random, their rows of w_o zero, so they
    write nothing and the two Stacks compute the same function."""
    c = st.config
    H, Hkv, dh = c.n_heads, c.n_kv_heads, c.head_dim
    big = c.replace(n_heads=2 * H, n_kv_heads=2 * Hkv, head_dim=None)
    assert big.head_dim == dh and big.head_dim_is_default
    rng = np.random.default_rng(5)
    w = dict(st.weights)
    for k in range(c.n_layers):
        p = f"blocks.{k}.attn."
        for name in ("w_qkv", "b_qkv") if c.bias else ("w_qkv",):
            a = w[p + name]
            parts = np.split(a, [H * dh, (H + Hkv) * dh], axis=-1)
            w[p + name] = np.concatenate([np.concatenate([x, rng.standard_normal(x.shape).astype(a.dtype)], axis=-1)
                                          for x in parts], axis=-1)
        w[p + "w_o"] = np.concatenate([w[p + "w_o"], np.zeros_like(w[p + "w_o"])])
    return pe.Stack(big, w)


@pytest.mark.parametrize("kw", ATTN, ids=_ids)
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_narrow_heads_equal_padded_heads(kw, dtype, backend):
    st = _stack(4, dtype, **kw)  # 2 heads of 4: H dh = 8 < d = 16
    big = _padded(st)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    rng = np.random.default_rng(2)
    with pe.use_backend(backend):
        hs, hb = st.hidden_states(IDS), big.hidden_states(IDS)
        assert _rel(hs, hb) <= tol
        h = hs[1]
        t = rng.standard_normal((3,) + h.shape).astype(dtype)
        assert _rel(st.block_jvp(1, h, t), big.block_jvp(1, h, t)) <= tol
        assert _rel(st.block_vjp(1, h, t), big.block_vjp(1, h, t)) <= tol
        _, cs = st.run_with_cache(IDS, "blocks.1.attn.*")
        _, cb = big.run_with_cache(IDS, "blocks.1.attn.*")
    H, Hkv = st.config.n_heads, st.config.n_kv_heads
    for site, heads in (("q", H), ("k", Hkv), ("v", Hkv), ("head_out", H), ("result", H)):
        a, b = cs[f"blocks.1.attn.{site}"], cb[f"blocks.1.attn.{site}"]
        assert a.shape == (IDS.size, heads, 4 if site != "result" else D), site
        assert _rel(a, b[:, :heads]) <= tol, site
    for site in ("scores", "pattern"):
        assert _rel(cs[f"blocks.1.attn.{site}"], cb[f"blocks.1.attn.{site}"][:H]) <= tol, site


@pytest.mark.parametrize("kw", ATTN, ids=_ids)
@pytest.mark.parametrize("head_dim", [4, 12])
def test_jvp_matches_central_differences_and_vjp_is_its_adjoint(kw, head_dim):
    st = _stack(head_dim, **kw)
    rng = np.random.default_rng(3)
    h, u, g = (0.3 + rng.standard_normal((7, D)) for _ in range(3))
    jvp = st.block_jvp(1, h, u[None])[0]
    eps = 1e-5
    fd = (st.block_forward(1, h + eps * u) - st.block_forward(1, h - eps * u)) / (2 * eps)
    assert np.linalg.norm(jvp - fd) <= 1e-7 * np.linalg.norm(fd)
    vjp, grads = st.block_vjp(1, h, g[None], weights=True)
    lhs, rhs = float(np.sum(g * jvp)), float(np.sum(vjp[0] * u))
    assert abs(lhs - rhs) <= 1e-12 * (abs(lhs) + np.linalg.norm(g) * np.linalg.norm(u))
    for name in ("blocks.1.attn.w_qkv", "blocks.1.attn.w_o"):  # the weights' VJP against central differences
        assert grads[name].shape == st.weights[name].shape
        e = rng.standard_normal(grads[name].shape)

        def f(s):
            w = dict(st.weights)
            w[name] = w[name] + s * e
            return float(np.sum(g * pe.Stack(st.config, w).block_forward(1, h)))

        fd_w = (f(eps) - f(-eps)) / (2 * eps)
        assert abs(np.sum(grads[name] * e) - fd_w) <= 1e-7 * abs(fd_w), name
    # the per-token diagonal blocks A_t: the full JVP of a tangent on row t alone, read at row t
    tokens = [5, 2]
    diag = st.block_jvp_diagonal(1, h, u[tokens], tokens)
    for r, tok in enumerate(tokens):
        one = np.zeros_like(u)
        one[tok] = u[tok]
        np.testing.assert_allclose(diag[r], st.block_jvp(1, h, one)[tok], rtol=0, atol=1e-13 * np.abs(diag).max())


@pytest.mark.parametrize("kw", ATTN[:2], ids=_ids)
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_wide_heads_every_backend_agrees(kw, dtype, compiled):
    st = _stack(12, dtype, **kw)  # 2 heads of 12: H dh = 24 > d = 16
    rng = np.random.default_rng(4)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    h = st.hidden_states(IDS)[1]
    t = rng.standard_normal((3,) + h.shape).astype(dtype)
    out = {}
    for b in ("numpy", compiled):
        with pe.use_backend(b):
            hs = st.hidden_states(np.broadcast_to(IDS, (2, IDS.size)))
            out[b] = hs, st.block_jvp(1, h, t), st.block_vjp(1, h, t), st.logits(IDS)
    for a, r in zip(out[compiled], out["numpy"]):
        assert _rel(a, r) <= tol


def test_interventions_and_site_propagation_with_wide_heads():
    st = _stack(12, n_kv_heads=1, positions="rotary")
    out, c = st.run_with_cache(IDS, ["blocks.0.attn.head_out", "blocks.0.attn.result", "blocks.0.attn.out"],
                               interventions=[pe.ablate_head(0, 1)])
    assert c["blocks.0.attn.head_out"].shape == (IDS.size, 2, 12)
    assert not c["blocks.0.attn.head_out"][:, 1].any() and not c["blocks.0.attn.result"][:, 1].any()
    b_o = st.weights["blocks.0.attn.b_o"]
    np.testing.assert_allclose(c["blocks.0.attn.result"].sum(1) + b_o, c["blocks.0.attn.out"], atol=1e-13)
    V = np.random.default_rng(6).standard_normal((1, 24))
    eps = 1e-5
    ex = pe.propagate(st, IDS, V, [eps, -eps], "blocks.0.attn.head_out", [4], return_deltas=True)
    lin = pe.propagate(st, IDS, V, [eps], "blocks.0.attn.head_out", [4], return_deltas=True, linearized=True)
    cd = (ex.deltas[1:, 0::2] - ex.deltas[1:, 1::2]) / 2
    assert np.abs(cd).max() > 1e-5 * eps
    np.testing.assert_allclose(lin.deltas[1:], cd, rtol=0, atol=1e-6 * np.abs(cd).max())


def test_hf_readers_take_head_dim_from_the_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    llama = {"model_type": "qwen3", "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
             "intermediate_size": 8, "vocab_size": 10}
    for head_dim, match in ((0, "StackConfig.head_dim must be >= 1"), ("8", "'head_dim' must be an int"),
                            (5, "even head dim")):
        (tmp_path / "config.json").write_text(json.dumps({**llama, "head_dim": head_dim}))
        with pytest.raises(ValueError, match=match):
            load_pretrained(tmp_path)
    # a valid head_dim gets as far as the tensors: the wide q_proj the config asks for is missing
    (tmp_path / "config.json").write_text(json.dumps({**llama, "head_dim": 12}))
    with pytest.raises(ValueError, match="embed_tokens|q_proj"):
        load_pretrained(tmp_path)


def test_gguf_value_length_other_than_key_length_is_refused(tmp_path, monkeypatch):
    need_libs()
    import gguf

    config = TINY_LLAMA | {"head_dim": 6}
    write_value_length = gguf.GGUFWriter.add_value_length
    monkeypatch.setattr(gguf.GGUFWriter, "add_value_length", lambda self, n: write_value_length(self, n + 2))
    path = write_llama_gguf(tmp_path / "v.gguf", tiny_llama_tensors(config=config), config=config)
    with pytest.raises(ValueError, match=r"attention.value_length 8 != attention.key_length 6 is not supported"):
        load_pretrained(path)
