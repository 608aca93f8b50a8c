"""Phi-3: tiny transformers models (fused projections, partial rotary, LongRoPE in both of its
regimes, a sliding window, a head_dim apart from d / H) loaded from a saved folder and from the live object match
transformers itself (float64 <= 1e-12, float32 <= 1e-4); unsupported fields are refused by name."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

import pyengine as pe
from pyengine.models.config import StackConfig
from pyengine.models.pretrained import load_pretrained

IDS = np.array([3, 17, 5, 60, 1, 42, 9, 33, 2, 11], dtype=np.int64)  # 10 tokens


def _tiny(case):
    import transformers as tr
    kw = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
              intermediate_size=24, vocab_size=64, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
    if case == "plain":  # rotary over the whole head, no scaling
        return tr.Phi3Config(**kw)
    if case == "tied_window":  # window 4 < the 10 tokens in every layer
        return tr.Phi3Config(**{**kw, "tie_word_embeddings": True}, sliding_window=4)
    if case == "head_dim":  # H dh = 24 != d = 16, rotary on 6 of the 12 features
        return tr.Phi3Config(**kw, head_dim=12, partial_rotary_factor=0.5)
    # head dim 8, rotary on its first 4 features (2 pairs); 10 tokens > 8 picks the long factors
    old = {"longrope_short": 16, "longrope_long": 8}[case]
    return tr.Phi3Config(**{**kw, "max_position_embeddings": 4 * old}, original_max_position_embeddings=old,
                         partial_rotary_factor=0.5,
                         rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5],
                                       "long_factor": [2.5, 7.0]})


def _rotary_float64(self, x, position_ids):
    """Phi-3's rotary forward (LongRoPE's choice of factors by the longest position included)
    with the frequencies and angles in float64: transformers computes them in float32."""
    import torch
    pars = self.config.rope_parameters
    r = self.inv_freq.shape[0] * 2
    base = torch.tensor(pars["rope_theta"], dtype=torch.float64)
    f = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    if pars["rope_type"] == "longrope":
        long = int(position_ids.max()) + 1 > pars["original_max_position_embeddings"]
        ext = torch.tensor(pars["long_factor" if long else "short_factor"], dtype=torch.float64)
        f = 1.0 / (ext * base ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    emb = torch.cat([position_ids[..., None].double() * f] * 2, dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _rms_float64(self, x):
    import torch
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _model(case, monkeypatch):
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    softmax = torch.nn.functional.softmax

    def softmax64(x, *args, dtype=None, **kw):  # HF's eager attention takes the softmax in float32
        return softmax(x, *args, dtype=torch.float64 if x.dtype == torch.float64 else dtype, **kw)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax64)
    torch.manual_seed(0)
    model = tr.Phi3ForCausalLM._from_config(_tiny(case), attn_implementation="eager")
    with torch.no_grad():  # random norms too, so that every array matters
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _float64(model):
    """``model`` in float64 with transformers' float32 rotary angles and RMSNorm recomputed in float64."""
    model = model.double()
    for m in model.modules():
        if type(m).__name__ == "Phi3RotaryEmbedding":
            m.forward = types.MethodType(_rotary_float64, m)
        elif type(m).__name__ == "Phi3RMSNorm":
            m.forward = types.MethodType(_rms_float64, m)
    return model


