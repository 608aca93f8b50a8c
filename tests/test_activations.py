"""Softmax, its JVP and the MLP activations: the reference against formulas and finite
differences, every backend against the reference, identities, awkward and bad input."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import special

import pyengine as pe
from pyengine.kernels import activations as pa
from pyengine import backends
from conftest import require

#: Comparison tolerances against the reference, per dtype: (rtol, atol relative to the
#: scale of the result's terms). float32 results are the double results rounded once.
TOL = {np.float32: (1e-6, 1e-7), np.float64: (1e-13, 1e-15)}
NAMES = pa.ACTIVATIONS


def assert_close(actual, desired, dtype, scale=None):
    rtol, atol = TOL[np.dtype(dtype).type]
    desired = np.asarray(desired, np.float64)
    big = np.max(np.abs(desired)) if desired.size else 1.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol=rtol,
                               atol=atol * (big if scale is None else scale))


def visible_mask(tq, tk, offset):
    """(Tq, Tk): True where key j is visible to query i."""
    return np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk if offset is None else offset)


def naive_softmax(x, offset):
    """Row by row, in float64, straight from the definition."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    tq, tk = x.shape[-2:]
    vis = visible_mask(tq, tk, offset)
    for idx in np.ndindex(*x.shape[:-1]):
        keep = vis[idx[-1]]
        e = [math.exp(v - max(x[idx][keep])) for v in x[idx][keep]]
        out[idx][keep] = np.array(e) / math.fsum(e)
    return out


