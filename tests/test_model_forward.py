"""pyengine.models.stack forward: hidden states against a naive loop written from the
textbook definitions and against torch.nn.functional, the activations far from 0, token
embeddings, the embedding norm and the language-model head."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from helpers import import_torch
from pyengine.models import _blocks
from pyengine.models import Stack
from test_model import ACTIVATIONS, D, T, make_stack, stream


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


# --------------------------------------------------------------------------- embedding norm and LM head


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
