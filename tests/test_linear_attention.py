"""The compiled attention-JVP head products ``linear_attention_jvp`` and their use.

The kernel against the formula in float64 NumPy (float32 and float64, grouped-query heads,
odd sizes, a causal span from ``start``, more tangents than one task's chunk, row blocks of
more than 16 query rows over the keys they see), bad
input naming the argument, -1 on the forced numpy.matmul fallback, and the block JVP
through it against the block JVP through the numpy products (learned and rotary
positions, whole sequences and spans), float64 unchanged bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require
from helpers import assert_close
from pyengine.kernels import linear as L


def _core():
    require("cpp")
    from pyengine import _core

    return _core


def _softmax_rows(s, start):
    tq, tk = s.shape[-2:]
    mask = np.arange(tk)[None, :] > start + np.arange(tq)[:, None]
    s = np.where(mask, -np.inf, s)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _case(K, tq, start, Hkv, g, dh, dtype, seed=0):
    rng = np.random.default_rng(seed)
    H, tk = Hkv * g, start + tq
    dqkv = rng.standard_normal((K, tq, H + 2 * Hkv, dh)).astype(dtype)
    q = rng.standard_normal((Hkv, g, tq, dh)).astype(dtype)
    k = rng.standard_normal((Hkv, tk, dh)).astype(dtype)
    v = rng.standard_normal((Hkv, tk, dh)).astype(dtype)
    p = _softmax_rows(np.einsum("jgtd,jsd->jgts", q, k), start).astype(dtype)
    return dqkv, q, k, v, p


def _reference(dqkv, q, k, v, p, start, scale):
    """The formula of the kernel's docstring, in float64."""
    dqkv, q, k, v, p = (a.astype(np.float64) for a in (dqkv, q, k, v, p))
    K, tq, _, dh = dqkv.shape
    Hkv, g = q.shape[:2]
    H = Hkv * g
    out = np.empty((K, tq, H, dh))
    for r in range(K):
        for h in range(H):
            j = h // g
            dq, dk, dv = dqkv[r, :, h], dqkv[r, :, H + j], dqkv[r, :, H + Hkv + j]
            ph = p[j, h % g]
            ds = scale * dq @ k[j].T
            ds[:, start:] += q[j, h % g] @ dk.T
            dp = ph * (ds - (ph * ds).sum(axis=1, keepdims=True))
            out[r, :, h] = dp @ v[j] + ph[:, start:] @ dv
    return out


@pytest.mark.parametrize("dims", [(1, 1, 0, 1, 1, 1), (3, 5, 0, 2, 3, 8), (5, 7, 4, 1, 2, 5), (70, 9, 3, 2, 1, 4),
                                  (2, 130, 0, 1, 2, 16), (4, 40, 7, 2, 2, 8), (3, 17, 2, 1, 1, 4)],
                         ids=lambda d: "K%d-tq%d-s%d-Hkv%d-g%d-dh%d" % d)
@pytest.mark.parametrize("mask", ["causal", "none", "zeros"])
def test_linear_attention_jvp_matches_the_formula(dtype, dims, mask):
    """Row blocks (tq > 16) multiply only the keys with P != 0 in some row of the block: causal
    probabilities, probabilities without a zero, and zeros where a key is visible (underflow)."""
    core = _core()
    K, tq, start, Hkv, g, dh = dims
    dqkv, q, k, v, p = _case(K, tq, start, Hkv, g, dh, dtype)
    if mask == "none":
        p = _softmax_rows(np.einsum("jgtd,jsd->jgts", q, k), start + tq).astype(dtype)
    elif mask == "zeros":
        p[..., : min(3, tq), 0] = 0  # the first key of the first rows: visible, with P = 0
        p[..., 16:32, :] = 0  # a whole row block without a visible key (tq > 32): its tangent is 0
    before = [a.copy() for a in (dqkv, q, k, v, p)]
    out = np.full((K, tq, Hkv * g, dh), np.nan, dtype)
    scale = 1.0 / np.sqrt(dh)
    nbad = core.linear_attention_jvp(dqkv, q, k, v, p, start, scale, out)
    if nbad < 0:
        pytest.fail(f"the BLAS path is off: {core.linear_blas_info()}")
    assert nbad == 0
    ref = _reference(dqkv, q, k, v, p, start, scale)
    assert_close(out, ref, dtype)
    for a, b in zip((dqkv, q, k, v, p), before):  # inputs untouched
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tq", [4, 40])
def test_linear_attention_jvp_counts_bad_rows(tq):
    core = _core()
    dqkv, q, k, v, p = _case(3, tq, 0, 1, 2, 8, np.float32)
    dqkv[1, 2, 0, 3] = np.nan  # query head 0 of tangent 1, row 2: one bad row
    out = np.empty((3, tq, 2, 8), np.float32)
    assert core.linear_attention_jvp(dqkv, q, k, v, p, 0, 1.0, out) == 1
    assert np.isnan(out[1, 2, 0]).all() and np.isfinite(np.delete(out[1, :, 0], 2, axis=0)).all()


