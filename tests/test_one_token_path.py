"""The one-token fast paths: gamma/beta passed through without a copy when they
already are what the kernel takes, and the C++ row pipeline run without a parallel
region when one thread does the call; neither may change a result or skip a check."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine import _validate as _v
from pyengine import backends


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_param_passes_a_ready_array_through(dtype):
    x2 = np.zeros((2, 7), dtype)
    g = np.linspace(0.5, 1.5, 7).astype(dtype)
    assert _v.param("gamma", g, x2, 1.0) is g


@pytest.mark.parametrize(
    "make",
    [lambda g: g.astype(np.float64), lambda g: np.repeat(g, 2)[::2], list],
    ids=["other_dtype", "strided", "list"],
)
def test_param_converts_everything_else(make):
    x2 = np.zeros((2, 7), np.float32)
    g32 = np.linspace(0.5, 1.5, 7).astype(np.float32)
    g = make(g32)
    got = _v.param("gamma", g, x2, 1.0)
    assert got is not g and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, g32)


@pytest.mark.parametrize("d", [5, 7])
def test_param_finiteness_test_per_dtype_and_length(d):
    # The cached tiny vectors are per (d, dtype): each length and dtype still finds NaN.
    for dtype in (np.float32, np.float64):
        g = np.ones(d, dtype)
        assert _v.param("gamma", g, np.zeros((1, d), dtype), 1.0) is g
        g[-1] = np.nan
        with pytest.raises(ValueError, match=f"gamma contains NaN or Inf \\(first at index {d - 1}"):
            _v.param("gamma", g, np.zeros((1, d), dtype), 1.0)


KERNELS = ["layer_norm", "rms_norm", "layer_norm_jvp", "layer_norm_vjp", "rms_norm_jvp", "rms_norm_vjp"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_token_equals_its_row_of_a_batch(kernel, dtype):
    """A (1, d) call (one thread, no parallel region) gives the bits of the same row in a
    batch large enough to run on every thread."""
    if "cpp" not in backends.available_backends():
        pytest.skip("the C++ backend is not built")
    rng = np.random.default_rng(1)
    n, d = 300, 768
    x = (3.0 + rng.standard_normal((n, d))).astype(dtype)
    v = rng.standard_normal((n, d)).astype(dtype)
    g = rng.uniform(0.5, 1.5, d).astype(dtype)
    b = rng.standard_normal(d).astype(dtype)
    fn = getattr(pe, kernel)

    def call(xs, vs):
        if kernel == "layer_norm":
            return fn(xs, g, b, backend="cpp")
        if kernel == "rms_norm":
            return fn(xs, g, backend="cpp")
        return fn(xs, vs, g, backend="cpp")

    with pe.num_threads(2):
        batch = call(x, v)
    for r in (0, 137, n - 1):
        np.testing.assert_array_equal(call(x[r : r + 1], v[r : r + 1]), batch[r : r + 1])
