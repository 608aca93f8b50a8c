"""LayerNorm's float32 output pass (C++: computed in float, csrc/rows_f32.hpp) against float64.

The pass runs in float only for rows whose mean and scale lie well inside float's range
(f32_output_pass_ok in csrc/layernorm.hpp); the others keep the double pass. Both kinds
of rows, and the boundary between them, must stay within the float32 tolerance of
tests/helpers.py, and a value must not depend on the output's alignment.
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
