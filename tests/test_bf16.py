"""bf16 products: the kernels against a NumPy reference, propagation against float32, refusals."""

import json

import numpy as np
import pytest

import pyengine as pe
from pyengine.kernels import _blas, _cpp, linear_bf16
from pyengine.models import _linear

WHY = linear_bf16.unavailable()
needs_bf16 = pytest.mark.skipif(WHY is not None, reason=f"bf16 products unavailable here: {WHY}")

#: float32 accumulation of k bf16 products, relative to sum |x_i w_i| (k <= 1024 here).
ACC_RTOL = 1e-5
#: bf16 propagation against float32 on GPT-2-small widths: max|a - a_f32| / max|a_f32|.
PROPAGATION_RTOL = 2e-2


def round_bf16(a):
    """float32 -> bf16 -> float32, round to nearest even, bit by bit (NaN kept)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
    out = r.view(np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), out)


def _reference(x, w):
    """bf16(x) @ bf16(w), accumulated in float64; and sum |x_i w_i| (the accumulation's scale)."""
    xb, wb = round_bf16(x).astype(np.float64), round_bf16(w).astype(np.float64)
    return xb @ wb, np.abs(xb) @ np.abs(wb)


def _operands(N=70, k=96, n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    return x, w, b


def test_round_bf16_reference_rounds_to_nearest_even():
    one = 1.0
    a = np.array([one + 2.0**-8, one + 3 * 2.0**-8, one + 2.0**-8 + 2.0**-20, -(one + 3 * 2.0**-8), 2.0**-130],
                 np.float32)
    want = np.array([one, one + 2.0**-6, one + 2.0**-7, -(one + 2.0**-6), 2.0**-130], np.float32)
    np.testing.assert_array_equal(round_bf16(a), want)


@needs_bf16
def test_linear_bf16_rounds_x_to_nearest_even_exactly():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((33, 16)) * np.exp2(rng.integers(-20, 20, (33, 16)))).astype(np.float32)
    x[0, :4] = [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 3.0e38]
    eye = linear_bf16.pack(np.eye(16, dtype=np.float32))
    out = np.empty_like(x)
    assert linear_bf16.kernel("linear_bf16")(x, eye.data, None, None, out) == 0
    np.testing.assert_array_equal(out, round_bf16(x))


@needs_bf16
@pytest.mark.parametrize("N", [1, 37, 300])
def test_linear_bf16_matches_reference(N):
    x, w, b = _operands(N=N)
    x0 = x.copy()
    ref, scale = _reference(x, w)
    out = np.empty((N, w.shape[1]), np.float32)
    assert linear_bf16.kernel("linear_bf16")(x, linear_bf16.pack(w).data, b, None, out) == 0
    assert np.all(np.abs(out - (ref + b)) <= ACC_RTOL * (scale + np.abs(b)))
    np.testing.assert_array_equal(x, x0)
    # the bound tells bf16 operands from float32 ones
    assert not np.all(np.abs(x.astype(np.float64) @ w + b - (ref + b)) <= ACC_RTOL * (scale + np.abs(b)))


@needs_bf16
def test_linear_bf16_residual_in_place_and_nonfinite_rows():
    x, w, b = _operands()
    r = np.random.default_rng(2).standard_normal((x.shape[0], w.shape[1])).astype(np.float32)
    out = r.copy()
    x[5, 3] = np.nan
    nbad = linear_bf16.kernel("linear_bf16")(x, linear_bf16.pack(w).data, b, out, out)
    assert nbad == 1
    ref, scale = _reference(x, w)
    ok = np.arange(x.shape[0]) != 5
    assert np.all(np.abs(out - (ref + r + b))[ok] <= ACC_RTOL * (scale + np.abs(r) + np.abs(b))[ok])
    assert np.isnan(out[5]).all()


@needs_bf16
def test_linear_act_and_mul_bf16_match_reference():
    x, w, b = _operands(N=64)
    wp = linear_bf16.pack(w).data
    ref, scale = _reference(x, w)
    u, out = np.empty((64, w.shape[1]), np.float32), np.empty((64, w.shape[1]), np.float32)
    assert linear_bf16.kernel("linear_act_bf16")(x, wp, b, "relu", u, out) == 0
    assert np.all(np.abs(u - (ref + b)) <= ACC_RTOL * (scale + np.abs(b)))
    np.testing.assert_array_equal(out, np.maximum(u, 0))
    coef = np.random.default_rng(3).standard_normal((16, w.shape[1])).astype(np.float32)
    assert linear_bf16.kernel("linear_mul_bf16")(x, wp, coef, out) == 0
    c = np.tile(coef, (4, 1))
    assert np.all(np.abs(out - ref * c) <= ACC_RTOL * scale * np.abs(c) + 1e-30)


def _gelu_tanh64(u):
    u = u.astype(np.float64)
    with np.errstate(over="ignore"):  # u (1 + tanh y) / 2 as u sigmoid(2 y): no cancellation for u << 0
        return u / (1.0 + np.exp(-2.0 * np.sqrt(2.0 / np.pi) * (u + 0.044715 * u**3)))


@needs_bf16
def test_linear_act_bf16_gelu_tanh_epilogue_in_float():
    """gelu_tanh all in float (its argument too): within 2e-7 |y| relative, y = 2 sqrt(2/pi) (u + 0.044715 u^3)."""
    kernel = linear_bf16.kernel("linear_act_bf16")
    # u = b exactly (x = 0): a sweep through the tail, the flush below e^-87 and huge values
    grid = np.concatenate([np.linspace(-14.0, 14.0, 4093), [0.0, -1e30, 1e30]]).astype(np.float32)
    x0, u, out = np.zeros((2, 8), np.float32), np.empty((2, grid.size), np.float32), np.empty((2, grid.size), np.float32)
    assert kernel(x0, linear_bf16.pack(np.ones((8, grid.size), np.float32)).data, grid, "gelu_tanh", u, out) == 0
    np.testing.assert_array_equal(u[0], grid)
    want = _gelu_tanh64(grid)
    np.testing.assert_array_equal(out[:, -3:], np.float32([[0.0, -0.0, 1e30]] * 2))
    y = 2.0 * np.sqrt(2.0 / np.pi) * np.abs(grid.astype(np.float64) * (1.0 + 0.044715 * grid.astype(np.float64) ** 2))
    assert np.all(np.abs(out - want) <= (1e-6 + 2e-7 * np.minimum(y, 87.0)) * np.abs(want) + 1e-36)


@needs_bf16
def test_linear_bf16_same_bits_on_any_thread_count():
    x, w, b = _operands(N=1000, k=64, n=48)
    wp = linear_bf16.pack(w).data
    outs = []
    before = pe.get_num_threads()
    try:
        for threads in (1, 2, 3):
            pe.set_num_threads(threads)
            out = np.empty((1000, 48), np.float32)
            linear_bf16.kernel("linear_bf16")(x, wp, b, None, out)
            outs.append(out)
    finally:
        pe.set_num_threads(before)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@needs_bf16
def test_packed_weight_kept_with_its_array():
    w = np.ones((8, 4), np.float32)
    first = _linear._packed(w)
    assert _linear._packed(w) is first
    key = id(w)
    del w
    assert key not in _linear._PACKED


def _gpt2_widths(layers=2, T=12):
    cfg = pe.StackConfig(d_model=768, n_heads=12, d_mlp=3072, n_layers=layers, vocab_size=64,
                         activation="gelu_tanh", positions="learned", max_seq_len=T)
    return pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@needs_bf16
@pytest.mark.parametrize("linearized", [False, True], ids=["exact", "linearized"])
def test_propagate_bf16_close_to_float32_and_reports_its_error(linearized):
    stack = _gpt2_widths()
    rng = np.random.default_rng(4)
    ids, V = rng.integers(0, 64, 12), rng.standard_normal((3, 768))
    kw = dict(linearized=linearized)
    f32 = pe.propagate(stack, ids, V, [2.0, 6.0], 0, slice(6, None), **kw)
    bf = pe.propagate(stack, ids, V, [2.0, 6.0], 0, slice(6, None), precision="bf16", **kw)
    errs = [_rel(getattr(bf, m), getattr(f32, m)) for m in ("projection", "delta_norm")]
    assert max(errs) < PROPAGATION_RTOL
    assert 1e-6 < bf.precision_error < PROPAGATION_RTOL  # bf16 really ran, and its error was measured
    np.testing.assert_allclose(bf.precision_error, max(_rel(getattr(bf, m)[:, :2], getattr(f32, m)[:, :2])
                                                       for m in ("projection", "delta_norm")), rtol=1e-9)
    d = json.loads(json.dumps(bf.to_dict()))
    assert d["precision"] == "bf16" and d["precision_error"] == bf.precision_error
    assert "bf16 (rel. error" in repr(bf)
    assert f32.precision == "exact" and "precision" not in f32.to_dict()


def test_propagate_bf16_refuses_float64():
    stack = _gpt2_widths(layers=1, T=4).astype(np.float64)
    with pytest.raises(ValueError, match="precision='bf16' refused: .*float64"):
        pe.propagate(stack, [1, 2, 3], np.ones(768), 1.0, 0, precision="bf16")
    with pytest.raises(ValueError, match="precision must be one of"):
        pe.propagate(stack, [1, 2, 3], np.ones(768), 1.0, 0, precision="fp8")


def test_refused_without_cpu_support_or_mkl(monkeypatch):
    monkeypatch.setattr(_blas, "cpu_flags", lambda: {"avx512f", "fma"})
    got = _blas.find_bf16("MKL 2026.2 (libmkl_rt.so.3, sequential per tile in pyengine's threads)")
    assert got[:3] == (0, 0, 0) and "neither avx512_bf16 nor amx_bf16" in got[3]
    got = _blas.find_bf16("OpenBLAS 0.3.29 (scipy_cblas_sgemm64_, single-threaded per tile)")
    assert got[:3] == (0, 0, 0) and got[3].startswith("MKL is not the BLAS in use")
    monkeypatch.setattr(_cpp, "linear_bf16_ready", lambda: False)
    monkeypatch.setattr(_cpp, "linear_bf16_info", lambda: "the CPU has neither avx512_bf16 nor amx_bf16 (x)")
    with pytest.raises(ValueError, match="^precision='bf16' refused: the CPU has neither"):
        pe.propagate(_gpt2_widths(layers=1, T=4), [1, 2, 3], np.ones(768), 1.0, 0, precision="bf16")
    with pytest.raises(ValueError, match="refused"), _linear.bf16_products():
        pass


def test_refused_while_the_blas_path_is_off(monkeypatch):
    monkeypatch.setattr(_cpp, "linear_blas_ready", lambda: False)
    assert linear_bf16.unavailable().startswith("the linear kernels' BLAS path is off")
    with pytest.raises(ValueError, match="precision='bf16' refused: the linear kernels' BLAS path is off"):
        linear_bf16.require()


@needs_bf16
def test_compiled_kernels_raise_when_not_handed_over():
    from pyengine import _core

    x, w, _ = _operands(N=4)
    wp = linear_bf16.pack(w).data
    try:
        _core.set_blas_bf16(0, 0, 0, "the CPU has neither avx512_bf16 nor amx_bf16")
        with pytest.raises(RuntimeError, match="bf16 products unavailable: the CPU has neither"):
            _core.linear_bf16(x, wp, None, None, np.empty((4, w.shape[1]), np.float32))
    finally:
        _core.set_blas_bf16(*_blas.find_bf16(_core.linear_blas_info()))
    assert _core.linear_bf16_ready()