def direct_activation(name, x):
    """The activations from their textbook formulas (float64)."""
    x = np.asarray(x, np.float64)
    if name == "gelu":
        return 0.5 * x * (1.0 + special.erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "relu":
        return np.maximum(x, 0.0)
    n = x.shape[-1] // 2
    g, up = x[..., :n], x[..., n:]
    return g / (1.0 + np.exp(-g)) * up


def scores(shape, dtype, seed=0, scale=3.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


# --------------------------------------------------------------------------- the reference

SOFTMAX_CASES = [  # (N, Tq, Tk), offset
    ((1, 1, 1), 0), ((3, 1, 1), None), ((2, 5, 5), 0), ((2, 5, 7), 2), ((2, 4, 9), None),
    ((1, 6, 6), 3), ((3, 17, 33), 16), ((2, 33, 33), 0), ((1, 9, 130), 0), ((2, 64, 64), None),
]


@pytest.mark.parametrize(("shape", "offset"), SOFTMAX_CASES, ids=lambda v: str(v))
def test_reference_softmax_is_the_definition(shape, offset):
    x = scores(shape, np.float64, seed=sum(shape))
    got = pa.softmax(x, offset=offset, backend="numpy")
    np.testing.assert_allclose(got, naive_softmax(x, offset), rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("name", NAMES)
def test_reference_activation_is_the_formula(name):
    x = 4.0 * np.random.default_rng(1).standard_normal((7, 50))
    np.testing.assert_allclose(pa.activation(name, x, backend="numpy"), direct_activation(name, x),
                               rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_reference_jvp_coef_is_the_central_difference(name):
    rng = np.random.default_rng(2)
    x = 3.0 * rng.standard_normal((5, 40))
    x[np.abs(x) < 1e-3] = 0.5  # relu has a kink at 0
    h = 1e-6
    fwd = lambda a: pa.activation(name, a, backend="numpy")  # noqa: E731
    coef = pa.activation_jvp_coef(name, x, backend="numpy")
    if name != "silu_gated":
        fd = (fwd(x + h) - fwd(x - h)) / (2 * h)
        np.testing.assert_allclose(coef[0], fd, rtol=1e-7, atol=1e-8)
        return
    n = x.shape[1] // 2
    for k, half in enumerate((slice(0, n), slice(n, None))):  # d/dgate, d/dup
        dx = np.zeros_like(x)
        dx[:, half] = h
        fd = (fwd(x + dx) - fwd(x - dx)) / (2 * h)
        np.testing.assert_allclose(coef[k], fd, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize(("shape", "offset"), [((2, 5, 5), 0), ((2, 4, 7), 3), ((1, 6, 6), None)])
def test_reference_softmax_jvp_is_the_central_difference(shape, offset):
    rng = np.random.default_rng(3)
    x = scores(shape, np.float64, seed=4)
    dx = rng.standard_normal((2,) + shape)
    p = pa.softmax(x, offset=offset, backend="numpy")
    h = 1e-6
    fd = np.stack([(pa.softmax(x + h * d, offset=offset, backend="numpy")
                    - pa.softmax(x - h * d, offset=offset, backend="numpy")) / (2 * h) for d in dx])
    np.testing.assert_allclose(pa.softmax_jvp(p, dx, backend="numpy"), fd, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------- every backend vs the reference


@pytest.mark.parametrize(("shape", "offset"), SOFTMAX_CASES, ids=lambda v: str(v))
def test_softmax_matches_reference(compiled, dtype, shape, offset):
    x = scores(shape, dtype, seed=sum(shape))
    ref = pa.softmax(x, offset=offset, backend="numpy")
    got = pa.softmax(x, offset=offset, backend=compiled)
    assert got.dtype == dtype and got.shape == shape
    assert_close(got, ref, dtype, scale=1.0)
    np.testing.assert_array_equal(got[..., ~visible_mask(*shape[1:], offset)], 0.0)


@pytest.mark.parametrize(("p_shape", "dx_shape"), [
    ((1, 1, 1), (1, 1, 1)), ((2, 5, 5), (2, 5, 5)), ((2, 5, 5), (3, 2, 5, 5)),
    ((1, 3, 7, 7), (4, 3, 7, 7)), ((3, 9, 130), (2, 3, 9, 130)), ((1, 1, 33, 33), (2, 5, 1, 33, 33)),
], ids=str)
def test_softmax_jvp_matches_reference(compiled, dtype, p_shape, dx_shape):
    p = pa.softmax(scores(p_shape, dtype, seed=5), offset=0)
    dx = np.random.default_rng(6).standard_normal(dx_shape).astype(dtype)
    ref = pa.softmax_jvp(p, dx, backend="numpy")
    got = pa.softmax_jvp(p, dx, backend=compiled)
    assert got.dtype == dtype and got.shape == dx_shape
    assert_close(got, ref, dtype, scale=np.abs(dx).max())  # judged by its terms: it cancels


#: The values the activations are probed at: every range of every formula.
SPECIAL = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-8, 0.5, -0.5, -0.75, -1.28, 1.0, -3.0, 5.5, -5.5,
                    9.0, -9.0, 26.0, -26.0, 37.0, -37.5, 40.0, -40.0, 100.0, -100.0, 745.0, -745.0,
                    1e4, -1e4, 3e38, -3e38])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 8), (5, 1030), (2, 3, 64)], ids=str)
def test_activation_matches_reference(compiled, dtype, name, shape):
    x = (4.0 * np.random.default_rng(sum(shape)).standard_normal(shape)).astype(dtype)
    for fn in (pa.activation, pa.activation_jvp_coef):
        ref = fn(name, x, backend="numpy")
        got = fn(name, x, backend=compiled)
        for g, r in zip(*((got, ref) if isinstance(ref, tuple) else ((got,), (ref,)))):
            assert g.dtype == dtype and g.shape == r.shape
            assert_close(g, r, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_activation_special_values(backend, dtype, name):
    """Tiny, huge, kinks and the far tails: finite, and the reference's values."""
    x = SPECIAL.astype(dtype)
    if name == "silu_gated":  # the special values as gates, moderate ups (the product must not overflow)
        x = np.concatenate([x, np.linspace(-1.0, 1.0, x.size, dtype=dtype)])
    x = x[None]
    for fn in (pa.activation, pa.activation_jvp_coef):
        ref = fn(name, x.astype(np.float64), backend="numpy")
        got = fn(name, x, backend=backend)
        for g, r in zip(*((got, ref) if isinstance(ref, tuple) else ((got,), (ref,)))):
            assert np.isfinite(g).all()
            rtol = 1e-6 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(g, r.astype(dtype), rtol=rtol, atol=1e-30)


def test_huge_inputs_have_the_right_limits(backend):
    """No overflow NaN: the limits of every function at +-1e4 (float32) and +-1e300 (float64)."""
    for dt, big in ((np.float32, 1e4), (np.float64, 1e300)):
        x = np.array([[big, -big]], dt)
        want = {"gelu": [big, 0.0], "gelu_tanh": [big, 0.0], "relu": [big, 0.0]}
        grad = {"gelu": [1.0, 0.0], "gelu_tanh": [1.0, 0.0], "relu": [1.0, 0.0]}
        for name in ("gelu", "gelu_tanh", "relu"):
            np.testing.assert_array_equal(pa.activation(name, x, backend=backend), [want[name]])
            np.testing.assert_array_equal(pa.activation_jvp_coef(name, x, backend=backend)[0], [grad[name]])
        u = np.array([[big, -big, 2.0, 2.0]], dt)  # gates +-big, ups 2
        np.testing.assert_array_equal(pa.activation("silu_gated", u, backend=backend), [[2 * big, 0.0]])
        a, b = pa.activation_jvp_coef("silu_gated", u, backend=backend)
        np.testing.assert_array_equal(a, [[2.0, 0.0]])
        np.testing.assert_array_equal(b, [[big, 0.0]])


def test_gelu_relative_accuracy_in_the_tail(compiled):
    """Phi(x) in float64 keeps its relative accuracy down to x = -37 (no 1 - erf cancellation)."""
    x = -np.linspace(0.0, 37.0, 371)[None]
    exact = x * (0.5 * special.erfc(-x / math.sqrt(2.0)))  # erfc: accurate in the tail
    got = pa.activation("gelu", x, backend=compiled)
    np.testing.assert_allclose(got, exact, rtol=5e-13, atol=0)


# --------------------------------------------------------------------------- identities, every backend


@pytest.mark.parametrize(("shape", "offset"), [((3, 7, 7), 0), ((2, 5, 9), 4), ((2, 6, 11), None)])
def test_softmax_identities(backend, dtype, shape, offset):
    """Rows sum to 1 over the visible keys, masked keys are exactly 0, a per-row shift changes nothing."""
    x = scores(shape, dtype, seed=7)
    p = pa.softmax(x, offset=offset, backend=backend)
    vis = visible_mask(*shape[1:], offset)
    np.testing.assert_array_equal(p[..., ~vis], 0.0)
    assert (p[..., vis] > 0).all()
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=4 * np.finfo(dtype).eps * shape[-1])
    shifted = pa.softmax(x + np.array(2.0, dtype) * np.arange(shape[1], dtype=dtype)[:, None], offset=offset,
                         backend=backend)
    assert_close(shifted, p, dtype, scale=1.0)


def test_softmax_jvp_identities(backend, dtype):
    """JVP rows sum to 0; entries where p = 0 (masked) are exactly 0."""
    p = pa.softmax(scores((2, 6, 6), dtype, seed=8), offset=0)
    dx = np.random.default_rng(9).standard_normal((3, 2, 6, 6)).astype(dtype)
    dp = pa.softmax_jvp(p, dx, backend=backend)
    np.testing.assert_array_equal(dp[..., ~visible_mask(6, 6, 0)], 0.0)
    np.testing.assert_allclose(dp.sum(-1), 0.0, atol=10 * np.finfo(dtype).eps)
    # A tangent along the row (a shift of the scores) does not move the softmax.
    np.testing.assert_allclose(pa.softmax_jvp(p, np.ones_like(dx), backend=backend), 0.0,
                               atol=10 * np.finfo(dtype).eps)


@pytest.mark.parametrize("case", ["huge", "tiny", "equal", "caller_masked", "one_visible"])
def test_softmax_awkward_scores(backend, dtype, case):
    x = scores((2, 4, 6), dtype, seed=10)
    if case == "huge":  # +-1e4: one key takes everything, nothing overflows
        x = np.where(x > 0, 1e4, -1e4).astype(dtype)
        x[..., 0] = 1e4
    elif case == "tiny":
        x = (x * 1e-30).astype(dtype)
    elif case == "equal":
        x[...] = 7.0
    elif case == "caller_masked":  # -inf = masked by the caller (a padding mask): exactly 0
        x[..., 1:3] = -np.inf
    else:
        x[..., 1:] = -np.inf
    got = pa.softmax(x, backend=backend)
    assert np.isfinite(got).all()
    assert_close(got, pa.softmax(x.astype(np.float64), backend="numpy"), dtype, scale=1.0)
    if case == "equal":
        np.testing.assert_allclose(got, 1.0 / 6, rtol=2 * np.finfo(dtype).eps)
    if case == "caller_masked":
        np.testing.assert_array_equal(got[..., 1:3], 0.0)
    if case == "one_visible":
        np.testing.assert_array_equal(got[..., 0], 1.0)
        np.testing.assert_array_equal(got[..., 1:], 0.0)


def test_softmax_masked_entries_are_never_read(backend):
    x = scores((2, 5, 5), np.float64, seed=11)
    x2 = x.copy()
    x2[..., ~visible_mask(5, 5, 0)] = np.nan
    np.testing.assert_array_equal(pa.softmax(x2, offset=0, backend=backend),
                                  pa.softmax(x, offset=0, backend=backend))


@pytest.mark.parametrize("tk", [7, 100, 130])
def test_softmax_rows_of_any_length(backend, dtype, tk):
    """The Numba kernel reads a row's visible scores rounded up to 64, into the next row (or,
    for the last rows, a staging copy). Masked keys that are +inf there, bad rows next to
    good ones, the last row bad, and in place on two threads: each row as when alone."""
    x = scores((3, 9, tk), dtype, seed=tk)
    x[0, 2, :] = np.nan  # a bad row; the row before reads into it
    x[1, 4, 1] = np.inf  # a bad row
    x[-1, -1, 0] = np.nan  # the very last row bad (the staged tail)
    x[..., ~visible_mask(9, tk, 3)] = np.inf  # the masked keys: never part of a result
    kernel = pa.kernel("softmax", backend)
    want = np.empty_like(x)
    for i in range(3):
        kernel(x[i:i + 1].copy(), 3, want[i:i + 1])
    with backends.num_threads(2):
        got = np.empty_like(x)
        assert kernel(x, 3, got) == 3
        y = x.copy()
        assert kernel(y, 3, y) == 3
    for z in (got, y):
        np.testing.assert_array_equal(np.isnan(z).all(-1), np.isnan(want).all(-1))
        np.testing.assert_array_equal(z[~np.isnan(want)], want[~np.isnan(want)])
    good = np.ones((3, 9), bool)
    good[0, 2] = good[1, 4] = good[-1, -1] = False
    ref = np.empty_like(x, dtype=np.float64)
    pa.kernel("softmax", "numpy")(x.astype(np.float64), 3, ref)
    assert np.isnan(want[~good]).all()
    assert_close(want[good], ref[good], dtype, scale=1.0)


def test_raw_softmax_of_empty_rows(compiled):
    """Rows of Tk = 0 (the public layer refuses them) are bad rows, not a crash, in both backends."""
    x = np.zeros((2, 3, 0), np.float32)
    assert pa.kernel("softmax", compiled)(x, 0, x.copy()) == 6


_BOUNDS = """
import numpy as np
from pyengine.kernels import activations as pa
k = pa.kernel("softmax", "numba")
for tk in (7, 100, 130, 128):
    for dt in (np.float32, np.float64):
        x = np.random.default_rng(tk).standard_normal((2, 5, tk)).astype(dt)
        out = np.empty_like(x)
        assert k(x, 0, out) == 0 and k(x, tk, out) == 0
"""


def test_softmax_reads_stay_inside_x(tmp_path):
    """The Numba softmax's reach into the next row never leaves x: recompiled with Numba's
    bounds checks (NUMBA_BOUNDSCHECK=1, in a fresh process and cache), any read past the
    last row raises. About 15 s of compilation."""
    require("numba")
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _BOUNDS], env=env, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


