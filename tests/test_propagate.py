"""pyengine.propagate: exact and linearized propagation, metrics, decay fit, bad input."""

import math

import numpy as np
import pytest

import pyengine as pe
from pyengine.analysis import resolve_positions


def _stack(dtype=np.float64, **kw):
    base = dict(d_model=16, n_heads=4, n_layers=4, d_mlp=24, vocab_size=50, max_seq_len=16)
    base.update(kw)
    return pe.init_weights(pe.StackConfig(**base), seed=3, dtype=dtype, gamma_jitter=0.2, bias_std=0.05)


IDS = np.array([3, 14, 15, 9, 26, 5, 35, 8, 9, 7])


def _direct(stack, ids, v, alpha, layer, positions, dtype=np.float64):
    """Reference: inject by hand and run the blocks one by one through the public API."""
    h = stack.hidden_states(ids, dtype=dtype)
    x = h[layer].copy()
    x[positions] += alpha * v / np.linalg.norm(v)
    out = [x]
    for k in range(layer, stack.config.n_layers):
        x = stack.block_forward(k, x)
        out.append(x)
    return h[layer:], np.array(out)


CASES = [
    dict(),
    dict(placement="post"),
    dict(residual=False),
    dict(layout="parallel"),
    dict(norm="rmsnorm", positions="rotary", activation="silu_gated", n_kv_heads=2, bias=False),
    dict(causal=False),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("positions", ["all", [4, 6], slice(5, None), "last"], ids=str)
def test_metrics_match_a_direct_numpy_computation(kw, positions):
    st = _stack(**kw)
    rng = np.random.default_rng(0)
    V = rng.standard_normal((2, 16))
    scales = np.array([0.5, 3.0])
    r = pe.propagate(st, IDS, V, scales, 1, positions, return_deltas=True)
    pos = resolve_positions(positions, IDS.size)
    assert r.cosine.shape == (st.config.n_layers, 4, IDS.size)
    for i in range(2):
        for j, a in enumerate(scales):
            base, inj = _direct(st, IDS, V[i], a, 1, pos)
            n = i * 2 + j
            delta = inj - base
            vh = V[i] / np.linalg.norm(V[i])
            np.testing.assert_allclose(r.deltas[:, n], delta, rtol=0, atol=1e-12)
            np.testing.assert_allclose(r.projection[:, n], delta @ vh, rtol=0, atol=1e-12)
            nb, ni = np.linalg.norm(base, axis=-1), np.linalg.norm(inj, axis=-1)
            np.testing.assert_allclose(r.norm_ratio[:, n], ni / nb, rtol=1e-12)
            np.testing.assert_allclose(r.cosine[:, n], (inj * base).sum(-1) / (ni * nb), rtol=1e-12)
            np.testing.assert_allclose(r.delta_norm[:, n], np.linalg.norm(delta, axis=-1), rtol=1e-12, atol=1e-14)
    h = st.hidden_states(IDS)
    np.testing.assert_allclose(r.base_norm, np.linalg.norm(h[1:], axis=-1), rtol=1e-13)
    cos = (h[1:] * h[:-1]).sum(-1) / (np.linalg.norm(h[1:], axis=-1) * np.linalg.norm(h[:-1], axis=-1))
    np.testing.assert_allclose(r.base_adjacent_cosine, cos, rtol=1e-13)
    np.testing.assert_allclose(r.base_step, np.linalg.norm(h[1:] - h[:-1], axis=-1), rtol=1e-13)
    # Causal: nothing before the first injected position moves, exactly.
    if st.config.causal:
        assert np.all(r.projection[:, :, : pos[0]] == 0) and np.all(r.cosine[:, :, : pos[0]] == 1)


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("mode", ["full", "frozen_scale"])
def test_linearized_equals_exact_as_scale_goes_to_zero(kw, mode):
    st = _stack(**kw)
    v = np.random.default_rng(1).standard_normal(16)
    positions = [2, 5]  # a span: for non-causal stacks every row is recomputed anyway
    lin = pe.propagate(st, IDS, v, 1.0, 0, positions, linearized=True, mode=mode, return_deltas=True)
    errs = []
    for a in (1e-3, 1e-4, 1e-5):
        ex = pe.propagate(st, IDS, v, a, 0, positions, return_deltas=True)
        errs.append(np.abs(ex.deltas / a - lin.deltas).max())
    if mode == "full":
        # First-order error: shrinks linearly with the scale (until rounding).
        assert errs[1] < 0.2 * errs[0] and errs[2] < 0.2 * errs[1], errs
        assert errs[2] < 1e-3 * np.abs(lin.deltas).max()
    else:
        # A frozen scale is not the derivative when the norm is not scale-free along delta.
        assert errs[2] > 1e-6 * np.abs(lin.deltas).max()


def test_linearized_metrics_are_those_of_scaled_tangents():
    st = _stack()
    V = np.random.default_rng(2).standard_normal((3, 16))
    scales = [0.1, 1.0, 4.0]
    r = pe.propagate(st, IDS, V, scales, 2, [3, 7], linearized=True, return_deltas=True)
    d1 = pe.propagate(st, IDS, V, 1.0, 2, [3, 7], linearized=True, return_deltas=True).deltas
    for i in range(3):
        for j, a in enumerate(scales):
            np.testing.assert_allclose(r.deltas[:, i * 3 + j], a * d1[:, i], rtol=1e-14, atol=1e-16)
    # Linear in the scale: the projection doubles when the scale doubles.
    np.testing.assert_allclose(r.per_direction("projection")[:, :, 2], 4.0 * r.per_direction("projection")[:, :, 1])


@pytest.mark.parametrize("linearized", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_batch_equals_separate_runs(linearized, dtype):
    st = _stack(dtype=dtype)
    V = np.random.default_rng(4).standard_normal((4, 16))
    scales = [0.3, 2.0]
    r = pe.propagate(st, IDS, V, scales, 1, slice(4, 8), linearized=linearized)
    small = pe.propagate(st, IDS, V, scales, 1, slice(4, 8), linearized=linearized, batch_size=3)
    tol = 1e-12 if dtype == np.float64 else 2e-4
    for i in range(4):
        one = pe.propagate(st, IDS, V[i], scales, 1, slice(4, 8), linearized=linearized)
        for name in ("cosine", "projection", "norm_ratio", "delta_norm"):
            np.testing.assert_allclose(getattr(r, name)[:, 2 * i : 2 * i + 2], getattr(one, name), rtol=tol, atol=tol)
            np.testing.assert_allclose(getattr(small, name), getattr(r, name), rtol=tol, atol=tol)


def test_float_stream_input_and_float32_against_float64():
    st = _stack(vocab_size=0)
    x = np.random.default_rng(5).standard_normal((9, 16))
    v = np.ones(16)
    r64 = pe.propagate(st, x, v, 1.0, 0)
    r32 = pe.propagate(st.astype(np.float32), x.astype(np.float32), v, 1.0, 0)
    np.testing.assert_allclose(r32.projection, r64.projection, rtol=1e-3, atol=1e-4)
    assert r32.projection.dtype == np.float64


def test_inputs_are_not_modified():
    st = _stack()
    ids, v = IDS.copy(), np.arange(16.0)
    pe.propagate(st, ids, v, [1.0], 0, linearized=True)
    assert np.array_equal(ids, IDS) and np.array_equal(v, np.arange(16.0))


def test_views_fit_and_progress():
    st = _stack(n_layers=6)
    calls = []
    r = pe.propagate(st, IDS, np.ones(16), [1.0, 2.0], 1, [2, 3], progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (5, 5) and len(calls) == 5
    assert r.view("projection", "last").shape == (6, 2)
    assert np.array_equal(r.view("projection", "injected")[0], [1.0, 2.0])  # |delta . v| = scale
    assert np.all(np.isnan(r.view("cosine", "downstream")) == False)  # noqa: E712
    r2 = pe.propagate(st, IDS, np.ones(16), 1.0, 1, "last")
    assert np.all(np.isnan(r2.view("cosine", "downstream")))
    f = r.fit("injected")
    assert f.n_points == 6 and math.isfinite(f.rate)
    assert r.gain.shape == (5, 2, IDS.size)
    assert len(r.fits()) == 1 and len(r.fits()[0]) == 2
    import json

    json.dumps(r.to_dict())


def test_fit_decay_recovers_a_known_rate():
    k = np.arange(2, 12)
    rng = np.random.default_rng(0)
    y = 3.0 * np.exp(-0.4 * (k - 2)) * np.exp(0.01 * rng.standard_normal(k.size))
    f = pe.fit_decay(y, k)
    assert abs(f.rate - 0.4) < 0.01 and f.rate_ci[0] < 0.4 < f.rate_ci[1]
    assert f.r2 > 0.999 and abs(f.half_life - math.log(2) / f.rate) < 1e-12
    exact = pe.fit_decay(np.exp(-0.25 * np.arange(8)))
    assert abs(exact.rate - 0.25) < 1e-12 and exact.r2 == pytest.approx(1.0)
    grow = pe.fit_decay(np.exp(0.1 * np.arange(5)))
    assert grow.rate < 0 and grow.half_life == math.inf
    assert math.isnan(pe.fit_decay([1.0, 0.0, 0.0]).rate)
    with pytest.raises(ValueError, match="values must be 1-D"):
        pe.fit_decay(np.ones((2, 2)))



@pytest.mark.parametrize("n", [3, 4, 12, 33, 200])
def test_fit_decay_interval_is_the_student_t_interval(n):
    """The 95 % interval is slope +- t_{0.975, n-2} * se (the quantile as scipy.stats gives it)."""
    from scipy import stats

    k = np.arange(n, dtype=np.float64)
    y = np.log(2.0) - 0.3 * k + 0.05 * np.random.default_rng(n).standard_normal(n)
    f = pe.fit_decay(np.exp(y), k)
    slope, icpt = np.polyfit(k, y, 1)
    se = math.sqrt(float(((y - icpt - slope * k) ** 2).sum()) / (n - 2) / float(((k - k.mean()) ** 2).sum()))
    half = float(stats.t.ppf(0.975, n - 2)) * se
    assert f.rate_ci[1] - f.rate == pytest.approx(half, rel=1e-9)
    assert (f.rate_ci[1] - f.rate_ci[0]) / 2 == pytest.approx(half, rel=1e-9)

def test_removing_the_residual_changes_the_measured_rate():
    """With tiny block outputs (weights ~ 0, no norms' effect on the residual branch)
    the residual stack keeps delta (rate ~ 0), while without the residual the stream
    is the block output alone, which forgets the injected delta almost at once."""
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=6, d_mlp=24, vocab_size=50, max_seq_len=16)
    st = pe.init_weights(cfg, scheme="gpt2", seed=0, dtype=np.float64)
    v = np.random.default_rng(0).standard_normal(16)
    with_res = pe.propagate(st, IDS, v, 1.0, 1, "all").fit("all")
    no_res = pe.propagate(st.replace(residual=False), IDS, v, 1.0, 1, "all").fit("all")
    assert abs(with_res.rate) < 0.05
    assert no_res.rate > 1.0 and no_res.rate_ci[0] > with_res.rate_ci[1]


def test_bad_arguments_get_clear_errors():
    st = _stack()
    v = np.ones(16)
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 4\)"
                       r" \(a hidden-state index: the input of a block\); got 4"):
        pe.propagate(st, IDS, v, 1.0, 4)
    with pytest.raises(ValueError, match="layer must"):
        pe.propagate(st, IDS, v, 1.0, -1)
    with pytest.raises(ValueError, match="direction 1 is the zero vector"):
        pe.propagate(st, IDS, np.stack([v, 0 * v]), 1.0, 0)
    with pytest.raises(ValueError, match=r"direction must have shape \(16,\)"):
        pe.propagate(st, IDS, np.ones(15), 1.0, 0)
    with pytest.raises(ValueError, match=r"positions must lie in \[-10, 10\)"):
        pe.propagate(st, IDS, v, 1.0, 0, [3, 10])
    with pytest.raises(ValueError, match="selects no token"):
        pe.propagate(st, IDS, v, 1.0, 0, slice(20, 30))
    with pytest.raises(ValueError, match="selects no token"):
        pe.propagate(st, IDS, v, 1.0, 0, [])
    with pytest.raises(ValueError, match="positions must be"):
        pe.propagate(st, IDS, v, 1.0, 0, "first")
    with pytest.raises(ValueError, match="scale contains NaN"):
        pe.propagate(st, IDS, v, [1.0, np.nan], 0)
    with pytest.raises(ValueError, match="scale must be a number"):
        pe.propagate(st, IDS, v, "big", 0)
    with pytest.raises(ValueError, match="mode"):
        pe.propagate(st, IDS, v, 1.0, 0, linearized=True, mode="half")
    with pytest.raises(ValueError, match="batch_size"):
        pe.propagate(st, IDS, v, 1.0, 0, batch_size=0)
    with pytest.raises(TypeError, match="model must be a pyengine Stack"):
        pe.propagate("gpt2", IDS, v, 1.0, 0)
    with pytest.raises(ValueError, match="one sequence"):
        pe.propagate(st, np.stack([IDS, IDS]), v, 1.0, 0)
    assert pe.propagate(st, input_ids=IDS, direction=v, scale=1.0, layer=0).T == 10  # the keyword names
    with pytest.raises(TypeError, match="direction must be a float32 or float64"):
        pe.propagate(st, IDS, np.ones(16, int), 1.0, 0)