def test_linear_attention_jvp_bad_input_names_the_argument():
    core = _core()
    dqkv, q, k, v, p = _case(2, 4, 1, 1, 2, 8, np.float32)
    out = np.empty((2, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="dqkv"):
        core.linear_attention_jvp(dqkv[:, :3].copy(), q, k, v, p, 1, 1.0, out)
    with pytest.raises(ValueError, match="^k"):
        core.linear_attention_jvp(dqkv, q, k[:, 1:].copy(), v, p, 1, 1.0, out)
    with pytest.raises(ValueError, match="^v"):
        core.linear_attention_jvp(dqkv, q, k, v[:, :, 1:].copy(), p, 1, 1.0, out)
    with pytest.raises(ValueError, match="^p"):
        core.linear_attention_jvp(dqkv, q, k, v, p[..., 1:].copy(), 1, 1.0, out)
    with pytest.raises(ValueError, match="out"):
        core.linear_attention_jvp(dqkv, q, k, v, p, 1, 1.0, out[:1].copy())
    with pytest.raises(ValueError, match="start"):
        core.linear_attention_jvp(dqkv, q, k, v, p, -1, 1.0, out)
    with pytest.raises(ValueError, match="q must be 4-D"):
        core.linear_attention_jvp(dqkv, q[0], k, v, p, 1, 1.0, out)
    with pytest.raises(ValueError, match="out must not overlap dqkv"):
        core.linear_attention_jvp(dqkv, q, k, v, p, 1, 1.0, dqkv.reshape(-1)[: out.size].reshape(out.shape))
    with pytest.raises(TypeError):
        core.linear_attention_jvp(dqkv.astype(np.float64), q, k, v, p, 1, 1.0, out)


def test_linear_attention_jvp_off_on_the_fallback():
    core = _core()
    dqkv, q, k, v, p = _case(2, 4, 0, 1, 1, 8, np.float32)
    out = np.empty((2, 4, 1, 8), np.float32)
    core.linear_force_fallback(True)
    try:
        assert core.linear_attention_jvp(dqkv, q, k, v, p, 0, 1.0, out) == -1
    finally:
        core.linear_force_fallback(False)
    assert L.attention_jvp_kernel() is core.linear_attention_jvp


def test_attention_jvp_kernel_follows_the_default_backend():
    _core()
    from pyengine import backends

    with backends.use_backend("numpy"):
        assert L.attention_jvp_kernel() is None
    with backends.use_backend("numba"):
        assert L.attention_jvp_kernel() is None


@pytest.mark.parametrize("positions", ["learned", "rotary"])
@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("T", [12, 40])
def test_block_jvp_through_the_kernel_matches_the_numpy_products(positions, start, T, monkeypatch):
    _core()
    import pyengine as pe
    from pyengine.models import _fast

    K = 3
    cfg = pe.StackConfig(d_model=32, n_heads=4, n_kv_heads=2 if positions == "rotary" else 4, d_mlp=64, n_layers=2,
                         vocab_size=50, activation="gelu_tanh", positions=positions, max_seq_len=T)
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float64):
        stack = pe.init_weights(cfg, "gpt2", seed=0, dtype=dtype, bias_std=0.02)
        h1 = stack.hidden_states(rng.integers(0, 50, T))[1]
        tang = rng.standard_normal((K, T - start, 32)).astype(dtype)
        t0 = tang.copy()
        _, cache = stack.block_forward(1, h1, return_cache=True)
        calls = []
        real = _fast.attention_jvp_kernel

        def spy():
            fn = real()
            calls.append(fn)
            return fn

        monkeypatch.setattr(_fast, "attention_jvp_kernel", spy)
        got = stack.block_jvp(1, h1, tang, cache=cache, start=start)
        monkeypatch.setattr(_fast, "attention_jvp_kernel", lambda: None)
        want = stack.block_jvp(1, h1, tang, cache=cache, start=start)
        np.testing.assert_array_equal(tang, t0)
        if dtype == np.float64:  # float64 keeps the numpy products: bit for bit, kernel never asked
            assert calls == []
            np.testing.assert_array_equal(got, want)
        else:
            assert calls and calls[0] is not None
            assert_close(got, want, dtype)