def test_offsets_mean_what_they_say(backend):
    """offset >= Tk - 1 is no mask; a causal suffix equals the last rows of the full causal softmax."""
    x = scores((2, 9, 9), np.float64, seed=12)
    full = pa.softmax(x, backend=backend)
    np.testing.assert_array_equal(pa.softmax(x, offset=8, backend=backend), full)
    np.testing.assert_array_equal(pa.softmax(x, offset=10**30, backend=backend), full)
    causal = pa.softmax(x, offset=0, backend=backend)
    np.testing.assert_array_equal(pa.softmax(x[:, 5:], offset=5, backend=backend), causal[:, 5:])


# --------------------------------------------------------------------------- layout, out, threads


def test_noncontiguous_inputs_untouched(backend, dtype):
    base = scores((4, 10, 12), dtype, seed=13)
    views = {"strided": base[::2, ::2, ::2], "fortran": np.asfortranarray(base[:2, :5, :6]),
             "transposed": base[:2, :6, :5].transpose(0, 2, 1)}
    for v in views.values():
        assert not v.flags.c_contiguous
        before = v.copy()
        np.testing.assert_array_equal(pa.softmax(v, offset=0, backend=backend),
                                      pa.softmax(np.ascontiguousarray(v), offset=0, backend=backend))
        p = pa.softmax(np.ascontiguousarray(v), offset=0)
        np.testing.assert_array_equal(pa.softmax_jvp(p, v, backend=backend),
                                      pa.softmax_jvp(p, np.ascontiguousarray(v), backend=backend))
        for name in NAMES:
            np.testing.assert_array_equal(pa.activation(name, v, backend=backend),
                                          pa.activation(name, np.ascontiguousarray(v), backend=backend))
            for a, b in zip(pa.activation_jvp_coef(name, v, backend=backend),
                            pa.activation_jvp_coef(name, np.ascontiguousarray(v), backend=backend)):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(v, before)


