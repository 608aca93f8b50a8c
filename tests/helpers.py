"""Test helpers: the tolerance table, comparisons and test data."""

from __future__ import annotations

import os

import numpy as np
import pytest

#: Comparison tolerances against the reference, per dtype: (rtol, atol relative to max |ref|).
TOL = {np.float32: (2e-6, 2e-6), np.float64: (1e-11, 1e-12)}
DTYPES = (np.float32, np.float64)


def assert_close(actual, desired, dtype, scale=None):
    """Compare with the tolerance table; atol is relative to the largest |desired|."""
    rtol, atol = TOL[np.dtype(dtype).type]
    desired = np.asarray(desired, dtype=np.float64)
    big = np.max(np.abs(desired)) if desired.size else 1.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol=rtol,
                               atol=atol * (big if scale is None else scale))


def make_case(shape, dtype, seed=0, loc=0.0, scale=1.0):
    """Random x, v, u of ``shape`` and gamma, beta of shape (d,) with non-trivial values."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    x = (loc + scale * rng.standard_normal(shape)).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    u = rng.standard_normal(shape).astype(dtype)
    gamma = (1.0 + 0.5 * rng.standard_normal(d)).astype(dtype)
    beta = (0.1 * rng.standard_normal(d)).astype(dtype)
    return x, v, u, gamma, beta


def tangent_scale(norm, x, w, gamma, eps=1e-5):
    """Size of the terms that a JVP/VJP adds up, |gamma| |w| / scale: the yardstick of its rounding.

    A JVP can cancel to far below its terms (for d = 2 LayerNorm's is nearly zero),
    so its error is judged against the terms, not the result.
    """
    xd = np.asarray(x, np.float64)
    ms = xd.var(-1) if norm == "layer_norm" else np.mean(xd * xd, -1)
    return float(np.abs(gamma).max() * np.abs(w).max() / np.sqrt(ms + eps).min())


#: Optional test-only packages that must import (CI sets PYENGINE_REQUIRE_TORCH=1: the
#: comparisons with PyTorch run there, never skip).
REQUIRE_TORCH = os.environ.get("PYENGINE_REQUIRE_TORCH", "") == "1"


def import_torch():
    """``torch``, or skip the test where it is absent (fail instead under PYENGINE_REQUIRE_TORCH=1)."""
    try:
        import torch
    except ImportError as exc:
        if REQUIRE_TORCH:
            pytest.fail(f"PYENGINE_REQUIRE_TORCH=1 but torch does not import: {exc}; install with: pip install '.[test]'")
        pytest.skip(f"torch is not installed ({exc})")
    return torch
