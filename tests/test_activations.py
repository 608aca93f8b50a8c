"""The MLP activations (and what they share with the softmax kernels: layouts, out=, threads,
bad input): the reference against formulas and finite differences, every backend against
the reference, special values. The softmax and its JVP: test_softmax.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special

import pyengine as pe
from pyengine.kernels import activations as pa
from pyengine import backends
from helpers import assert_rounded as assert_close, scores

NAMES = pa.ACTIVATIONS


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


# --------------------------------------------------------------------------- the reference


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


# --------------------------------------------------------------------------- every backend vs the reference


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
        pa.activation("gelu", np.ones(3, np.longdouble))


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


def test_unknown_activation_and_backend():
    with pytest.raises(ValueError, match="^name must be one of 'gelu', 'gelu_tanh', 'relu', 'silu_gated'; got 'swish'"):
        pa.activation("swish", X)
    with pytest.raises(ValueError, match="^name must be one of"):
        pa.activation_jvp_coef("gelu_grad", X)
    with pytest.raises(ValueError, match="^backend must be one of"):
        pa.softmax(X, backend="cuda")


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
