"""The float32 paths of the forward activations and the softmax (csrc/vmath.hpp and
kernels/_numba/_vecmath.py, the ``*_f`` functions): relative error against the float64
reference on every float32 in [-16, 16] at step 2^-10 and on both tails, in units of
float32 eps. Results below 1e-35 in magnitude may flush to 0 (the exponential returns 0
below e^-87); there the absolute error must stay below 1e-35."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine.kernels import activations as pa

EPS = float(np.finfo(np.float32).eps)
FLUSH = 1e-35
#: Measured maxima (both backends): gelu 2.6, gelu_tanh 1.9, silu_gated 2.4, softmax 1.5 (eps units).
MAX_EPS = 4.0


def grid():
    x = np.arange(-16 * 1024, 16 * 1024 + 1, dtype=np.float64) / 1024
    tails = np.geomspace(16.0, 1e4, 2000)
    special = [0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, -1.28, -0.75, 87.0, -87.0, 88.7, -88.7]
    return np.concatenate([x, tails, -tails, special]).astype(np.float32)[None]


def assert_eps(got, ref, what):
    assert got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - ref)
    small = np.abs(ref) < FLUSH
    assert err[small].max(initial=0.0) <= FLUSH, what
    rel = err[~small] / (EPS * np.abs(ref[~small]))
    assert rel.max() <= MAX_EPS, (what, float(rel.max()))


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
def test_float32_activation_error_in_eps(compiled, name):
    x = grid()
    ref = pa.activation(name, x.astype(np.float64), backend="numpy")
    assert_eps(pa.activation(name, x, backend=compiled), ref, name)


def test_float32_silu_gated_error_in_eps(compiled):
    x = grid()
    ups = np.random.default_rng(0).uniform(-3.0, 3.0, x.shape).astype(np.float32)
    u = np.concatenate([x, ups], 1)
    ref = pa.activation("silu_gated", u.astype(np.float64), backend="numpy")
    assert_eps(pa.activation("silu_gated", u, backend=compiled), ref, "silu_gated")


@pytest.mark.parametrize("scale", [1.0, 3.0, 30.0])
def test_float32_softmax_error_in_eps(compiled, scale):
    s = (scale * np.random.default_rng(1).standard_normal((8, 64, 300))).astype(np.float32)
    ref = pa.softmax(s.astype(np.float64), offset=0, backend="numpy")
    assert_eps(pa.softmax(s, offset=0, backend=compiled), ref, "softmax")


def test_float32_path_is_not_the_float64_one(compiled):
    """The float32 kernels really compute in float32: their results differ from the float64
    results rounded once somewhere on the grid (else this file tests the old path)."""
    x = grid()
    ref = pa.activation("gelu", x.astype(np.float64), backend="numpy").astype(np.float32)
    assert (pa.activation("gelu", x, backend=compiled) != ref).any()
