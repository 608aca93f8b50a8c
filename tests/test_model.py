"""pyengine.models.stack: stack configs, weights files, forward against a naive implementation,
and the block JVP against central finite differences for every stack variant."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import zipfile

import numpy as np
import pytest

import pyengine as pe
from helpers import import_torch
from pyengine.models import _blocks
from pyengine.models import BlockCache, Stack, StackConfig, expected_arrays, init_weights

D, H, T, D_MLP = 16, 2, 5, 32
#: Central-difference step and the accepted error, relative to the difference's norm.
FD_STEP = 1e-6
FD_RTOL = 1e-7
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu_gated")


# --------------------------------------------------------------------------- naive reference
# Written from the textbook definitions, loop per head, sharing no code with pyengine.


def naive_norm(x, gamma, beta, kind, eps):
    if kind == "layernorm":
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return gamma * (x - mu) / np.sqrt(var + eps) + beta
    return gamma * x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def naive_act(u, name, n):
    if name == "gelu":
        from scipy.special import erfc

        return 0.5 * u * erfc(-u / math.sqrt(2))  # u Phi(u), without 1 + erf cancelling for u << 0
    if name == "gelu_tanh":
        return 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    if name == "relu":
        return np.where(u > 0, u, 0.0)
    gate, up = u[:, :n], u[:, n:]
    with np.errstate(over="ignore"):  # exp(-gate) = inf gives the right limit, -0
        return gate / (1 + np.exp(-gate)) * up


def naive_rope(x, base):
    """Rotate each pair (i, i + dh/2) of x (T, dh) at position t by t * base**(-2i/dh)."""
    out = x.copy()
    n, dh = x.shape
    for t in range(n):
        for i in range(dh // 2):
            a = t * base ** (-2 * i / dh)
            c, s = math.cos(a), math.sin(a)
            out[t, i] = c * x[t, i] - s * x[t, i + dh // 2]
            out[t, i + dh // 2] = s * x[t, i] + c * x[t, i + dh // 2]
    return out


def naive_attention(x, w, c):
    dh, n = c.head_dim, x.shape[0]
    b = (lambda name: w[name]) if c.bias else (lambda name: 0.0)
    qkv = x @ w["attn.w_qkv"] + b("attn.b_qkv")
    heads = []
    for i in range(c.n_heads):
        j = i // (c.n_heads // c.n_kv_heads)  # key/value head of query head i
        q = qkv[:, i * dh : (i + 1) * dh]
        k = qkv[:, (c.n_heads + j) * dh : (c.n_heads + j + 1) * dh]
        v = qkv[:, (c.n_heads + c.n_kv_heads + j) * dh : (c.n_heads + c.n_kv_heads + j + 1) * dh]
        if c.positions == "rotary":
            q, k = naive_rope(q, c.rope_base), naive_rope(k, c.rope_base)
        s = q @ k.T / math.sqrt(dh)
        if c.causal:
            s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        heads.append((p / p.sum(-1, keepdims=True)) @ v)
    return np.concatenate(heads, axis=1) @ w["attn.w_o"] + b("attn.b_o")


def naive_mlp(x, w, c):
    b = (lambda name: w[name]) if c.bias else (lambda name: 0.0)
    return naive_act(x @ w["mlp.w_in"] + b("mlp.b_in"), c.activation, c.d_mlp) @ w["mlp.w_out"] + b("mlp.b_out")


def naive_hidden_states(stack, h0):
    """Residual streams of one sequence h0 (T, d), float64."""
    c, W = stack.config, stack.weights
    n = h0.shape[0]
    h = h0.astype(np.float64)
    if c.positions == "learned":
        h = h + W["embed.positions"][:n]
    elif c.positions == "sinusoidal":
        pe_ = np.zeros((n, c.d_model))
        for t in range(n):
            for f in range(c.d_model):
                angle = t / 10000 ** ((f - f % 2) / c.d_model)
                pe_[t, f] = math.sin(angle) if f % 2 == 0 else math.cos(angle)
        h = h + pe_
    out = [h]
    for k in range(c.n_layers):
        w = {name.split(".", 2)[2]: a.astype(np.float64) for name, a in W.items() if name.startswith(f"blocks.{k}.")}
        gs = c.gamma_scale

        def nrm(x, which, w=w, gs=gs):
            return naive_norm(x, gs * w[which + ".gamma"], w.get(which + ".beta", 0.0), c.norm, c.eps)

        skip = (lambda x: x) if c.residual else (lambda x: 0.0)
        if c.layout == "sequential":
            for f, which in ((naive_attention, "norm1"), (naive_mlp, "norm2")):
                if c.placement == "pre":
                    h = skip(h) + f(nrm(h, which), w, c)
                else:
                    h = nrm(skip(h) + f(h, w, c), which)
        elif c.placement == "pre":
            a = nrm(h, "norm1")
            h = skip(h) + naive_attention(a, w, c) + naive_mlp(a, w, c)
        else:
            h = nrm(skip(h) + naive_attention(h, w, c) + naive_mlp(h, w, c), "norm1")
        out.append(h)
    return np.stack(out)


# --------------------------------------------------------------------------- helpers


def make_stack(dtype=np.float64, seed=0, n_layers=2, scheme="xavier", **kw):
    """A small stack with weights large enough that attention and activations are nonlinear."""
    kw.setdefault("d_mlp", D_MLP)
    cfg = StackConfig(d_model=D, n_heads=H, n_layers=n_layers, max_seq_len=8, **kw)
    return init_weights(cfg, scheme, seed=seed, dtype=dtype, gamma_jitter=0.3, bias_std=0.1)


def stream(shape, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (0.3 + rng.standard_normal(shape)).astype(dtype)


def fd_jvp(stack, k, h, dh, step=FD_STEP):
    return (stack.block_forward(k, h + step * dh) - stack.block_forward(k, h - step * dh)) / (2 * step)


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Every placement x norm x residual x layout x positions; the remaining options rotate
# through the cases so that each activation, GQA and the causal mask meet every axis.
COMBOS = list(itertools.product(("pre", "post"), ("layernorm", "rmsnorm"), (True, False),
                                ("sequential", "parallel"), ("learned", "sinusoidal", "rotary", "none")))


def combo_config(i):
    placement, norm, residual, layout, positions = COMBOS[i]
    return dict(placement=placement, norm=norm, residual=residual, layout=layout, positions=positions,
                activation=ACTIVATIONS[(i + i // 4 + i // 16) % 4], causal=(i + i // 8) % 2 == 0,
                n_kv_heads=1 if (i // 2) % 2 else 2, bias=i % 5 != 0)


def combo_id(i):
    p, n, r, lay, pos = COMBOS[i]
    return f"{p}-{n}-{'res' if r else 'nores'}-{lay}-{pos}"


# --------------------------------------------------------------------------- block JVP


@pytest.mark.parametrize("i", range(len(COMBOS)), ids=combo_id)
def test_block_jvp_matches_finite_differences(i):
    stack = make_stack(**combo_config(i))
    h, dh = stream((T, D)), stream((2, T, D), seed=2)
    jvp = stack.block_jvp(1, h, dh)
    for j in range(2):
        assert rel_err(jvp[j], fd_jvp(stack, 1, h, dh[j])) <= FD_RTOL


def test_combos_cover_every_option():
    seen = {(key, val) for i in range(len(COMBOS)) for key, val in combo_config(i).items()}
    for act in ACTIVATIONS:
        assert ("activation", act) in seen
    assert {("causal", True), ("causal", False), ("n_kv_heads", 1), ("bias", False)} <= seen


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_block_jvp_activations(activation, causal):
    stack = make_stack(activation=activation, causal=causal, n_kv_heads=1, positions="rotary")
    h, dh = stream((T, D), seed=3), stream((T, D), seed=4)
    assert rel_err(stack.block_jvp(0, h, dh), fd_jvp(stack, 0, h, dh)) <= FD_RTOL


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_activations_at_extreme_inputs(activation, dtype):
    """No overflow warnings (they are errors here) and the right limits far from 0."""
    vals = np.array([-1e4, -100.0, -20.0, -5.0, -0.5, 0.0, 0.5, 5.0, 20.0, 100.0, 1e4])
    u = np.stack([vals, vals[::-1]], axis=1).reshape(1, -1).repeat(2, axis=0).astype(dtype)
    n = u.shape[1] // 2
    y = _blocks._act(activation, u, n)
    assert y.dtype == dtype
    ref = naive_act(u.astype(np.float64), activation, n)
    # float64: the naive tanh form loses digits to 1 + tanh(z) cancelling (about 1e-9 at u = -5)
    np.testing.assert_allclose(y, ref, rtol=1e-6 if dtype == np.float32 else 1e-9, atol=1e-30)
    for c in _blocks._act_coef(activation, u, n):
        assert c.dtype == dtype and np.isfinite(c).all()


def _frozen_norm(state):
    """A norm that records each call's scale (s or r) at the base point, then replays them."""

    def norm(kind, x, gamma, beta, eps):
        c = x - x.mean(-1, keepdims=True) if kind == "layernorm" else x
        s = np.sqrt((c * c).mean(-1, keepdims=True) + eps)
        if state["replay"] is not None:
            s = state["scales"][state["replay"]]
            state["replay"] += 1
        else:
            state["scales"].append(s)
        y = gamma * c / s
        return y if beta is None else y + beta

    return norm


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("layout", ["sequential", "parallel"])
@pytest.mark.parametrize("residual", [True, False], ids=["res", "nores"])
def test_block_jvp_frozen_scale(monkeypatch, placement, norm, layout, residual):
    """frozen_scale == finite differences of the block with every norm's scale fixed at h."""
    stack = make_stack(placement=placement, norm=norm, layout=layout, residual=residual, positions="rotary")
    h, dh = stream((T, D), seed=5), stream((T, D), seed=6)
    jvp = stack.block_jvp(0, h, dh, mode="frozen_scale")
    full = stack.block_jvp(0, h, dh, mode="full")
    real = stack.block_forward(0, h)
    state = {"replay": None, "scales": []}
    monkeypatch.setattr(_blocks, "norm", _frozen_norm(state))
    np.testing.assert_allclose(stack.block_forward(0, h), real, rtol=1e-12, atol=1e-12)  # records the scales

    def fwd(x):
        state["replay"] = 0
        return stack.block_forward(0, x)

    fd = (fwd(h + FD_STEP * dh) - fwd(h - FD_STEP * dh)) / (2 * FD_STEP)
    assert rel_err(jvp, fd) <= FD_RTOL
    assert rel_err(jvp, full) > 1e-4  # the modes really differ


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_block_jvp_batched_equals_one_by_one(dtype):
    stack = make_stack(dtype=dtype, n_kv_heads=1, positions="rotary", activation="silu_gated")
    h, dh = stream((T, D), dtype=dtype), stream((4, T, D), seed=7, dtype=dtype)
    out, cache = stack.block_forward(0, h, return_cache=True)
    before = dh.copy()
    batched = stack.block_jvp(0, h, dh, cache=cache)
    np.testing.assert_array_equal(dh, before)  # inputs are never modified
    assert batched.shape == dh.shape and batched.dtype == dtype
    single = np.stack([stack.block_jvp(0, h, v) for v in dh])
    np.testing.assert_allclose(batched, single, rtol=1e-5 if dtype == np.float32 else 1e-13,
                               atol=1e-6 if dtype == np.float32 else 1e-14)
    np.testing.assert_array_equal(out, stack.block_forward(0, h))
    # The cache is reusable: a second call with it gives the same result.
    np.testing.assert_array_equal(stack.block_jvp(0, h, dh, cache=cache), batched)