def test_slices_are_sorted_positions_whatever_their_step():
    st = _stack()
    v = np.ones(16)
    ref = pe.propagate(st, IDS, v, 1.0, 0, [3, 4, 5])
    for spec in (slice(5, 2, -1), slice(-5, -8, -1)):
        r = pe.propagate(st, IDS, v, 1.0, 0, spec)
        assert np.array_equal(r.positions, [3, 4, 5])
        np.testing.assert_array_equal(r.projection, ref.projection)
    r = pe.propagate(st, IDS, v, 1.0, 0, slice(None, None, 3))
    assert np.array_equal(r.positions, [0, 3, 6, 9])
    assert np.array_equal(r.projection[0, 0] != 0, np.isin(np.arange(10), [0, 3, 6, 9]))


def test_deltas_at_chosen_positions():
    st = _stack()
    V = np.random.default_rng(6).standard_normal((2, 16))
    full = pe.propagate(st, IDS, V, [1.0, 2.0], 1, slice(4, None), return_deltas=True)
    for lin in (False, True):
        part = pe.propagate(st, IDS, V, [1.0, 2.0], 1, slice(4, None), linearized=lin, return_deltas=[1, 6, -1])
        assert part.deltas.shape == (4, 4, 3, 16) and np.array_equal(part.delta_positions, [1, 6, 9])
        assert np.all(part.deltas[:, :, 0] == 0)  # before the span: exactly unchanged
        if not lin:
            np.testing.assert_array_equal(part.deltas, full.deltas[:, :, [1, 6, 9]])


def test_fit_defaults_to_the_largest_scale_and_checks_its_index():
    st = _stack()
    r = pe.propagate(st, IDS, np.ones(16), [6.0, 0.1], 0)
    assert r.fit("all") == r.fit("all", 0)
    with pytest.raises(ValueError, match=r"scale_index must be an integer in \[0, 2\)"):
        r.fit("all", 2)
    with pytest.raises(ValueError, match="where must be one of"):
        r.view("cosine", "middle")