def test_out_and_in_place(backend, dtype):
    x = scores((2, 5, 5), dtype, seed=14)
    want = pa.softmax(x, offset=0, backend=backend)
    out = np.full_like(x, np.nan)
    assert pa.softmax(x, offset=0, out=out, backend=backend) is out
    np.testing.assert_array_equal(out, want)
    y = x.copy()
    assert pa.softmax(y, offset=0, out=y, backend=backend) is y  # in place
    np.testing.assert_array_equal(y, want)
    dx = np.random.default_rng(15).standard_normal((3, 2, 5, 5)).astype(dtype)
    want = pa.softmax_jvp(want, dx, backend=backend)
    assert pa.softmax_jvp(y, dx, out=dx, backend=backend) is dx
    np.testing.assert_array_equal(dx, want)
    u = scores((3, 8), dtype, seed=16)
    for name in ("gelu", "gelu_tanh", "relu"):
        want = pa.activation(name, u, backend=backend)
        v = u.copy()
        assert pa.activation(name, v, out=v, backend=backend) is v
        np.testing.assert_array_equal(v, want)
    out = np.empty((3, 4), dtype)
    assert pa.activation("silu_gated", u, out=out, backend=backend) is out
    np.testing.assert_array_equal(out, pa.activation("silu_gated", u, backend=backend))


