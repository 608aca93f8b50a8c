"""pyengine.models.stack: configs (validation, JSON), weight initialization, the expected
arrays of each layout, and weights files (save, load, damaged or lying files)."""

from __future__ import annotations

import dataclasses
import json
import math
import zipfile

import numpy as np
import pytest

import pyengine as pe
from pyengine.models import Stack, StackConfig, expected_arrays, init_weights
from test_model import D, D_MLP, make_stack


# --------------------------------------------------------------------------- initialization


def test_init_schemes():
    cfg = StackConfig(d_model=64, n_heads=4, n_layers=6, d_mlp=256, n_kv_heads=2)
    gpt2 = init_weights(cfg, "gpt2", seed=3, dtype=np.float64).weights
    assert abs(gpt2["blocks.0.attn.w_qkv"].std() - 0.02) < 0.002
    assert abs(gpt2["blocks.0.mlp.w_out"].std() - 0.02 / math.sqrt(12)) < 0.001
    np.testing.assert_array_equal(gpt2["blocks.0.norm1.gamma"], 1.0)
    np.testing.assert_array_equal(gpt2["blocks.0.attn.b_qkv"], 0.0)
    xav = init_weights(cfg, "xavier", dtype=np.float64).weights["blocks.0.mlp.w_in"]
    assert np.abs(xav).max() <= math.sqrt(6 / (64 + 256))
    kai = init_weights(cfg, "kaiming", dtype=np.float64).weights["blocks.0.mlp.w_out"]
    assert abs(kai.std() - math.sqrt(2 / 256)) < 0.01
    # Seeded per array: reproducible, and float32 is the rounded float64.
    again = init_weights(cfg, "gpt2", seed=3, dtype=np.float32).weights
    np.testing.assert_array_equal(again["blocks.5.attn.w_o"], gpt2["blocks.5.attn.w_o"].astype(np.float32))
    other = init_weights(cfg, "gpt2", seed=4, dtype=np.float64).weights
    assert not np.array_equal(other["blocks.0.attn.w_o"], gpt2["blocks.0.attn.w_o"])
    jit = init_weights(cfg, gamma_jitter=0.1, bias_std=0.1).weights
    assert jit["blocks.0.norm1.gamma"].std() > 0.05 and jit["blocks.0.norm1.beta"].std() > 0.05
    with pytest.raises(ValueError, match="scheme"):
        init_weights(cfg, "he_normal")
    with pytest.raises(TypeError, match="dtype"):
        init_weights(cfg, dtype=np.float16)


# --------------------------------------------------------------------------- config


def test_config_json_round_trip_and_defaults():
    cfg = StackConfig(d_model=16, n_heads=4, n_layers=3, n_kv_heads=2, norm="rmsnorm", positions="rotary",
                      gamma_scale=0.5, eps=1e-6, vocab_size=7)
    assert StackConfig.from_json(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json())["n_kv_heads"] == 2
    plain = StackConfig(d_model=16, n_heads=4, n_layers=1)
    assert plain.n_kv_heads == 4 and plain.d_mlp == 64 and plain.head_dim == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.d_model = 8


@pytest.mark.parametrize("change, exc, field", [
    (dict(d_model=1), ValueError, "d_model"),
    (dict(d_model=16.0), TypeError, "d_model"),
    (dict(n_heads=3), ValueError, "n_heads"),
    (dict(n_heads=0), ValueError, "n_heads"),
    (dict(n_kv_heads=3), ValueError, "n_kv_heads"),
    (dict(n_layers=0), ValueError, "n_layers"),
    (dict(d_mlp=True), TypeError, "d_mlp"),
    (dict(norm="batchnorm"), ValueError, "norm"),
    (dict(placement="middle"), ValueError, "placement"),
    (dict(layout="diagonal"), ValueError, "layout"),
    (dict(activation="tanh"), ValueError, "activation"),
    (dict(positions="alibi"), ValueError, "positions"),
    (dict(residual=1), TypeError, "residual"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(eps=-1e-5), ValueError, "eps"),
    (dict(eps=float("nan")), TypeError, "eps"),
    (dict(gamma_scale="1"), TypeError, "gamma_scale"),
    (dict(rope_base=0.0), ValueError, "rope_base"),
    (dict(max_seq_len=0), ValueError, "max_seq_len"),
    (dict(vocab_size=-1), ValueError, "vocab_size"),
    (dict(d_model=12, n_heads=4, positions="rotary"), ValueError, "positions"),
], ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else None)
def test_config_validation_names_the_field(change, exc, field):
    args = dict(d_model=16, n_heads=2, n_layers=2) | change
    with pytest.raises(exc, match=field):
        StackConfig(**args)


