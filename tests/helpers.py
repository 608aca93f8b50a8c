"""Test helpers: the tolerance table, comparisons and test data."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

#: Comparison tolerances against the reference, per dtype: (rtol, atol relative to max |ref|).
TOL = {np.float32: (2e-6, 2e-6), np.float64: (1e-11, 1e-12)}
DTYPES = (np.float32, np.float64)


def assert_close(actual, desired, dtype, scale=None, tol=None):
    """Compare with the tolerance table ``tol`` (default :data:`TOL`); atol is relative to
    ``scale``, by default the largest |desired|."""
    rtol, atol = (TOL if tol is None else tol)[np.dtype(dtype).type]
    desired = np.asarray(desired, dtype=np.float64)
    big = np.max(np.abs(desired)) if desired.size else 1.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol=rtol,
                               atol=atol * (big if scale is None else scale))


#: The tighter table of the softmax and activation tests, whose float32 results are the
#: double results rounded once: (rtol, atol relative to the scale of the result's terms).
ROUNDED_TOL = {np.float32: (1e-6, 1e-7), np.float64: (1e-13, 1e-15)}


def assert_rounded(actual, desired, dtype, scale=None):
    """assert_close with :data:`ROUNDED_TOL`."""
    assert_close(actual, desired, dtype, scale, ROUNDED_TOL)


def scores(shape, dtype, seed=0, scale=3.0):
    """Attention-like scores (or any activation input): ``scale`` N(0, 1) of ``shape``."""
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


def visible_mask(tq, tk, offset):
    """(Tq, Tk): True where key j is visible to query i (offset None: every key)."""
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
