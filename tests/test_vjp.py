"""Reverse mode of pyengine.Stack: block_vjp (the exact transpose of block_jvp) in every stack
variant, its weight gradients, and the stack VJP vjp(), against central finite differences,
the adjoint of the JVP, and the composition of block VJPs."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine.models import Stack, StackConfig, init_weights
from test_model import COMBOS, D, FD_RTOL, FD_STEP, T, combo_config, combo_id, make_stack, rel_err, stream

#: The adjoint identity's accepted error, relative to the Cauchy-Schwarz scale ||u|| ||J v||
#: (a relative error in <u, J v> itself is ill-posed when u is nearly orthogonal to J v).
ADJ_RTOL = 1e-12
#: float32 against float64, relative to the float64 result's norm (measured: at most 6.5e-7 over COMBOS).
F32_RTOL = 1e-5
MODES = ("full", "frozen_scale")


def dense_jacobian(stack, k, h, mode="full"):
    """J (T*d, T*d) of block k at h from T*d JVPs (one batched call), column c = J e_c."""
    n = h.size
    return stack.block_jvp(k, h, np.eye(n).reshape(n, *h.shape), mode).reshape(n, n).T


# --------------------------------------------------------------------------- block VJP


@pytest.mark.parametrize("i", range(len(COMBOS)), ids=combo_id)
def test_block_vjp_is_the_transpose_of_block_jvp(i):
    stack = make_stack(**combo_config(i))
    h, v, u = stream((T, D)), stream((3, T, D), seed=2), stream((3, T, D), seed=5)
    for mode in MODES:
        jv, ju = stack.block_jvp(1, h, v, mode), stack.block_vjp(1, h, u, mode)
        lhs, rhs = np.einsum("rtd,rtd->r", u, jv), np.einsum("rtd,rtd->r", ju, v)
        scale = np.linalg.norm(u.reshape(3, -1), axis=1) * np.linalg.norm(jv.reshape(3, -1), axis=1)
        assert np.all(np.abs(lhs - rhs) <= ADJ_RTOL * scale), (mode, lhs, rhs)
        # all T*d directions: the VJP's dense matrix is the JVP's, transposed
        n = h.size
        rows = stack.block_vjp(1, h, np.eye(n).reshape(n, T, D), mode).reshape(n, n)  # J^T e_c: row c of J
        assert rel_err(rows, dense_jacobian(stack, 1, h, mode)) <= ADJ_RTOL


@pytest.mark.parametrize("i", range(len(COMBOS)), ids=combo_id)
def test_block_vjp_matches_finite_differences(i):
    """J^T u = grad of <u, block(h)>: central differences along every coordinate (one batched forward)."""
    stack = make_stack(**combo_config(i))
    h, u = stream((T, D)), stream((T, D), seed=5)
    n = h.size
    e = np.eye(n).reshape(n, T, D) * FD_STEP
    fwd = stack.block_forward(1, np.concatenate([h + e, h - e]))
    fd = np.einsum("td,btd->b", u, fwd[:n] - fwd[n:]).reshape(T, D) / (2 * FD_STEP)
    assert rel_err(stack.block_vjp(1, h, u), fd) <= FD_RTOL


def _fd_weight(stack, k, h, u, name, direction, step=FD_STEP):
    W = stack.weights

    def f(s):
        W2 = dict(W)
        W2[name] = W[name] + s * direction
        return float(np.sum(u * Stack(stack.config, W2).block_forward(k, h)))

    return (f(step) - f(-step)) / (2 * step)


@pytest.mark.parametrize("i", range(len(COMBOS)), ids=combo_id)
def test_weight_gradients_match_finite_differences(i):
    """Every array of the block, along a random direction; R = 2 cotangents give the gradient of their sum."""
    stack = make_stack(**combo_config(i), gamma_scale=0.8)
    h, u = stream((T, D)), stream((2, T, D), seed=5)
    dh, grads = stack.block_vjp(1, h, u, weights=True)
    np.testing.assert_array_equal(dh, stack.block_vjp(1, h, u))
    assert list(grads) == [n for n in stack.weights if n.startswith("blocks.1.")]
    rng = np.random.default_rng(7)
    for name, grad in grads.items():
        assert grad.shape == stack.weights[name].shape and grad.dtype == np.float64
        direction = rng.standard_normal(grad.shape)
        fd = _fd_weight(stack, 1, h, u.sum(0), name, direction)
        assert abs(np.sum(grad * direction) - fd) <= 1e-7 * max(abs(fd), 1e-3), name


def test_weight_gradients_entrywise():
    """Every entry of every array of a tiny block (d = 4), central differences one by one."""
    cfg = StackConfig(d_model=4, n_heads=2, n_layers=1, d_mlp=6, positions="rotary", activation="silu_gated",
                      n_kv_heads=1, norm="rmsnorm", gamma_scale=1.3)
    stack = init_weights(cfg, "xavier", seed=3, dtype=np.float64, gamma_jitter=0.3, bias_std=0.1)
    h, u = stream((3, 4), seed=8), stream((3, 4), seed=9)
    _, grads = stack.block_vjp(0, h, u, weights=True)
    for name, grad in grads.items():
        fd = np.zeros(grad.size)
        for j in range(grad.size):
            e = np.zeros(grad.size)
            e[j] = 1.0
            fd[j] = _fd_weight(stack, 0, h, u, name, e.reshape(grad.shape))
        assert rel_err(grad.ravel(), fd) <= 1e-7, name


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_block_vjp_batched_equals_one_by_one_and_keeps_inputs(dtype):
    stack = make_stack(dtype=dtype, positions="rotary", n_kv_heads=1, activation="silu_gated")
    h, u = stream((T, D), dtype=dtype), stream((4, T, D), seed=2, dtype=dtype)
    h0, u0 = h.copy(), u.copy()
    _, cache = stack.block_forward(0, h, return_cache=True)
    many = stack.block_vjp(0, h, u, cache=cache)
    assert many.shape == u.shape and many.dtype == dtype
    tol = 0 if dtype == np.float64 else 1e-6
    for r in range(4):
        np.testing.assert_allclose(stack.block_vjp(0, h, u[r]), many[r], rtol=tol, atol=tol)
    np.testing.assert_array_equal(h, h0)
    np.testing.assert_array_equal(u, u0)


@pytest.mark.parametrize("i", range(len(COMBOS)), ids=combo_id)
def test_float32_vjp_close_to_float64(i):
    s64 = make_stack(**combo_config(i))
    s32 = s64.astype(np.float32)
    h, u = stream((T, D)), stream((2, T, D), seed=5)
    g64, w64 = s64.block_vjp(1, h, u, weights=True)
    g32, w32 = s32.block_vjp(1, h.astype(np.float32), u.astype(np.float32), weights=True)
    assert g32.dtype == np.float32 and rel_err(g32, g64) <= F32_RTOL
    for name in w64:
        assert w32[name].dtype == np.float32 and rel_err(w32[name], w64[name]) <= F32_RTOL, name


# --------------------------------------------------------------------------- stack VJP


@pytest.mark.parametrize("kw", [dict(), dict(norm="rmsnorm", positions="rotary", activation="silu_gated",
                                              n_kv_heads=1, causal=False),
                                dict(layout="parallel", placement="post", positions="sinusoidal")],
                         ids=["pre-ln", "rms-rotary-gqa-bidir", "parallel-post"])
def test_stack_vjp_composes_block_vjps_and_is_the_adjoint_of_chained_jvps(kw):
    stack = make_stack(n_layers=4, **kw)
    h0, g = stream((T, D)), stream((2, T, D), seed=6)
    hidden, caches = stack.forward(h0, cache_from=0)
    # composition of block VJPs, 4 -> 1
    want = g
    for k in (3, 2, 1):
        want = stack.block_vjp(k, hidden[k], want, cache=caches[k])
    got = stack.vjp(h0, g, from_layer=4, to_layer=1)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(stack.vjp(None, g, -1, 1, caches=caches), got)
    # adjoint of the chained JVP, 3 -> 1: <g, J v> = <J^T g, v>
    v = stream((2, T, D), seed=7)
    jv = v
    for k in (1, 2):
        jv = stack.block_jvp(k, hidden[k], jv, cache=caches[k])
    back = stack.vjp(h0, g, 3, 1)
    lhs, rhs = np.einsum("rtd,rtd->r", g, jv), np.einsum("rtd,rtd->r", back, v)
    scale = np.linalg.norm(g.reshape(2, -1), axis=1) * np.linalg.norm(jv.reshape(2, -1), axis=1)
    assert np.all(np.abs(lhs - rhs) <= ADJ_RTOL * scale)
    # against central differences of blocks 0 .. 3 run one after the other, hidden[0] -> hidden[4]
    def run(x):
        for k in range(4):
            x = stack.block_forward(k, x)
        return x

    e = stream((T, D), seed=9)
    fd = np.sum(g[0] * (run(hidden[0] + FD_STEP * e) - run(hidden[0] - FD_STEP * e))) / (2 * FD_STEP)
    assert abs(fd - np.sum(stack.vjp(h0, g[0], 4, 0) * e)) <= FD_RTOL * abs(fd)
    # equal indices: the cotangent itself (a copy)
    same = stack.vjp(h0, g, 2, 2)
    np.testing.assert_array_equal(same, g)
    assert same is not g


def test_stack_vjp_from_token_ids():
    cfg = StackConfig(d_model=D, n_heads=2, n_layers=2, d_mlp=24, max_seq_len=8, vocab_size=11)
    stack = init_weights(cfg, "xavier", seed=1, dtype=np.float64, gamma_jitter=0.2)
    ids = np.array([3, 1, 4, 1, 5])
    hidden, caches = stack.forward(ids, cache_from=0)
    g = stream((T, D), seed=3)
    want = stack.block_vjp(0, hidden[0], stack.block_vjp(1, hidden[1], g, cache=caches[1]), cache=caches[0])
    np.testing.assert_allclose(stack.vjp(ids, g), want, rtol=1e-13, atol=1e-14)
    assert stack.vjp(ids, g.astype(np.float32)).dtype == np.float64  # the stack's dtype for ids


# --------------------------------------------------------------------------- bad input


def test_reverse_mode_refuses_bad_calls():
    stack = make_stack(n_layers=2)
    other = make_stack(n_layers=2, seed=4)
    h, g = stream((T, D)), stream((T, D), seed=2)
    _, cache = stack.block_forward(0, h, return_cache=True)
    for call, exc, match in [
        (lambda: stack.block_vjp(0, h, g[:-1]), ValueError, r"^g must have shape \(5, 16\)"),
        (lambda: stack.block_vjp(0, h, np.where(g > 1, np.nan, g)), ValueError, "^g "),
        (lambda: stack.block_vjp(0, h, g.astype(int)), TypeError, "^g "),
        (lambda: stack.block_vjp(0, h[None], g), ValueError, "^h must have shape"),
        (lambda: stack.block_vjp(5, h, g), ValueError, "^k "),
        (lambda: stack.block_vjp(0, h, g, mode="bogus"), ValueError, "mode"),
        (lambda: stack.block_vjp(0, h, g, weights=1), TypeError, "^weights must be True or False"),
        (lambda: stack.block_vjp(0, h, g, "frozen_scale", weights=True), ValueError, "^weights=True needs"),
        (lambda: stack.block_vjp(1, h, g, cache=cache), ValueError, "^cache belongs to block 0"),
        (lambda: other.block_vjp(0, h, g, cache=cache), ValueError, "another stack"),
        (lambda: stack.block_vjp(0, h + 1, g, cache=cache), ValueError, "different h"),
        (lambda: stack.vjp(h, g, 3), ValueError, "^from_layer "),
        (lambda: stack.vjp(h, g, 2, -4), ValueError, "^to_layer "),
        (lambda: stack.vjp(h, g, 1, 2), ValueError, "^to_layer = 2 must be <= from_layer = 1"),
        (lambda: stack.vjp(h, g[:, :4]), ValueError, r"^g must have shape \(5, 16\)"),
        (lambda: stack.vjp(h[None], g), ValueError, "^input_ids must be one sequence"),
        (lambda: stack.vjp(None, g), ValueError, "^input_ids is None"),
        (lambda: stack.vjp(h, g, caches=[cache]), ValueError, "^pass input_ids or caches"),
        (lambda: stack.vjp(None, g, 2, 0, caches=[cache]), ValueError, r"^caches lack block\(s\) \[1\]"),
        (lambda: stack.vjp(None, g, caches=[object()]), TypeError, "^caches must be BlockCaches"),
        (lambda: stack.vjp(h, g, mode="bogus"), ValueError, "mode"),
    ]:
        with pytest.raises(exc, match=match):
            call()