def test_raw_kernels_in_place(backend):
    """The fast path: kernels called directly, out aliasing the input."""
    x = scores((3, 6, 6), np.float32, seed=17)
    want = pa.softmax(x, offset=0, backend=backend)
    y = x.copy()
    assert pa.kernel("softmax", backend)(y, 0, y) == 0
    np.testing.assert_array_equal(y, want)
    u = x.reshape(3, 36).copy()
    want = pa.activation("gelu", u, backend=backend)
    assert pa.kernel("gelu", backend)(u, u) == 0
    np.testing.assert_array_equal(u, want)


def test_readonly_inputs(backend):
    """Read-only arrays (cached activations, say) are accepted and not copied into out."""
    x = scores((2, 4, 4), np.float64, seed=20)
    x.flags.writeable = False
    p = pa.softmax(x, offset=0, backend=backend)
    p.flags.writeable = False
    np.testing.assert_array_equal(pa.softmax_jvp(p, np.ones((3, 2, 4, 4)), backend=backend),
                                  pa.softmax_jvp(p.copy(), np.ones((3, 2, 4, 4)), backend=backend))
    np.testing.assert_array_equal(pa.activation("gelu", x, backend=backend),
                                  pa.activation("gelu", x.copy(), backend=backend))
    with pytest.raises(ValueError, match="^out must be writeable"):
        pa.softmax(x, out=x, backend=backend)