def _forward_reference(qkv, kp, vp, H, offset, scale):
    """softmax(scale q k^T, keys j <= offset + t) v in float64, past keys first."""
    qkv, kp, vp = (a.astype(np.float64) for a in (qkv, kp, vp))
    B, tq, _, dh = qkv.shape
    Hkv, s = kp.shape[:2]
    g = H // Hkv
    out = np.empty((B, tq, H, dh))
    for b in range(B):
        for h in range(H):
            j = h // g
            kk = np.concatenate([kp[j], qkv[b, :, H + j]])
            vv = np.concatenate([vp[j], qkv[b, :, H + Hkv + j]])
            sc = scale * qkv[b, :, h] @ kk.T
            sc[np.arange(s + tq)[None, :] > offset + np.arange(tq)[:, None]] = -np.inf
            e = np.exp(sc - sc.max(axis=1, keepdims=True))
            out[b, :, h] = (e / e.sum(axis=1, keepdims=True)) @ vv
    return out


@pytest.mark.parametrize("dims", [(1, 1, 0, 1, 1, 1), (3, 5, 0, 2, 3, 8), (5, 7, 4, 1, 2, 5), (2, 9, 3, 2, 1, 4),
                                  (2, 130, 0, 1, 2, 16), (2, 40, 6, 2, 2, 8), (3, 17, 0, 1, 1, 4),
                                  (2, 33, 11, 1, 2, 8)],
                         ids=lambda d: "B%d-tq%d-s%d-Hkv%d-g%d-dh%d" % d)
@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_forward_matches_the_formula(dtype, dims, causal):
    core = _core()
    B, tq, s, Hkv, g, dh = dims
    rng = np.random.default_rng(2)
    H = Hkv * g
    qkv = rng.standard_normal((B, tq, H + 2 * Hkv, dh)).astype(dtype)
    kp, vp = (rng.standard_normal((Hkv, s, dh)).astype(dtype) for _ in range(2))
    before = [a.copy() for a in (qkv, kp, vp)]
    offset = s if causal else s + tq - 1
    out = np.full((B, tq, H, dh), np.nan, dtype)
    nbad = core.linear_attention_forward(qkv, kp, vp, H, offset, 1.0 / np.sqrt(dh), out)
    if nbad < 0:
        pytest.fail(f"the BLAS path is off: {core.linear_blas_info()}")
    assert nbad == 0
    assert_close(out, _forward_reference(qkv, kp, vp, H, offset, 1.0 / np.sqrt(dh)), dtype)
    for a, b in zip((qkv, kp, vp), before):
        np.testing.assert_array_equal(a, b)
    # a sequence's result does not depend on the others in the batch
    one = np.empty((1, tq, H, dh), dtype)
    core.linear_attention_forward(qkv[-1:].copy(), kp, vp, H, offset, 1.0 / np.sqrt(dh), one)
    np.testing.assert_array_equal(one[0], out[-1])


