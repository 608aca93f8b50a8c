"""More model families: the new StackConfig options stay exact (JVP vs central difference, VJP
adjoint), and GPT-2, GPT-NeoX, Llama 3, Mistral, Qwen2, Qwen3 and Gemma folders written by
transformers load and match transformers itself (float64 <= 1e-12, float32 <= 1e-4)."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest

from pyengine.models.config import StackConfig
from pyengine.models.initialization import init_weights
from pyengine.models.pretrained import load_pretrained

NEW_OPTIONS = [
    dict(layout="parallel2", positions="rotary"),
    dict(activation="gelu_tanh_gated", norm="rmsnorm", positions="rotary"),
    dict(positions="rotary", rotary_dim=4),
    dict(positions="rotary", rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=4),
    dict(positions="rotary", rotary_dim=4, rope_scaling="longrope", rope_short_factor=(1.0, 2.0),
         rope_long_factor=(3.0, 5.0), rope_attention_factor=1.2, rope_original_max_len=4),
    dict(positions="rotary", n_kv_heads=1, sliding_window=3),
    dict(positions="rotary", norm="rmsnorm", qk_norm=True),
    dict(positions="none", qk_norm=True, sliding_window=2),
    dict(positions="rotary", norm="rmsnorm", qk_norm=True, n_kv_heads=1, head_dim=12),  # H dh = 24 != d = 16
    dict(positions="rotary", head_dim=4),
]


def _stack(**kw):
    cfg = StackConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=24, max_seq_len=8, **kw)
    return init_weights(cfg, "xavier", seed=0, dtype=np.float64, gamma_jitter=0.3, bias_std=0.1)


@pytest.mark.parametrize("opts", NEW_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_new_options_jvp_and_vjp_exact(opts):
    s = _stack(**opts)
    rng = np.random.default_rng(3)
    h, u, g = (0.3 + rng.standard_normal((6, 16)) for _ in range(3))
    jvp = s.block_jvp(0, h, u[None])[0]
    eps = 1e-5
    fd = (s.block_forward(0, h + eps * u) - s.block_forward(0, h - eps * u)) / (2 * eps)
    assert np.linalg.norm(jvp - fd) <= 1e-7 * np.linalg.norm(fd)
    vjp = s.block_vjp(0, h, g[None])[0]
    lhs, rhs = float(np.sum(g * jvp)), float(np.sum(vjp * u))
    assert abs(lhs - rhs) <= 1e-12 * (abs(lhs) + np.linalg.norm(g) * np.linalg.norm(u))


def test_qk_norm_weight_gradients_match_finite_differences():
    s = _stack(positions="rotary", norm="rmsnorm", qk_norm=True, n_kv_heads=1)
    rng = np.random.default_rng(4)
    h, g = (0.3 + rng.standard_normal((2, 6, 16)) for _ in range(2))
    _, grads = s.block_vjp(0, h[0], g, weights=True)
    for name in ("blocks.0.attn.q_norm", "blocks.0.attn.k_norm"):
        e = rng.standard_normal(8)

        def f(t):
            w = dict(s.weights)
            w[name] = w[name] + t * e
            return float(np.sum(g.sum(0) * type(s)(s.config, w).block_forward(0, h[0])))

        fd = (f(1e-5) - f(-1e-5)) / 2e-5
        assert abs(np.sum(grads[name] * e) - fd) <= 1e-7 * abs(fd), name


def test_unknown_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="rotary_dim"):
        StackConfig(d_model=16, n_heads=2, n_layers=1, positions="rotary", rotary_dim=3)
    with pytest.raises(ValueError, match="parallel2"):
        StackConfig(d_model=16, n_heads=2, n_layers=1, layout="parallel2", placement="post")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match="'mamba'"):
        load_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    llama = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
             "intermediate_size": 8, "vocab_size": 10}
    for extra, match in (({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
                         ({"mlp_bias": True}, "'mlp_bias'"), ({"hidden_act": "relu"}, "hidden_act 'relu'")):
        (tmp_path / "config.json").write_text(json.dumps({**llama, **extra}))
        with pytest.raises(ValueError, match=match):
            load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **{k: v for k, v in llama.items()
                                                                               if k != "model_type"},
                                                      "use_sliding_window": True, "sliding_window": 4,
                                                      "max_window_layers": 0,
                                                      "layer_types": ["sliding_attention", "full_attention"]}))
    with pytest.raises(ValueError, match="'layer_types'"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding_window"):
        StackConfig(d_model=16, n_heads=2, n_layers=1, causal=False, sliding_window=4)


# --------------------------------------------------------------------------- against transformers

def _tiny(family):
    import transformers as tr
    common = dict(vocab_size=64, max_position_embeddings=32)
    if family == "gpt2":
        return tr.GPT2Config(n_embd=16, n_head=2, n_layer=2, n_positions=32, vocab_size=64), tr.GPT2LMHeadModel
    if family.startswith("gpt_neox"):  # partial rotary; rotary_pct = 0: no rotation; 1: the whole head
        pct = {"gpt_neox": 0.5, "gpt_neox_norope": 0.0, "gpt_neox_fullrope": 1.0}[family]
        return tr.GPTNeoXConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                                rotary_pct=pct, tie_word_embeddings=False, **common), tr.GPTNeoXForCausalLM
    kw = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=24, **common)
    # "<family>_hd<n>": head_dim n, so 4 heads span 4 n != hidden_size 16 (Qwen3, Mistral-Nemo, Gemma 7B)
    family, _, hd = family.partition("_hd")
    hd = int(hd or 4)
    if family == "llama":
        return tr.LlamaConfig(head_dim=hd, tie_word_embeddings=False, **kw), tr.LlamaForCausalLM
    if family == "llama3":
        return tr.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                              rope_theta=500000.0, tie_word_embeddings=False, **kw), tr.LlamaForCausalLM
    if family == "qwen2":
        return tr.Qwen2Config(tie_word_embeddings=True, **kw), tr.Qwen2ForCausalLM
    if family == "qwen2_sliding":  # window 4 < the 10 tokens in every layer (max_window_layers 0)
        return tr.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=0, **kw), \
            tr.Qwen2ForCausalLM
    if family == "qwen2_mixed":  # layer 0 full attention, layer 1 a window of 4
        return tr.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, **kw), \
            tr.Qwen2ForCausalLM
    if family == "qwen3":  # q/k norms; a window in every layer
        return tr.Qwen3Config(head_dim=hd, use_sliding_window=True, sliding_window=4, max_window_layers=0,
                              tie_word_embeddings=False, **kw), tr.Qwen3ForCausalLM
    if family == "mistral":  # window 4 < the 10 tokens
        return tr.MistralConfig(sliding_window=4, head_dim=hd if hd != 4 else None, tie_word_embeddings=False, **kw), \
            tr.MistralForCausalLM
    if family == "gemma2":  # per-layer windows, soft-capping; 4 heads of 8 span 32 != hidden_size 16
        from test_gemma2 import _tiny as gemma2
        return gemma2(head_dim=8), tr.Gemma2ForCausalLM
    if family == "phi3":  # fused projections, rotary on 6 of 12 features, 2 heads of 12 span 24 != 16
        return tr.Phi3Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                             intermediate_size=24, head_dim=12, partial_rotary_factor=0.5, sliding_window=4,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **common), \
            tr.Phi3ForCausalLM
    return tr.GemmaConfig(head_dim=hd, hidden_activation="gelu_pytorch_tanh", **kw), tr.GemmaForCausalLM


def _rotary_float64(self, x, position_ids):
    """HF's rotary forward with the frequencies (base**(-2i/r), then HF's own rope scaling) and
    angles in float64: transformers computes both in float32 even in a float64 model (floor ~2e-9)."""
    import torch
    cfg = self.config
    pars = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    base = pars.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    r = self.inv_freq.shape[0] * 2
    f = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    if pars.get("rope_type") == "llama3":  # HF's _compute_llama3_parameters, in float64
        fac, lo, hi, old = (pars[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                             "original_max_position_embeddings"))
        wavelen = 2 * math.pi / f
        g = torch.where(wavelen > old / lo, f / fac, f)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * g / fac + smooth * g
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        f = torch.where(medium, smoothed, g)
    freqs = position_ids[..., None].double() * f
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = getattr(self, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


def _rms_float64(self, x):
    import torch
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * ((1.0 + self.weight) if type(self).__name__.startswith("Gemma") else self.weight)


def _rotary_modules(model):
    return [m for m in model.modules() if hasattr(m, "inv_freq") and type(m).__name__.endswith("RotaryEmbedding")]


@pytest.mark.fidelity
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "gpt_neox_norope", "gpt_neox_fullrope", "llama3", "qwen2",
                                    "gemma", "mistral", "qwen2_sliding", "qwen2_mixed", "qwen3",
                                    "llama_hd6", "mistral_hd2", "qwen3_hd8", "gemma_hd8"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_matches_transformers(tmp_path, monkeypatch, family, dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cfg, cls = _tiny(family)
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # random norms and biases too, so that every array matters
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    if dtype == "float64":
        model = model.double()
    model.eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_pretrained(tmp_path, dtype=dtype)
    if family.startswith(("mistral", "qwen2_sliding", "qwen3")):  # the window is in effect: the loaded Stack slides
        assert ours.config.sliding_window == 4
    if family == "qwen2_mixed":
        assert ours.config.sliding_window == (0, 4)
    assert_matches(ours, model, dtype, monkeypatch)
    if "_hd" in family:  # H dh != d, read from the config's head_dim
        assert ours.config.head_dim == int(family.partition("_hd")[2]) != 16 // 4


def assert_matches(ours, model, dtype, monkeypatch):
    """Hidden states and logits of ``ours`` and the transformers ``model`` on ten ids agree to 1e-12
    (float64) or 1e-4 (float32); returns (our logits, theirs)."""
    import torch
    # transformers computes the rotary angles, the eager softmax and RMSNorm in float32 even in a
    # float64 model, a floor of about 3e-9 on these models; in float64 they are recomputed in float64
    if dtype == "float64":
        softmax = torch.nn.functional.softmax

        def softmax64(x, *args, dtype=None, **kw):
            return softmax(x, *args, dtype=torch.float64 if x.dtype == torch.float64 else dtype, **kw)

        monkeypatch.setattr(torch.nn.functional, "softmax", softmax64)
        for m in _rotary_modules(model):
            m.forward = types.MethodType(_rotary_float64, m)
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.forward = types.MethodType(_rms_float64, m)
    ids = np.array([3, 17, 5, 60, 1, 42, 9, 33, 2, 11], dtype=np.int64)
    with torch.no_grad():
        out = model(torch.tensor(ids)[None], output_hidden_states=True)
    theirs = [t[0].numpy() for t in out.hidden_states]
    hs = ours.hidden_states(ids)
    tol = 1e-12 if dtype == "float64" else 1e-4
    for k in range(len(theirs) - 1):
        assert np.linalg.norm(hs[k] - theirs[k]) <= tol * np.linalg.norm(theirs[k]), f"layer {k}"
    last = ours.apply_final_norm(hs[-1])
    assert np.linalg.norm(last - theirs[-1]) <= tol * np.linalg.norm(theirs[-1])
    lg, lt = ours.logits(ids), out.logits[0].numpy()
    assert np.linalg.norm(lg - lt) <= tol * np.linalg.norm(lt)
    return lg, lt


def test_bf16_and_f16_widen_exactly(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    from pyengine.models._hf import Safetensors

    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
    st.save_file({"h": x.astype(np.float16)}, str(tmp_path / "a.safetensors"))
    raw = (tmp_path / "a.safetensors").read_bytes()
    header = raw[8: 8 + int.from_bytes(raw[:8], "little")].replace(b'"F16"', b'"BF16"')
    (tmp_path / "b.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bits.tobytes())
    f16 = Safetensors(str(tmp_path / "a.safetensors")).get("h", (5, 7), np.float64)
    assert np.array_equal(f16, x.astype(np.float16).astype(np.float64))
    bf = Safetensors(str(tmp_path / "b.safetensors")).get("h", (5, 7))
    assert np.array_equal(bf, (bits.astype(np.uint32) << 16).view(np.float32))
    assert np.all(np.abs(bf - x) <= np.abs(x) * 2.0 ** -7)