@pytest.mark.fidelity
@pytest.mark.parametrize("case", ["plain", "tied_window", "head_dim", "longrope_short", "longrope_long"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_matches_transformers(tmp_path, monkeypatch, case, dtype):
    import torch

    model = _model(case, monkeypatch)
    model.save_pretrained(tmp_path, safe_serialization=True)
    if dtype == "float64":
        model = _float64(model)
    with torch.no_grad():
        out = model(torch.tensor(IDS)[None], output_hidden_states=True)
    theirs, lt = [t[0].numpy() for t in out.hidden_states], out.logits[0].numpy()
    tol = 1e-12 if dtype == "float64" else 1e-4
    for ours in (load_pretrained(tmp_path, dtype=dtype), pe.from_hf(model, dtype)):
        cfg = ours.config
        assert cfg.sliding_window == (4 if case == "tied_window" else 0)
        assert cfg.lm_head == ("tied" if case == "tied_window" else "separate")
        rotary = {"plain": ("none", 8), "tied_window": ("none", 8), "head_dim": ("none", 6)}
        assert (cfg.rope_scaling, cfg.rotary_dim) == rotary.get(case, ("longrope", 4))
        assert cfg.head_dim == (12 if case == "head_dim" else 8)
        hs = ours.hidden_states(IDS)
        for k in range(len(theirs) - 1):
            assert np.linalg.norm(hs[k] - theirs[k]) <= tol * np.linalg.norm(theirs[k]), f"layer {k}"
        last = ours.apply_final_norm(hs[-1])
        assert np.linalg.norm(last - theirs[-1]) <= tol * np.linalg.norm(theirs[-1])
        lg = ours.logits(IDS)
        assert np.linalg.norm(lg - lt) <= tol * np.linalg.norm(lt)


def test_longrope_factors_follow_the_sequence_length(monkeypatch):
    """The first 8 tokens of a 10-token sequence (long factors, beyond the original 8) differ
    from the same 8 tokens alone (short factors); each agrees with transformers."""
    import torch

    model = _float64(_model("longrope_long", monkeypatch))
    ours = pe.from_hf(model, "float64")
    assert ours.config.rope_attention_factor == pytest.approx(np.sqrt(1 + np.log(4) / np.log(8)), rel=1e-15)
    for T in (8, 10):
        with torch.no_grad():
            lt = model(torch.tensor(IDS[:T])[None]).logits[0].numpy()
        lg = ours.logits(IDS[:T])
        assert np.linalg.norm(lg - lt) <= 1e-12 * np.linalg.norm(lt), T
    short, long = ours.logits(IDS[:8]), ours.logits(IDS)[:8]
    assert np.linalg.norm(short - long) > 1e-3 * np.linalg.norm(short)


def test_longrope_config_round_trips_and_is_checked():
    kw = dict(d_model=16, n_heads=2, n_layers=1, positions="rotary", rotary_dim=4, rope_scaling="longrope",
              rope_original_max_len=4, rope_attention_factor=1.2)
    cfg = StackConfig(**kw, rope_short_factor=[1.0, 2.0], rope_long_factor=(3.0, 4))
    assert cfg.rope_short_factor == (1.0, 2.0) and cfg.rope_long_factor == (3.0, 4.0)
    assert StackConfig.from_json(cfg.to_json()) == cfg
    assert "rope_long_factor" in cfg.to_dict() and "rope_long_factor" not in StackConfig(d_model=16, n_heads=2,
                                                                                           n_layers=1).to_dict()
    with pytest.raises(ValueError, match="rope_short_factor must hold 2"):
        StackConfig(**kw, rope_short_factor=(1.0,), rope_long_factor=(3.0, 4.0))
    with pytest.raises(TypeError, match="rope_long_factor"):
        StackConfig(**kw, rope_short_factor=(1.0, 2.0), rope_long_factor=(3.0, -4.0))
    with pytest.raises(ValueError, match="rope_short_factor must hold 0"):
        StackConfig(d_model=16, n_heads=2, n_layers=1, rope_short_factor=(1.0,))


PHI3 = {"model_type": "phi3", "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
        "intermediate_size": 8, "vocab_size": 10, "max_position_embeddings": 32}


@pytest.mark.parametrize("extra, match", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 4,
                       "original_max_position_embeddings": 8}}, "'short_factor' must be a list of 4"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"resid_pdrop": 0.1}, "'resid_pdrop'"),
    ({"partial_rotary_factor": 0.375}, "odd rotary width 3"),
])
def test_refused_fields_are_named(tmp_path, extra, match):
    (tmp_path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    (tmp_path / "config.json").write_text(json.dumps({**PHI3, **extra}))
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path)


def test_older_config_layout_reads_the_same(tmp_path, monkeypatch):
    """A config.json as transformers 4 wrote it (``rope_scaling`` with the old type name "su",
    ``rope_theta`` and ``partial_rotary_factor`` at the top) gives the same model."""
    model = _model("longrope_long", monkeypatch)
    model.save_pretrained(tmp_path, safe_serialization=True)
    new = load_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    pars = hf.pop("rope_parameters")
    hf.update(rope_theta=pars["rope_theta"], partial_rotary_factor=pars["partial_rotary_factor"],
              rope_scaling={"type": "su", "short_factor": pars["short_factor"], "long_factor": pars["long_factor"]})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    old = load_pretrained(tmp_path)
    assert old.config == new.config and old.config.rope_scaling == "longrope"
    np.testing.assert_array_equal(old.logits(IDS), new.logits(IDS))