@pytest.mark.parametrize("text, match", [
    ("{not json", "malformed"),
    ("[1, 2]", "must be an object"),
    ('{"d_model": 16, "n_heads": 2, "n_layers": 1, "dropout": 0.1}', "unknown field.*dropout"),
    ('{"d_model": 16, "n_heads": 2}', "lacks required.*n_layers"),
    ('{"d_model": 16, "n_heads": 2, "n_layers": 1, "norm": "layer"}', "StackConfig.norm"),
])
def test_config_from_json_errors(text, match):
    with pytest.raises((ValueError, TypeError), match=match):
        StackConfig.from_json(text)


# --------------------------------------------------------------------------- weights files


def test_save_load_round_trip(tmp_path):
    stack = make_stack(dtype=np.float32, vocab_size=5, positions="learned", n_kv_heads=1)
    path = tmp_path / "stack.npz"
    stack.save(path)
    back = Stack.load(path)
    assert back.config == stack.config and back.dtype == np.float32
    assert back.weights.keys() == stack.weights.keys()
    for name, a in stack.weights.items():
        np.testing.assert_array_equal(back.weights[name], a)
    ids = np.array([0, 1, 2, 3, 4])
    np.testing.assert_array_equal(back.hidden_states(ids), stack.hidden_states(ids))
    assert list(tmp_path.iterdir()) == [path]  # atomic write leaves no temporary behind


def _write_npz(path, config, arrays, **extra):
    np.savez(path, __config__=np.array(config.to_json()), __format__=np.array(1), **arrays, **extra)


@pytest.fixture
def saved(tmp_path):
    stack = make_stack(n_layers=1)
    return stack, tmp_path


def _edit(stack, **changes):
    arrays = stack.weights
    for name, value in changes.items():
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    return arrays


@pytest.mark.parametrize("case, exc, match", [
    ("missing", ValueError, "missing array.*blocks.0.mlp.w_out"),
    ("extra", ValueError, "unexpected array.*stray"),
    ("shape", ValueError, "blocks.0.attn.w_o.*shape"),
    ("nan", ValueError, "blocks.0.norm2.gamma.*NaN"),
    ("int", TypeError, "blocks.0.mlp.b_in.*float32 or float64"),
    ("mixed", TypeError, "blocks.0.attn.w_qkv.*float32"),
    ("no_config", ValueError, "no __config__"),
    ("bad_config", ValueError, "invalid config.*n_heads"),
])
def test_load_rejects_bad_arrays(saved, case, exc, match):
    stack, folder = saved
    path = folder / f"{case}.npz"
    w = stack.weights
    cfg = stack.config
    if case == "missing":
        _write_npz(path, cfg, _edit(stack, **{"blocks.0.mlp.w_out": None}))
    elif case == "extra":
        _write_npz(path, cfg, w, stray=np.zeros(3))
    elif case == "shape":
        _write_npz(path, cfg, _edit(stack, **{"blocks.0.attn.w_o": np.zeros((D, D + 1))}))
    elif case == "nan":
        g = w["blocks.0.norm2.gamma"].copy()
        g[3] = np.nan
        _write_npz(path, cfg, _edit(stack, **{"blocks.0.norm2.gamma": g}))
    elif case == "int":
        _write_npz(path, cfg, _edit(stack, **{"blocks.0.mlp.b_in": np.zeros(D_MLP, np.int64)}))
    elif case == "mixed":
        _write_npz(path, cfg, _edit(stack, **{"blocks.0.attn.w_qkv": w["blocks.0.attn.w_qkv"].astype(np.float32)}))
    elif case == "no_config":
        np.savez(path, **w)
    else:
        bad = json.loads(cfg.to_json()) | {"n_heads": 3}
        np.savez(path, __config__=np.array(json.dumps(bad)), __format__=np.array(1), **w)
    with pytest.raises(exc, match=match) as info:
        Stack.load(path)
    assert case == "mixed" or "weights file" in str(info.value) and str(path) in str(info.value)


def test_load_rejects_damaged_files(saved):
    stack, folder = saved
    good = folder / "good.npz"
    stack.save(good)
    data = good.read_bytes()
    for name, content in (("truncated.npz", data[: len(data) // 2]), ("tail.npz", data[:-40]),
                          ("garbage.npz", b"\x93NUMPY not really" * 10), ("empty.npz", b"")):
        path = folder / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"weights file.*{name}"):
            Stack.load(path)
    # One bit flipped inside an array's data: the zip checksum catches it.
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0x10
    (folder / "flipped.npz").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="flipped.npz"):
        Stack.load(folder / "flipped.npz")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Stack.load(folder / "absent.npz")


