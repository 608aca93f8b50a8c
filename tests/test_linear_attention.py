"""The block engine's attention heads ``linear_attention_forward`` and ``linear_attention_jvp``.

The reference (:mod:`pyengine.kernels._reference.linear_attention`) against the fused head
per head and against finite differences of the forward; every backend against the
reference (float32 and float64, grouped-query heads, one token, odd sizes, past keys and
a causal span from ``start``, more tangents than one task's chunk, row blocks of more than
16 query rows over the keys they see), bad rows; the compiled kernels' bad input naming the
argument and -1 on the forced numpy.matmul fallback; and the block JVP and forward through
them against the numpy products (learned and rotary positions, whole sequences and spans),
float64 unchanged bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require
from helpers import assert_close
from pyengine import backends
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


def _run(backend, name, *args):
    """The kernel's bad-row count; a compiled kernel whose BLAS path is off fails the test."""
    nbad = backends.resolve(name, backend)(*args)
    if nbad < 0:
        pytest.fail(f"{backend} {name}: the BLAS path is off: {L.blas_info()}")
    return nbad


def _forward_case(B, tq, s, Hkv, g, dh, dtype, seed=2):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, tq, Hkv * g + 2 * Hkv, dh)).astype(dtype)
    kp, vp = (rng.standard_normal((Hkv, s, dh)).astype(dtype) for _ in range(2))
    return qkv, kp, vp


FORWARD_DIMS = [(1, 1, 0, 1, 1, 1), (3, 5, 0, 2, 3, 8), (5, 7, 4, 1, 2, 5), (2, 9, 3, 2, 1, 4), (2, 130, 0, 1, 2, 16),
                (2, 40, 6, 2, 2, 8), (3, 17, 0, 1, 1, 4), (2, 33, 11, 1, 2, 8), (1, 1, 5, 1, 3, 8)]
JVP_DIMS = [(1, 1, 0, 1, 1, 1), (3, 5, 0, 2, 3, 8), (5, 7, 4, 1, 2, 5), (70, 9, 3, 2, 1, 4), (2, 130, 0, 1, 2, 16),
            (4, 40, 7, 2, 2, 8), (3, 17, 2, 1, 1, 4), (2, 1, 6, 1, 2, 8)]


def test_the_forward_reference_is_the_fused_head_per_head():
    """Each (sequence, head) of the reference is the fused head's reference on the past keys then the new ones."""
    B, tq, s, Hkv, g, dh = 2, 7, 3, 2, 2, 5
    H = Hkv * g
    qkv, kp, vp = _forward_case(B, tq, s, Hkv, g, dh, np.float64)
    out = np.empty((B, tq, H, dh))
    assert backends.resolve("linear_attention_forward", "numpy")(qkv, kp, vp, H, s, 0.4, out) == 0
    head = backends.resolve("attention_forward", "numpy")
    for b in range(B):
        for h in range(H):
            j = h // g
            k = np.concatenate([kp[j], qkv[b, :, H + j]])[None]
            v = np.concatenate([vp[j], qkv[b, :, H + Hkv + j]])[None]
            want, lse, ent = np.empty((1, tq, dh)), np.empty((1, tq)), np.empty((1, tq))
            head(np.ascontiguousarray(qkv[b, :, h])[None], k, v, s, 0.4, want, lse, ent)
            np.testing.assert_allclose(out[b, :, h], want[0], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("start", [0, 4])
def test_the_jvp_reference_is_the_derivative_of_the_forward(start):
    """Central differences of the forward (past keys fixed, the tangent moving the tq new rows)."""
    tq, Hkv, g, dh, K = 6, 2, 2, 4, 2
    H, scale = Hkv * g, 1.0 / np.sqrt(dh)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, start + tq, H + 2 * Hkv, dh))
    dx = rng.standard_normal((K, tq, H + 2 * Hkv, dh))
    kp, vp = (np.ascontiguousarray(x[0, :start, H + o : H + o + Hkv].transpose(1, 0, 2)) for o in (0, Hkv))
    fwd = backends.resolve("linear_attention_forward", "numpy")

    def f(qkv):
        out = np.empty((qkv.shape[0], tq, H, dh))
        assert fwd(qkv, kp, vp, H, start, scale, out) == 0
        return out

    base = x[:, start:]
    eps = 1e-6
    want = (f(base + eps * dx) - f(base - eps * dx)) / (2 * eps)
    q = np.ascontiguousarray(scale * base[0, :, :H].transpose(1, 0, 2)).reshape(Hkv, g, tq, dh)
    k, v = (np.ascontiguousarray(x[0, :, H + o : H + o + Hkv].transpose(1, 0, 2)) for o in (0, Hkv))
    p = _softmax_rows(np.einsum("jgtd,jsd->jgts", q, k), start)
    got = np.empty((K, tq, H, dh))
    assert backends.resolve("linear_attention_jvp", "numpy")(dx, q, k, v, p, start, scale, got) == 0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dims", JVP_DIMS, ids=lambda d: "K%d-tq%d-s%d-Hkv%d-g%d-dh%d" % d)