def test_empty_batches(backend):
    assert pa.softmax(np.zeros((0, 3, 4)), backend=backend).shape == (0, 3, 4)
    assert pa.softmax_jvp(np.zeros((2, 3, 4)), np.zeros((0, 2, 3, 4)), backend=backend).shape == (0, 2, 3, 4)
    assert pa.activation("silu_gated", np.zeros((0, 6)), backend=backend).shape == (0, 3)
    assert [c.shape for c in pa.activation_jvp_coef("silu_gated", np.zeros((0, 6)), backend=backend)] == [(0, 3)] * 2


def test_scalar_and_vector_activations(backend):
    assert pa.activation("relu", np.float64(-2.0), backend=backend).shape == ()
    np.testing.assert_allclose(pa.activation("gelu", np.array([1.0, -1.0]), backend=backend),
                               [special.ndtr(1.0), -special.ndtr(-1.0)], rtol=1e-14)


@pytest.mark.parametrize("kernel", backends.ACTIVATION_KERNELS)
def test_thread_count_does_not_change_bits(compiled, kernel):
    x = scores((40, 33, 33), np.float32, seed=18)
    with pe.num_threads(1):
        one = _call(kernel, x, compiled)
    with pe.num_threads(2):
        two = _call(kernel, x, compiled)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def _call(kernel, x, backend):
    if kernel == "softmax":
        return (pa.softmax(x, offset=0, backend=backend),)
    if kernel == "softmax_jvp":
        return (pa.softmax_jvp(pa.softmax(x[:4], offset=0), x.reshape(10, 4, 33, 33), backend=backend),)
    name = kernel.removesuffix("_grad")
    u = x.reshape(-1, 66)
    if kernel.endswith("_grad"):
        return pa.activation_jvp_coef(name, u, backend=backend)
    return (pa.activation(name, u, backend=backend),)


# --------------------------------------------------------------------------- bad input

X = scores((2, 3, 4), np.float64, seed=19)


def test_bad_dtypes():
    with pytest.raises(TypeError, match="^x must be a float32 or float64 array; got dtype int64"):
        pa.softmax(np.ones((2, 2), np.int64))
    with pytest.raises(TypeError, match="^p must be a float32"):
        pa.softmax_jvp(np.ones((2, 2), np.int32), np.ones((2, 2)))
    with pytest.raises(TypeError, match="^dx must be a float32"):
        pa.softmax_jvp(np.ones((2, 2)), np.ones((2, 2), complex))
    with pytest.raises(TypeError, match="^x must be a float32"):
        pa.activation("gelu", np.ones(3, np.float16))


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"^x must have shape \(\.\.\., Tq, Tk\) with Tk >= 1; got \(4,\)"):
        pa.softmax(np.ones(4))
    with pytest.raises(ValueError, match=r"Tk >= 1; got \(2, 0\)"):
        pa.softmax(np.ones((2, 0)))
    with pytest.raises(ValueError, match=r"^dx must have shape \(R, \.\.\., Tq, Tk\) ending in p's shape \(2, 3, 4\)"):
        pa.softmax_jvp(X, np.ones((2, 3, 5)))
    with pytest.raises(ValueError, match="^dx must have shape"):
        pa.softmax_jvp(X, np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"^x must have shape \(\.\.\., 2n\) = \[gate \| up\]"):
        pa.activation("silu_gated", np.ones((2, 5)))
    with pytest.raises(ValueError, match=r"^x must have shape \(\.\.\., 2n\)"):
        pa.activation_jvp_coef("silu_gated", np.float64(1.0))


