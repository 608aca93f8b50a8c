"""pyengine.models.stack: the block JVP against central finite differences for every stack
variant, causality, and the errors of bad calls. The forward against a naive implementation is in
test_model_forward.py, configs and weights files in test_model_files.py; test_vjp.py and those two
import this file's stack helpers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pyengine.models import _blocks
from pyengine.models import BlockCache, StackConfig, init_weights

D, H, T, D_MLP = 16, 2, 5, 32
#: Central-difference step and the accepted error, relative to the difference's norm.
FD_STEP = 1e-6
FD_RTOL = 1e-7
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu_gated")


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
        stack.hidden_states(h.astype(np.longdouble))
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
