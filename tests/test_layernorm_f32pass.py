"""LayerNorm's float32 passes (computed in float: csrc/rows_f32.hpp, the Numba
``_layer_norm_write_f32`` and ``_sum_sq_f32``) against float64.

The output pass runs in float only for rows whose mean and scale lie well inside float's
range (f32_output_pass_ok in csrc/layernorm.hpp); the others keep the double pass. The
forward's variance pass sums (x - float(mu))^2 in float and corrects by (mu - float(mu))^2;
rows whose variance leaves [2^-60, 2^100] (squares that may underflow or overflow in
float) redo it in double. Every kind of row, and the boundaries between them, must stay
within the float32 tolerance of tests/helpers.py, and a value must not depend on the
output's alignment.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from helpers import assert_close


def _exact(x, gamma, beta, eps=1e-5):
    return pe.layer_norm(*(a.astype(np.float64) for a in (x, gamma, beta)), eps, backend="numpy")


def _params(d, seed):
    rng = np.random.default_rng(seed)
    return (1.0 + 0.5 * rng.standard_normal(d)).astype(np.float32), (0.1 * rng.standard_normal(d)).astype(np.float32)


@pytest.mark.parametrize("d", [768, 1000, 4097, 17])
@pytest.mark.parametrize(("loc", "scale"), [(0.0, 1.0), (1e4, 1.0), (-3e3, 1e-2), (3e5, 1.0), (0.0, 1e30), (1.0, 1e-6)])
def test_float32_pass_matches_float64(compiled, d, loc, scale):
    rng = np.random.default_rng(d)
    x = (loc + scale * rng.standard_normal((9, d))).astype(np.float32)
    gamma, beta = _params(d, 1)
    got = pe.layer_norm(x, gamma, beta, backend=compiled)
    assert_close(got, _exact(x, gamma, beta), np.float32)


@pytest.mark.parametrize("exponent", [-98, -99, -100, -101, -102, -125, 98, 100, 102, 120])
def test_float32_pass_range_boundary(compiled, exponent):
    """Rows scaled by 2^e around the cut-over 1/s = 2^+-100 (and subnormal-adjacent ones)."""
    d = 768
    rng = np.random.default_rng(3)
    x = (np.ldexp(1.0, exponent) * (2.0 + rng.standard_normal((4, d)))).astype(np.float32)
    gamma, beta = _params(d, 2)
    got = pe.layer_norm(x, gamma, beta, 0.0, backend=compiled)
    exact = _exact(x, gamma, beta, 0.0)
    assert np.isfinite(got).all()
    assert_close(got, exact, np.float32)


def test_float32_pass_independent_of_alignment(compiled):
    n, d = 5, 1000
    rng = np.random.default_rng(4)
    x = (50.0 + rng.standard_normal((n, d))).astype(np.float32)
    gamma, beta = _params(d, 5)
    want = pe.layer_norm(x, gamma, beta, backend=compiled)
    for shift in range(1, 16):
        buf = np.empty(n * d + 16, np.float32)
        out = buf[shift : shift + n * d].reshape(n, d)
        got = pe.layer_norm(x, gamma, beta, backend=compiled, out=out)
        np.testing.assert_array_equal(got, want)
    assert_close(want, _exact(x, gamma, beta), np.float32)


@pytest.mark.parametrize("exponent", [-75, -70, -66, -33, -31, -30, -29, 49, 50, 51, 62, 63, 64])
@pytest.mark.parametrize("d", [768, 300])
def test_float32_variance_pass_cutovers(compiled, exponent, d):
    """Rows whose variance sits at the variance pass's cut-overs 2^-60 and 2^100, rows whose
    float squares are subnormal (2^-70, 2^-75: only a few bits left, so the double pass
    must take over) and rows whose float squares overflow (2^64 * N(0, 1)); eps = 0."""
    rng = np.random.default_rng(exponent + 200)
    x = (np.ldexp(1.0, exponent) * rng.standard_normal((6, d))).astype(np.float32)
    gamma, beta = _params(d, 6)
    got = pe.layer_norm(x, gamma, beta, 0.0, backend=compiled)
    assert np.isfinite(got).all()
    assert_close(got, _exact(x, gamma, beta, 0.0), np.float32)


@pytest.mark.parametrize("d", [768, 4096, 1001])
def test_float32_variance_of_rows_near_constant(compiled, d):
    """Rows of large mean whose values differ by a few float ulps: the centre float(mu) is
    then off the mean by up to half an ulp, comparable to the spread, and the variance
    stands only with the (mu - float(mu))^2 correction (without it these rows are off by
    several percent)."""
    rng = np.random.default_rng(d)
    rows = [1e6 + 0.0625 * rng.integers(-2, 3, d),  # ulp(1e6) = 0.0625
            1.0 + 2.0**-23 * rng.integers(0, 2, d),
            -3e5 + 0.03125 * rng.integers(0, 4, d),
            4097.0 + 2.0**-11 * rng.integers(-1, 2, d) + (rng.random(d) < 0.01) * 0.5]
    x = np.array(rows).astype(np.float32)
    gamma, beta = _params(d, 7)
    for eps in (0.0, 1e-12):
        got = pe.layer_norm(x, gamma, beta, eps, backend=compiled)
        assert_close(got, _exact(x, gamma, beta, eps), np.float32)