@pytest.mark.parametrize(("offset", "exc", "msg"), [
    (-1, ValueError, "offset must be >= 0"), (1.0, TypeError, "offset must be None or an int"),
    (True, TypeError, "offset must be None or an int"), ("0", TypeError, "offset must be None"),
])
def test_bad_offset(offset, exc, msg):
    with pytest.raises(exc, match=f"^{msg}"):
        pa.softmax(X, offset=offset)


def test_numpy_integer_offset_is_fine():
    np.testing.assert_array_equal(pa.softmax(X, offset=np.int64(1)), pa.softmax(X, offset=1))


def test_unknown_activation_and_backend():
    with pytest.raises(ValueError, match="^name must be one of 'gelu', 'gelu_tanh', 'relu', 'silu_gated'; got 'swish'"):
        pa.activation("swish", X)
    with pytest.raises(ValueError, match="^name must be one of"):
        pa.activation_jvp_coef("gelu_grad", X)
    with pytest.raises(ValueError, match="^backend must be one of"):
        pa.softmax(X, backend="cuda")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_visible_scores(backend, value):
    x = X.copy()
    x[1, 2, 1] = value
    with pytest.raises(ValueError, match=r"^x contains NaN or \+Inf among the visible scores \(1 bad row\(s\); "
                                         r"first in row \(1, 2\), key 1"):
        pa.softmax(x, offset=0, backend=backend)


def test_row_without_a_finite_visible_score(backend):
    x = X.copy()
    x[0, 1, :2] = -np.inf  # query 1 sees keys 0 and 1 only
    with pytest.raises(ValueError, match=r"^x row \(0, 1\) has no finite visible score \(all -inf\)"):
        pa.softmax(x, offset=0, backend=backend)
    x[0, 1, 2:] = 0.0  # ... but without a mask it sees finite keys
    assert np.isfinite(pa.softmax(x, backend=backend)).all()


@pytest.mark.parametrize("name", ["p", "dx"])
def test_nonfinite_jvp_input(backend, name):
    p = pa.softmax(X, offset=0)
    dx = np.ones((2,) + X.shape)
    (p if name == "p" else dx)[..., 1, 3] = np.nan
    where = r"\(0, 1\)" if name == "p" else r"\(0, 0, 1\)"
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or Inf \(\d+ bad row\(s\); first in row {where}, entry 3"):
        pa.softmax_jvp(p, dx, backend=backend)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_nonfinite_activation_input(backend, name, value):
    x = np.ones((3, 2, 4))
    x[2, 1, 3] = value
    for fn in (pa.activation, pa.activation_jvp_coef):
        with pytest.raises(ValueError, match=r"^x contains NaN or Inf \(1 bad row\(s\); first in row \(2, 1\), entry 3"):
            fn(name, x, backend=backend)


def test_bad_out():
    x = X.copy()
    with pytest.raises(ValueError, match=r"^out must have shape \(2, 3, 4\)"):
        pa.softmax(x, out=np.empty((2, 3, 5)))
    with pytest.raises(ValueError, match="^out must have dtype float64"):
        pa.softmax(x, out=np.empty(x.shape, np.float32))
    with pytest.raises(ValueError, match="^out must be C-contiguous"):
        pa.softmax(x, out=np.empty((4, 3, 2)).T)
    with pytest.raises(TypeError, match="^out must be a numpy.ndarray"):
        pa.softmax(x, out=[0.0])
    big = np.zeros((3, 3, 4))
    with pytest.raises(ValueError, match="^out must not overlap any input array"):
        pa.softmax(big[:2], out=big[1:])
    u = np.zeros((2, 8))
    with pytest.raises(ValueError, match="^out must not overlap any input array$"):
        pa.activation("silu_gated", u, out=u.reshape(4, 4)[:2])  # a C-contiguous view of u