def test_load_rejects_a_header_that_lies(saved):
    """An array header promising more data than the entry holds: an error, not a huge allocation."""
    stack, folder = saved
    path = folder / "lies.npz"
    entries = [("__config__", np.array(stack.config.to_json())), ("__format__", np.array(1))]
    entries += list(stack.weights.items())
    target = "blocks.0.mlp.w_in"
    with zipfile.ZipFile(path, "w") as zf:
        for name, arr in entries:
            with zf.open(name + ".npy", "w") as f:
                if name == target:  # the right shape in the header, a quarter of the bytes behind it
                    np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
                    f.write(arr.tobytes()[: arr.nbytes // 4])
                else:
                    np.lib.format.write_array(f, arr)
    with pytest.raises(ValueError, match=f"lies.npz.*{target}"):
        Stack.load(path)
    huge = folder / "huge.npz"
    with zipfile.ZipFile(huge, "w") as zf:
        for name, arr in entries:
            with zf.open(name + ".npy", "w") as f:
                if name == "blocks.0.mlp.b_out":  # header claims 10**12 rows
                    f.write(b"\x93NUMPY\x01\x00")
                    hdr = "{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }"
                    hdr = hdr + " " * (117 - len(hdr)) + "\n"
                    f.write(len(hdr).to_bytes(2, "little") + hdr.encode())
                    f.write(arr.tobytes())
                else:
                    np.lib.format.write_array(f, arr)
    with pytest.raises(ValueError, match="blocks.0.mlp.b_out.*shape"):
        Stack.load(huge)


def test_stack_constructor_checks_weights():
    stack = make_stack(n_layers=1)
    w = stack.weights
    w["blocks.0.attn.b_o"] = np.full(D, np.inf)
    with pytest.raises(ValueError, match=r"weights: array 'blocks.0.attn.b_o' contains NaN or Inf"):
        Stack(stack.config, w)
    with pytest.raises(TypeError, match="config must be a StackConfig"):
        Stack({"d_model": 16}, stack.weights)
    assert not stack.weights["blocks.0.attn.w_o"].flags.writeable  # stored arrays are read-only
    with pytest.raises(ValueError, match="missing array"):  # layout change needs norm2 arrays
        make_stack(n_layers=1, layout="parallel").replace(layout="sequential")


def test_expected_arrays_layouts():
    names = expected_arrays(StackConfig(d_model=8, n_heads=2, n_layers=1, layout="parallel", norm="rmsnorm",
                                        bias=False, positions="none", final_norm=False))
    assert sorted(names) == ["blocks.0.attn.w_o", "blocks.0.attn.w_qkv", "blocks.0.mlp.w_in",
                             "blocks.0.mlp.w_out", "blocks.0.norm1.gamma"]
    assert pe.Stack is Stack and pe.StackConfig is StackConfig and pe.init_weights is init_weights


def test_embed_norm_and_lm_head_config_fields():
    cfg = StackConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=11, embed_norm=True, lm_head="separate")
    assert StackConfig.from_json(cfg.to_json()) == cfg
    names = expected_arrays(cfg)
    assert names["embed.norm.gamma"] == names["embed.norm.beta"] == (16,) and names["lm_head.weight"] == (11, 16)
    rms = expected_arrays(dataclasses.replace(cfg, norm="rmsnorm", lm_head="tied"))
    assert "embed.norm.gamma" in rms and "embed.norm.beta" not in rms and "lm_head.weight" not in rms
    plain = StackConfig(d_model=16, n_heads=2, n_layers=1)
    assert plain.embed_norm is False and plain.lm_head == "none"
    old = json.loads(plain.to_json())  # a config written before the fields existed
    del old["embed_norm"], old["lm_head"]
    assert StackConfig.from_json(json.dumps(old)) == plain
    for change, exc in ((dict(lm_head="tied"), ValueError), (dict(lm_head="big", vocab_size=3), ValueError),
                        (dict(embed_norm=1), TypeError)):
        with pytest.raises(exc, match="lm_head" if "lm_head" in change else "embed_norm"):
            StackConfig(d_model=16, n_heads=2, n_layers=1, **change)


def test_new_arrays_init_save_load_and_astype(tmp_path):
    stack = make_stack(dtype=np.float32, vocab_size=11, embed_norm=True, lm_head="separate")
    W = stack.weights
    assert np.all(W["embed.norm.gamma"] != 0) and abs(W["embed.norm.gamma"].mean() - 1) < 0.3  # gammas, not N(0, .02)
    assert W["lm_head.weight"].shape == (11, D)
    stack.save(tmp_path / "s.npz")
    back = Stack.load(tmp_path / "s.npz")
    ids = np.array([1, 2, 3])
    np.testing.assert_array_equal(back.logits(ids), stack.logits(ids))
    s64 = stack.astype(np.float64)
    assert s64.dtype == np.float64 and s64.config == stack.config
    np.testing.assert_allclose(s64.logits(ids), stack.logits(ids, dtype=np.float64), rtol=1e-12, atol=1e-12)
