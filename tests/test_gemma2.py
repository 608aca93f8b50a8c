"""Gemma 2: the norm placement "peri", soft-capped scores and logits, the score scale and per-layer
sliding windows stay exact (JVP against central differences, VJP adjoint, weight gradients), every
backend agrees, and a transformers-made Gemma2 folder or live model matches transformers (float64
<= 1e-12, float32 <= 1e-4)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pyengine as pe
from pyengine import backends
from pyengine.models import _fast
from pyengine.models._attention import softcap_
from pyengine.models.config import StackConfig, expected_arrays
from pyengine.models.initialization import init_weights
from pyengine.models.pretrained import load_pretrained

OPTIONS = [
    dict(placement="peri", norm="rmsnorm"),
    dict(placement="peri", norm="layernorm"),
    dict(attn_softcap=0.6),
    dict(attn_scale=0.3),
    dict(sliding_window=(3, 0, 2)),
    dict(placement="peri", norm="rmsnorm", activation="gelu_tanh_gated", attn_softcap=0.8, attn_scale=0.4,
         sliding_window=(2, 0, 2), n_kv_heads=1),
    dict(positions="none", attn_softcap=0.5, sliding_window=(0, 3, 0)),
]
_ID = lambda o: "-".join(f"{k}={v}" for k, v in o.items())  # noqa: E731


def _stack(**kw):
    kw = {"positions": "rotary", **kw}
    cfg = StackConfig(d_model=16, n_heads=2, n_layers=3, d_mlp=24, max_seq_len=8, **kw)
    return init_weights(cfg, "xavier", seed=0, dtype=np.float64, gamma_jitter=0.3, bias_std=0.1)


def _data(seed=3, T=6):
    rng = np.random.default_rng(seed)
    return (0.3 + rng.standard_normal((T, 16)) for _ in range(3))


def test_softcap_and_its_derivative():
    x = np.linspace(-4, 4, 41)
    y = x.copy()
    d = softcap_(y, 1.5)
    assert np.allclose(y, 1.5 * np.tanh(x / 1.5), rtol=1e-15, atol=0)
    e = 1e-6
    fd = (1.5 * np.tanh((x + e) / 1.5) - 1.5 * np.tanh((x - e) / 1.5)) / (2 * e)
    assert np.max(np.abs(d - fd)) <= 1e-9


@pytest.mark.parametrize("opts", OPTIONS, ids=_ID)
def test_jvp_and_vjp_exact(opts):
    s = _stack(**opts)
    h, u, g = _data()
    for k in range(3):
        jvp = s.block_jvp(k, h, u[None])[0]
        eps = 1e-5
        fd = (s.block_forward(k, h + eps * u) - s.block_forward(k, h - eps * u)) / (2 * eps)
        assert np.linalg.norm(jvp - fd) <= 1e-7 * np.linalg.norm(fd), k
        vjp = s.block_vjp(k, h, g[None])[0]
        lhs, rhs = float(np.sum(g * jvp)), float(np.sum(vjp * u))
        assert abs(lhs - rhs) <= 1e-12 * (abs(lhs) + np.linalg.norm(g) * np.linalg.norm(u)), k
        # rows after a span and the per-token diagonal blocks take their own paths
        tail = u.copy()
        tail[:2] = 0
        assert np.allclose(s.block_jvp(k, h, u[2:], start=2), s.block_jvp(k, h, tail)[2:], rtol=0, atol=1e-12)
        dia = s.block_jvp_diagonal(k, h, u[[4]], [4])
        one = np.zeros_like(u)
        one[4] = u[4]
        assert np.allclose(dia[0], s.block_jvp(k, h, one)[4], rtol=0, atol=1e-12)


@pytest.mark.parametrize("opts", OPTIONS[-2:], ids=_ID)
def test_float32_paths_agree_with_float64(opts):
    s = _stack(**opts)
    h, u, g = _data()
    f32 = s.astype(np.float32)
    h32, u32, g32 = (a.astype(np.float32) for a in (h, u, g))
    for k in range(3):
        for a, b in ((s.block_forward(k, h), f32.block_forward(k, h32)),
                     (s.block_jvp(k, h, u), f32.block_jvp(k, h32, u32)),
                     (s.block_jvp(k, h, u[3:], start=3), f32.block_jvp(k, h32, u32[3:], start=3)),
                     (s.block_vjp(k, h, g), f32.block_vjp(k, h32, g32))):
            assert b.dtype == np.float32 and np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a), k
    _, cache = f32.block_forward(0, h32, return_cache=True)  # capped scores: never the compiled heads
    assert _fast.forward_path(cache.ctx, np.dtype(np.float32), False, 6) == "unfused"
    assert _fast.jvp_path(cache.ctx, np.dtype(np.float32)) == "gemm"


def test_peri_norm_weight_gradients_match_finite_differences():
    s = _stack(**OPTIONS[5])
    h, _, g = _data(4)
    _, grads = s.block_vjp(0, h, g, weights=True)
    rng = np.random.default_rng(5)
    for name in ("blocks.0.norm1_out.gamma", "blocks.0.norm2_out.gamma", "blocks.0.attn.w_qkv"):
        e = rng.standard_normal(s.weights[name].shape)

        def f(t):
            w = dict(s.weights)
            w[name] = w[name] + t * e
            return float(np.sum(g * type(s)(s.config, w).block_forward(0, h)))

        fd = (f(1e-5) - f(-1e-5)) / 2e-5
        assert abs(np.sum(grads[name] * e) - fd) <= 1e-7 * abs(fd), name


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_every_backend_agrees(compiled, dtype):
    s = _stack(**OPTIONS[5]).astype(dtype)
    h, u, g = (a.astype(dtype) for a in _data())

    def run():
        return s.hidden_states(h), s.block_jvp(0, h, u), s.block_jvp(1, h, u), s.block_vjp(2, h, g)

    with backends.use_backend("numpy"):
        ref = run()
    with backends.use_backend(compiled):
        got = run()
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for a, b in zip(ref, got):
        assert b.dtype == dtype and np.linalg.norm(a - b) <= tol * np.linalg.norm(a), compiled


def test_sites_of_the_output_norms_and_windows_per_block():
    s = _stack(**OPTIONS[5])
    h = next(_data())
    names = s.site_names()
    assert "blocks.1.norm1_out.output" in names and "blocks.1.norm2_out.scale" in names
    _, cache = s.run_with_cache(h, ["blocks.0.attn.out", "blocks.0.norm1_out.input", "blocks.0.attn.pattern",
                                    "blocks.1.attn.pattern"])
    assert np.array_equal(cache["blocks.0.attn.out"], cache["blocks.0.norm1_out.input"])
    _, tl = s.run_with_cache(h, ["blocks.2.ln2_post.hook_normalized", "blocks.2.norm2_out.output"])
    assert np.array_equal(tl["blocks.2.norm2_out.output"], tl["blocks.2.ln2_post.hook_normalized"])
    p0, p1 = cache["blocks.0.attn.pattern"], cache["blocks.1.attn.pattern"]
    assert np.all(p0[:, 5, :4] == 0) and np.all(p1[:, 5] > 0)  # block 0 slides (window 2), block 1 does not


@pytest.mark.parametrize("site", ["blocks.1.norm1_out.input", "blocks.1.norm1_out.output",
                                  "blocks.2.norm2_out.output"])
def test_injection_at_an_output_norm_site_linearizes(site):
    s = _stack(**OPTIONS[5])
    h = next(_data())
    v = np.random.default_rng(1).standard_normal(16)
    ex = pe.propagate(s, h, v, [1e-6], site)
    li = pe.propagate(s, h, v, [1e-6], site, linearized=True)
    assert np.abs(ex.projection - li.projection).max() <= 1e-5 * np.abs(ex.projection).max()


def test_padded_batch_equals_separate_runs():
    s = _stack(**OPTIONS[5])
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((7, 16)), rng.standard_normal((4, 16))
    batch = np.zeros((2, 7, 16))
    batch[0], batch[1, 3:] = a, b  # the second row left-padded
    mask = np.ones((2, 7), dtype=np.int64)
    mask[1, :3] = 0
    hs = s.hidden_states(batch, attention_mask=mask)
    assert np.allclose(hs[:, 0], s.hidden_states(a), rtol=0, atol=1e-12)
    assert np.allclose(hs[:, 1, 3:], s.hidden_states(b), rtol=0, atol=1e-12)


def test_config_round_trip_and_refusals(tmp_path):
    s = _stack(**OPTIONS[5])
    cfg = s.config
    assert StackConfig.from_json(cfg.to_json()) == cfg
    s.save(tmp_path / "g.npz")
    back = type(s).load(tmp_path / "g.npz")
    h = next(_data())
    assert back.config == cfg and np.array_equal(back.hidden_states(h), s.hidden_states(h))
    assert cfg.window(0) == 2 and cfg.window(1) == 0
    assert StackConfig(d_model=16, n_heads=2, n_layers=2, sliding_window=[3, 3]).sliding_window == 3
    assert "blocks.0.norm2_out.beta" in expected_arrays(_stack(placement="peri").config)
    with pytest.raises(ValueError, match="one window per layer"):
        StackConfig(d_model=16, n_heads=2, n_layers=3, sliding_window=(1, 2))
    with pytest.raises(ValueError, match="'peri'"):
        StackConfig(d_model=16, n_heads=2, n_layers=1, placement="peri", layout="parallel")
    with pytest.raises(ValueError, match="attn_softcap"):
        StackConfig(d_model=16, n_heads=2, n_layers=1, attn_softcap=-1.0)


# --------------------------------------------------------------------------- against transformers

def _tiny(**kw):
    import transformers as tr
    # window 4 < the 10 tokens in layers 0 and 2; caps small enough to bend the scores and logits
    base = dict(vocab_size=64, max_position_embeddings=32, hidden_size=16, num_attention_heads=4,
                num_key_value_heads=2, head_dim=4, num_hidden_layers=3, intermediate_size=24, sliding_window=4,
                query_pre_attn_scalar=7, attn_logit_softcapping=0.5, final_logit_softcapping=0.2,
                initializer_range=0.3)
    return tr.Gemma2Config(**{**base, **kw})


def _model(cfg):
    import torch
    import transformers as tr
    torch.manual_seed(0)
    model = tr.Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # random norms too, so that every array matters
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.fidelity
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("source", ["folder", "live", "folder_hd8"])
def test_matches_transformers(tmp_path, monkeypatch, dtype, source):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_families import assert_matches

    hd = 8 if source.endswith("_hd8") else 4  # 8: four heads span 32 != hidden_size 16
    model = _model(_tiny(head_dim=hd))
    if dtype == "float64":
        model = model.double()
    model.eval()
    if source.startswith("folder"):
        model.save_pretrained(tmp_path, safe_serialization=True)
        ours = load_pretrained(tmp_path, dtype=dtype)
    else:
        ours = pe.from_hf(model, dtype)
    cfg = ours.config
    assert (cfg.placement, cfg.sliding_window, cfg.attn_softcap, cfg.logit_softcap) == ("peri", (4, 0, 4), 0.5, 0.2)
    assert cfg.attn_scale == 7 ** -0.5 and cfg.head_dim == hd
    _, lt = assert_matches(ours, model, dtype, monkeypatch)
    ids = np.array([3, 17, 5, 60, 1, 42, 9, 33, 2, 11], dtype=np.int64)
    for field in ("attn_softcap", "logit_softcap", "attn_scale", "sliding_window"):  # each one matters here
        other = ours.replace(**{field: 0}).logits(ids)
        assert np.linalg.norm(other - lt) > 1e-3 * np.linalg.norm(lt), field


@pytest.mark.parametrize("field, value", [("use_bidirectional_attention", True), ("attention_bias", True),
                                          ("hidden_activation", "gelu"), ("layer_types", ["sliding_attention"]),
                                          ("attn_logit_softcapping", -1.0)])
def test_unsupported_fields_are_refused_by_name(tmp_path, field, value):
    pytest.importorskip("transformers")
    _model(_tiny(num_hidden_layers=2)).save_pretrained(tmp_path, safe_serialization=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(ValueError, match=f"'{field}'"):
        load_pretrained(tmp_path)


def test_missing_fields_take_transformers_defaults_and_null_means_none(tmp_path):
    tr = pytest.importorskip("transformers")
    _model(_tiny(num_hidden_layers=2, head_dim=256)).save_pretrained(tmp_path, safe_serialization=True)
    path = tmp_path / "config.json"
    full = json.loads(path.read_text())
    fields = ("query_pre_attn_scalar", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
              "layer_types", "head_dim")
    path.write_text(json.dumps({k: v for k, v in full.items() if k not in fields}))
    theirs, ours = tr.Gemma2Config.from_pretrained(tmp_path), load_pretrained(tmp_path).config
    assert theirs.head_dim == ours.head_dim == 256
    assert ours.attn_scale == theirs.query_pre_attn_scalar ** -0.5
    assert (ours.attn_softcap, ours.logit_softcap) == (theirs.attn_logit_softcapping, theirs.final_logit_softcapping)
    assert ours.sliding_window == tuple(theirs.sliding_window if t == "sliding_attention" else 0
                                        for t in theirs.layer_types)
    path.write_text(json.dumps({**full, "attn_logit_softcapping": None, "final_logit_softcapping": None}))
    ours = load_pretrained(tmp_path).config
    assert ours.attn_softcap == ours.logit_softcap == 0