def test_block_jvp_is_linear():
    stack = make_stack(placement="post", activation="gelu")
    h, u, v = stream((T, D)), stream((T, D), seed=8), stream((T, D), seed=9)
    lhs = stack.block_jvp(1, h, 2.0 * u - 3.0 * v)
    rhs = 2.0 * stack.block_jvp(1, h, u) - 3.0 * stack.block_jvp(1, h, v)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-12, atol=1e-12)


def test_pre_layernorm_block_fixes_ones():
    """DESIGN: every pre-LN residual block maps the all-ones direction to itself exactly."""
    for layout in ("sequential", "parallel"):
        stack = make_stack(layout=layout)
        ones = np.ones((T, D))
        np.testing.assert_allclose(stack.block_jvp(0, stream((T, D)), ones), ones, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- causality


@pytest.mark.parametrize("layout", ["sequential", "parallel"])
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_causal_later_positions_do_not_move_earlier_outputs(layout, placement):
    stack = make_stack(layout=layout, placement=placement, positions="rotary", n_kv_heads=1)
    h = stream((T, D))
    h2 = h.copy()
    h2[-1] += stream((D,), seed=10)
    a, b = stack.hidden_states(h), stack.hidden_states(h2)
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert not np.array_equal(a[1:, -1], b[1:, -1])
    dh = np.zeros((T, D))
    dh[-1] = 1.0
    jvp = stack.block_jvp(0, h, dh)
    np.testing.assert_array_equal(jvp[:-1], 0.0)
    # Without the mask every position sees the last one.
    free = stack.replace(causal=False)
    assert np.abs(free.block_jvp(0, h, dh)[:-1]).min(axis=1).max() > 0


# --------------------------------------------------------------------------- forward


NAMED = {
    "gpt2": dict(positions="learned", activation="gelu_tanh"),
    "llama": dict(norm="rmsnorm", positions="rotary", activation="silu_gated", n_kv_heads=1, bias=False,
                  rope_base=500.0),
    "bert": dict(placement="post", causal=False, activation="gelu"),
    "gptj": dict(layout="parallel", positions="rotary", activation="gelu_tanh"),
    "odd": dict(placement="post", norm="rmsnorm", layout="parallel", residual=False, positions="sinusoidal",
                activation="relu", gamma_scale=0.7, eps=1e-3),
}


@pytest.mark.parametrize("name", NAMED)
def test_hidden_states_match_naive_loop(name):
    stack = make_stack(n_layers=3, scheme="gpt2" if name == "gpt2" else "xavier", **NAMED[name])
    h0 = stream((T, D))
    np.testing.assert_allclose(stack.hidden_states(h0), naive_hidden_states(stack, h0), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_hidden_states_shapes_dtypes_and_batching(dtype):
    stack = make_stack(dtype=np.float32, positions="sinusoidal")
    L = stack.config.n_layers
    hb = stream((3, T, D), dtype=dtype)
    before = hb.copy()
    hs = stack.hidden_states(hb)
    np.testing.assert_array_equal(hb, before)  # inputs are never modified
    assert hs.shape == (L + 1, 3, T, D) and hs.dtype == dtype
    one = stack.hidden_states(hb[1])
    assert one.shape == (L + 1, T, D) and one.dtype == dtype
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(hs[:, 1], one, **tol)
    np.testing.assert_allclose(hs[0], hb + _blocks.sinusoidal_positions(T, D, np.dtype(dtype)), **tol)
    for k in range(L):
        np.testing.assert_allclose(hs[k + 1], stack.block_forward(k, hs[k]), **tol)
    other = np.float64 if dtype == np.float32 else np.float32
    assert stack.hidden_states(hb, dtype=other).dtype == other


def test_float32_forward_close_to_float64():
    stack = make_stack(positions="rotary", activation="gelu")
    h = stream((2, T, D))
    np.testing.assert_allclose(stack.hidden_states(h, dtype=np.float32), stack.hidden_states(h), rtol=1e-4,
                               atol=1e-4)


def test_token_ids_and_embedding():
    stack = make_stack(vocab_size=11, positions="learned")
    ids = np.array([[1, 4, 0, 10, 3], [2, 2, 2, 2, 2]])
    emb = stack.embed(ids)
    assert emb.shape == (2, T, D) and emb.dtype == np.float64
    np.testing.assert_array_equal(stack.hidden_states(ids), stack.hidden_states(emb))
    assert stack.hidden_states(ids[0], dtype=np.float32).shape == (3, T, D)
    with pytest.raises(ValueError, match="vocab_size = 11"):
        stack.embed(np.array([0, 11]))
    with pytest.raises(ValueError, match="no token embedding"):
        make_stack().embed(np.array([0]))


def test_gamma_scale_is_a_runtime_multiplier():
    stack = make_stack(norm="rmsnorm", placement="post", final_norm=True)
    scaled = stack.replace(gamma_scale=2.5)
    by_hand = Stack(stack.config, {n: a * 2.5 if n.endswith(".gamma") else a for n, a in stack.weights.items()})
    h = stream((T, D))
    np.testing.assert_allclose(scaled.hidden_states(h), by_hand.hidden_states(h), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(scaled.apply_final_norm(h), by_hand.apply_final_norm(h), rtol=1e-13)
    assert stack.weights.keys() == scaled.weights.keys()


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


# --------------------------------------------------------------------------- bad calls


def test_bad_calls_raise_clear_errors():
    stack = make_stack(positions="learned")
    h = stream((T, D))
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 2\)"
                       r" \(a block index; negative counts from the end\); got 2"):
        stack.block_forward(2, h)
    with pytest.raises(ValueError, match=r"h must have shape \(T, 16\)"):
        stack.block_forward(0, h[:, :8])
    with pytest.raises(TypeError, match="float32 or float64"):
        stack.hidden_states(h.astype(np.float16))
    with pytest.raises(ValueError, match="input_ids contains NaN"):
        stack.hidden_states(np.where(np.eye(T, D) > 0, np.nan, h))
    with pytest.raises(ValueError, match="max_seq_len = 8"):
        stack.hidden_states(stream((9, D)))
    with pytest.raises(ValueError, match="mode must be"):
        stack.block_jvp(0, h, h, mode="half")
    with pytest.raises(ValueError, match="dh must have shape"):
        stack.block_jvp(0, h, h[:3])
    with pytest.raises(ValueError, match="dh contains NaN"):
        stack.block_jvp(0, h, np.full((T, D), np.nan))
    with pytest.raises(ValueError, match=r"h must have shape \(T, d_model\)"):
        stack.block_jvp(0, h[None], h)
    _, cache = stack.block_forward(0, h, return_cache=True)
    assert isinstance(cache, BlockCache)
    with pytest.raises(ValueError, match="cache belongs to block 0 of this stack"):
        stack.block_jvp(1, h, h, cache=cache)
    with pytest.raises(ValueError, match="another stack"):
        stack.replace(causal=False).block_jvp(0, h, h, cache=cache)
    with pytest.raises(TypeError, match="cache must be a BlockCache"):
        stack.block_jvp(0, h, h, cache={})
    with pytest.raises(ValueError, match="dh must have shape"):
        stack.block_jvp(0, h, np.float64(1.0))
    with pytest.raises(ValueError, match="different h"):
        stack.block_jvp(0, h + 1, h, cache=cache)
    with pytest.raises(ValueError, match="different h"):
        stack.block_jvp(0, h.astype(np.float32), h, cache=cache)
    with pytest.raises(ValueError, match="return_cache needs h of shape"):
        stack.block_forward(0, h[None], return_cache=True)
    with pytest.raises(ValueError, match="no final norm"):
        make_stack(final_norm=False).apply_final_norm(h)
    # nothing was modified
    np.testing.assert_array_equal(h, stream((T, D)))


def test_expected_arrays_layouts():
    names = expected_arrays(StackConfig(d_model=8, n_heads=2, n_layers=1, layout="parallel", norm="rmsnorm",
                                        bias=False, positions="none", final_norm=False))
    assert sorted(names) == ["blocks.0.attn.w_o", "blocks.0.attn.w_qkv", "blocks.0.mlp.w_in",
                             "blocks.0.mlp.w_out", "blocks.0.norm1.gamma"]
    assert pe.Stack is Stack and pe.StackConfig is StackConfig and pe.init_weights is init_weights


# --------------------------------------------------------------------------- embedding norm and LM head


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


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_embed_norm_normalizes_the_embedding_output(norm):
    stack = make_stack(vocab_size=11, embed_norm=True, norm=norm, gamma_scale=0.7)
    W, c = stack.weights, stack.config
    ids = np.array([[1, 4, 9], [3, 3, 0]])
    h0 = naive_norm(W["embed.tokens"][ids] + W["embed.positions"][:3], 0.7 * W["embed.norm.gamma"],
                    W.get("embed.norm.beta", 0.0), norm, c.eps)
    hs = stack.hidden_states(ids)
    np.testing.assert_allclose(hs[0], h0, rtol=1e-13, atol=1e-13)
    # the blocks then run on the normalized stream as usual
    blocks_only = Stack(dataclasses.replace(c, positions="none", embed_norm=False, vocab_size=0),
                        {n: a for n, a in W.items() if n.startswith(("blocks.", "final_norm."))})
    np.testing.assert_allclose(hs[1:], blocks_only.hidden_states(h0)[1:], rtol=1e-12, atol=1e-12)
    # float input is treated like token embeddings: positions, then the norm
    np.testing.assert_allclose(stack.hidden_states(stack.embed(ids)), hs, rtol=0, atol=0)


@pytest.mark.parametrize("head", ["tied", "separate"])
@pytest.mark.parametrize("final_norm", [True, False])
def test_logits(head, final_norm):
    stack = make_stack(vocab_size=11, lm_head=head, final_norm=final_norm)
    W = stack.weights
    ids = np.array([[1, 4, 9], [3, 3, 0]])
    last = stack.hidden_states(ids)[-1]
    read = stack.apply_final_norm(last) if final_norm else last
    want = read @ (W["lm_head.weight"] if head == "separate" else W["embed.tokens"]).T
    np.testing.assert_allclose(stack.logits(ids), want, rtol=1e-12, atol=1e-12)
    assert stack.logits(ids[0]).shape == (3, 11)
    np.testing.assert_allclose(stack.logits(last), want, rtol=1e-12, atol=1e-12)  # logit lens on a stream
    l32 = stack.logits(last[0, 0].astype(np.float32))
    assert l32.shape == (11,) and l32.dtype == np.float32
    assert stack.logits(ids, dtype=np.float32).dtype == np.float32
    with pytest.raises(ValueError, match="no language-model head"):
        make_stack(vocab_size=11).logits(ids)
    with pytest.raises(ValueError, match="input_ids must have shape"):
        stack.logits(np.zeros((3, D + 1)))


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


# --------------------------------------------------------------------------- PyTorch (optional)


def torch_hidden_states(torch, stack, x):
    """Hidden states of ``stack`` on x (T, d) from torch.nn.functional primitives, float64."""
    F = torch.nn.functional
    c, W = stack.config, {n: torch.from_numpy(np.array(a)) for n, a in stack.weights.items()}
    n, dh = x.shape[0], c.head_dim

    def bias(name):
        return W[name] if c.bias else 0

    def nrm(h, name):
        g = c.gamma_scale * W[name + ".gamma"]
        if c.norm == "layernorm":
            return F.layer_norm(h, (c.d_model,), g, W[name + ".beta"], c.eps)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c.eps) * g

    def rope(t):  # (heads, T, dh), half-split (HF rotate_half)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * c.rope_base ** (
            -torch.arange(0, dh, 2, dtype=torch.float64) / dh)
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        return t * cos + torch.cat([-t[..., dh // 2:], t[..., : dh // 2]], -1) * sin

    def attn(a, p):
        qkv = a @ W[p + "attn.w_qkv"] + bias(p + "attn.b_qkv")
        q, k, v = qkv.split([c.n_heads * dh, c.n_kv_heads * dh, c.n_kv_heads * dh], -1)
        q, k, v = (t.reshape(n, -1, dh).transpose(0, 1) for t in (q, k, v))
        k, v = (t.repeat_interleave(c.n_heads // c.n_kv_heads, 0) for t in (k, v))
        if c.positions == "rotary":
            q, k = rope(q), rope(k)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=c.causal)
        return o.transpose(0, 1).reshape(n, -1) @ W[p + "attn.w_o"] + bias(p + "attn.b_o")

    def mlp(a, p):
        u = a @ W[p + "mlp.w_in"] + bias(p + "mlp.b_in")
        z = F.silu(u[:, : c.d_mlp]) * u[:, c.d_mlp:] if c.activation == "silu_gated" else F.gelu(u)
        return z @ W[p + "mlp.w_out"] + bias(p + "mlp.b_out")

    h = torch.from_numpy(x)
    if c.positions == "learned":
        h = h + W["embed.positions"][:n]
    out = [h]
    for k in range(c.n_layers):
        p = f"blocks.{k}."
        for f, name in ((attn, "norm1"), (mlp, "norm2")):
            h = h + f(nrm(h, p + name), p) if c.placement == "pre" else nrm(h + f(h, p), p + name)
        out.append(h)
    return torch.stack(out).numpy()


@pytest.mark.parametrize("kw", [
    dict(norm="layernorm", placement="post", causal=False, positions="learned", activation="gelu"),
    dict(norm="rmsnorm", placement="pre", causal=True, positions="rotary", activation="silu_gated",
         n_kv_heads=1, bias=False),
], ids=["bert-like", "llama-like"])
def test_hidden_states_match_pytorch(kw):
    """A small stack against torch.nn.functional (torch is a test-only dependency; CI requires it)."""
    torch = import_torch()
    stack = make_stack(**kw)
    x = stream((T, D))
    np.testing.assert_allclose(stack.hidden_states(x), torch_hidden_states(torch, stack, x), rtol=1e-10, atol=1e-10)