def test_linear_attention_forward_bad_rows_and_input():
    core = _core()
    qkv = np.random.default_rng(3).standard_normal((2, 4, 4, 8)).astype(np.float32)  # H = 2, Hkv = 1
    kp = vp = np.zeros((1, 0, 8), np.float32)
    out = np.empty((2, 4, 2, 8), np.float32)
    bad = qkv.copy()
    bad[1, 2, 0, 0] = np.inf  # query head 0 of sequence 1, row 2
    assert core.linear_attention_forward(bad, kp, vp, 2, 0, 1.0, out) == 1
    with pytest.raises(ValueError, match="n_heads"):
        core.linear_attention_forward(qkv, kp, vp, 0, 0, 1.0, out)
    with pytest.raises(ValueError, match="qkv"):
        core.linear_attention_forward(qkv[:, :, :3].copy(), kp, vp, 2, 0, 1.0, out)
    with pytest.raises(ValueError, match="^vp"):
        core.linear_attention_forward(qkv, kp, np.zeros((1, 1, 8), np.float32), 2, 0, 1.0, out)
    with pytest.raises(ValueError, match="kp must be 3-D"):
        core.linear_attention_forward(qkv, kp[0], vp, 2, 0, 1.0, out)
    with pytest.raises(ValueError, match="out"):
        core.linear_attention_forward(qkv, kp, vp, 2, 0, 1.0, out[:1].copy())
    with pytest.raises(ValueError, match="offset"):
        core.linear_attention_forward(qkv, kp, vp, 2, -1, 1.0, out)
    core.linear_force_fallback(True)
    try:
        assert core.linear_attention_forward(qkv, kp, vp, 2, 0, 1.0, out) == -1
    finally:
        core.linear_force_fallback(False)
    assert L.attention_forward_kernel() is core.linear_attention_forward


@pytest.mark.parametrize("offset", [0, 39], ids=["causal", "all-keys"])
def test_linear_attention_forward_row_blocks_count_bad_rows(offset):
    """40 query rows (row blocks of 16): an Inf query makes its own row bad and NaN, no other."""
    core = _core()
    qkv = np.random.default_rng(4).standard_normal((2, 40, 4, 8)).astype(np.float32)  # H = 2, Hkv = 1
    kp = vp = np.zeros((1, 0, 8), np.float32)
    qkv[1, 20, 0, 0] = np.inf  # query head 0 of sequence 1, row 20 (the second block)
    out = np.empty((2, 40, 2, 8), np.float32)
    assert core.linear_attention_forward(qkv, kp, vp, 2, offset, 1.0, out) == 1
    assert np.isnan(out[1, 20, 0]).all()
    assert np.isfinite(np.delete(out[1, :, 0], 20, axis=0)).all() and np.isfinite(out[0]).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [12, 40])
def test_forward_through_the_kernel_matches_the_streaming_head(causal, T, monkeypatch):
    """Stack forwards (whole, with a past span, with a cache) against the attention_forward path."""
    _core()
    import pyengine as pe
    from pyengine.models import _fast

    cfg = pe.StackConfig(d_model=32, n_heads=4, n_kv_heads=2, d_mlp=64, n_layers=2, vocab_size=50,
                         activation="gelu_tanh", positions="learned", max_seq_len=T, causal=causal)
    stack = pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)
    rng = np.random.default_rng(5)
    h = rng.standard_normal((3, T, 32)).astype(np.float32)
    _, cache = stack.block_forward(1, h[0], return_cache=True)

    def run():
        out = [stack.hidden_states(h), stack.block_forward(1, h[0], return_cache=True)[0]]
        if causal:
            out.append(stack.block_forward(1, h[:, 5:], past=cache))
        return out

    calls = []
    real = _fast.attention_forward_kernel
    monkeypatch.setattr(_fast, "attention_forward_kernel", lambda: calls.append(1) or real())
    got = run()
    monkeypatch.setattr(_fast, "attention_forward_kernel", lambda: None)
    want = run()
    assert calls
    for a, b in zip(got, want):
        assert_close(a, b, np.float32)