@pytest.mark.parametrize("mask", ["causal", "none", "zeros"])
def test_linear_attention_jvp_matches_the_reference(backend, dtype, dims, mask):
    """Row blocks (tq > 16) multiply only the keys with P != 0 in some row of the block: causal
    probabilities, probabilities without a zero, and zeros where a key is visible (underflow)."""
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
    assert _run(backend, "linear_attention_jvp", dqkv, q, k, v, p, start, scale, out) == 0
    ref = np.empty((K, tq, Hkv * g, dh))
    backends.resolve("linear_attention_jvp", "numpy")(*before, start, scale, ref)
    assert_close(out, ref, dtype)
    for a, b in zip((dqkv, q, k, v, p), before):  # inputs untouched
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tq", [4, 40])
def test_linear_attention_jvp_counts_bad_rows(backend, tq):
    dqkv, q, k, v, p = _case(3, tq, 0, 1, 2, 8, np.float32)
    dqkv[1, 2, 0, 3] = np.nan  # query head 0 of tangent 1, row 2: one bad row
    out = np.empty((3, tq, 2, 8), np.float32)
    assert _run(backend, "linear_attention_jvp", dqkv, q, k, v, p, 0, 1.0, out) == 1
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
        assert L.attention_jvp_kernel() is None and L.attention_forward_kernel() is None  # the block engine's numpy path
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


@pytest.mark.parametrize("dims", FORWARD_DIMS, ids=lambda d: "B%d-tq%d-s%d-Hkv%d-g%d-dh%d" % d)
@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_forward_matches_the_reference(backend, dtype, dims, causal):
    B, tq, s, Hkv, g, dh = dims
    H = Hkv * g
    qkv, kp, vp = _forward_case(B, tq, s, Hkv, g, dh, dtype)
    before = [a.copy() for a in (qkv, kp, vp)]
    offset = s if causal else s + tq - 1
    out = np.full((B, tq, H, dh), np.nan, dtype)
    assert _run(backend, "linear_attention_forward", qkv, kp, vp, H, offset, 1.0 / np.sqrt(dh), out) == 0
    ref = np.empty((B, tq, H, dh))
    backends.resolve("linear_attention_forward", "numpy")(*before, H, offset, 1.0 / np.sqrt(dh), ref)
    assert_close(out, ref, dtype)
    for a, b in zip((qkv, kp, vp), before):
        np.testing.assert_array_equal(a, b)
    # a sequence's result does not depend on the others in the batch
    one = np.empty((1, tq, H, dh), dtype)
    _run(backend, "linear_attention_forward", qkv[-1:].copy(), kp, vp, H, offset, 1.0 / np.sqrt(dh), one)
    np.testing.assert_array_equal(one[0], out[-1])


def test_linear_attention_forward_counts_bad_rows(backend):
    qkv = np.random.default_rng(3).standard_normal((2, 4, 4, 8)).astype(np.float32)  # H = 2, Hkv = 1
    kp = vp = np.zeros((1, 0, 8), np.float32)
    out = np.empty((2, 4, 2, 8), np.float32)
    qkv[1, 2, 0, 0] = np.inf  # query head 0 of sequence 1, row 2
    assert _run(backend, "linear_attention_forward", qkv, kp, vp, 2, 0, 1.0, out) == 1
    assert np.isnan(out[1, 2, 0]).all() and np.isfinite(np.delete(out[1, :, 0], 2, axis=0)).all()


def test_linear_attention_forward_bad_input_names_the_argument():
    core = _core()
    qkv = np.random.default_rng(3).standard_normal((2, 4, 4, 8)).astype(np.float32)  # H = 2, Hkv = 1
    kp = vp = np.zeros((1, 0, 8), np.float32)
    out = np.empty((2, 4, 2, 8), np.float32)
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
def test_linear_attention_forward_row_blocks_count_bad_rows(backend, offset):
    """40 query rows (row blocks of 16): an Inf query makes its own row bad and NaN, no other."""
    qkv = np.random.default_rng(4).standard_normal((2, 40, 4, 8)).astype(np.float32)  # H = 2, Hkv = 1
    kp = vp = np.zeros((1, 0, 8), np.float32)
    qkv[1, 20, 0, 0] = np.inf  # query head 0 of sequence 1, row 20 (the second block)
    out = np.empty((2, 40, 2, 8), np.float32)
    assert _run(backend, "linear_attention_forward", qkv, kp, vp, 2, offset, 1.0, out) == 1
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


def test_forced_fallback_takes_the_gemm_path_once(monkeypatch):
    """Without the BLAS path the rotary JVP is the head-major GEMMs' result exactly: the tangents
    are rotated once (the path is chosen before any kernel writes the workspace)."""
    core = _core()
    import pyengine as pe
    from pyengine.models import _fast

    cfg = pe.StackConfig(d_model=32, n_heads=4, n_kv_heads=2, d_mlp=64, n_layers=2, vocab_size=50,
                         activation="gelu_tanh", positions="rotary", max_seq_len=12)
    stack = pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)
    rng = np.random.default_rng(1)
    h1 = stack.hidden_states(rng.integers(0, 50, 12))[1]
    tang = rng.standard_normal((3, 12, 32)).astype(np.float32)
    _, cache = stack.block_forward(1, h1, return_cache=True)
    core.linear_force_fallback(True)
    try:
        got = stack.block_jvp(1, h1, tang, cache=cache)
        with monkeypatch.context() as m:
            m.setattr(_fast, "attention_jvp_kernel", lambda: None)
            want = stack.block_jvp(1, h1, tang, cache=cache)
    finally:
        core.linear_force_fallback(False)
    np.testing.assert_array_equal(got, want)
