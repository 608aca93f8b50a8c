"""Every backend against the NumPy reference, for every normalization kernel."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from helpers import assert_close, make_case, tangent_scale
from pyengine import backends

NORM_KERNELS = backends.NORM_KERNELS
SHAPES = [(1, 2), (5, 2), (4, 3), (3, 4097), (1, 768), (2, 3, 64), (64, 768)]
JAC_SHAPES = [(1, 2), (4, 3), (2, 3, 17), (3, 64)]
MODES = ["full", "frozen_scale"]


def call(kernel, x, v, u, gamma, beta, *, mode="full", eps=1e-5, backend="auto", out=None):
    """Call the public function of ``kernel`` with the arguments that it takes."""
    fn = getattr(pe, kernel)
    norm, _, kind = kernel.partition("_norm")
    kw = {"backend": backend, "out": out}
    if kind == "":
        return fn(x, gamma, beta, eps, **kw) if norm == "layer" else fn(x, gamma, eps, **kw)
    if kind == "_jacobian":
        return fn(x, gamma, eps, mode, **kw)
    return fn(x, v if kind == "_jvp" else u, gamma, eps, mode, **kw)


def kernel_params(kernel):
    return MODES if kernel.endswith(("_jvp", "_vjp", "_jacobian")) else ["full"]


CASES = [
    pytest.param(k, m, s, id=f"{k}-{m}-{'x'.join(map(str, s))}")
    for k in NORM_KERNELS
    for m in kernel_params(k)
    for s in (JAC_SHAPES if k.endswith("_jacobian") else SHAPES)
]


@pytest.mark.parametrize(("kernel", "mode", "shape"), CASES)
def test_kernel_matches_reference(compiled, dtype, kernel, mode, shape):
    case = make_case(shape, dtype, seed=sum(shape))
    ref = call(kernel, *case, mode=mode, backend="numpy")
    got = call(kernel, *case, mode=mode, backend=compiled)
    assert got.dtype == dtype and got.shape == ref.shape
    scale = np.abs(ref).max()
    if not kernel.endswith("_norm"):  # derivatives cancel: judge them by their terms
        x, v, u, gamma, _ = case
        norm, kind = kernel.rsplit("_", 1)
        w = {"jvp": v, "vjp": u, "jacobian": np.ones(1)}[kind]
        scale = max(scale, tangent_scale(norm, x, w, gamma))
    assert_close(got, ref, dtype, scale=scale)


@pytest.mark.parametrize("kernel", NORM_KERNELS)
@pytest.mark.parametrize(
    ("loc", "scale"), [(0.0, 1e-6), (0.0, 1e6), (1e4, 1.0), (-3e3, 1e-2)], ids=["tiny", "huge", "mean1e4", "mean-3e3"]
)
def test_kernel_awkward_scales(backend, dtype, kernel, loc, scale):
    """Tiny and huge scales, large means: every backend matches float64 math on the same values."""
    shape = (4, 16) if kernel.endswith("_jacobian") else (6, 300)
    x, v, u, gamma, beta = make_case(shape, dtype, seed=11, loc=loc, scale=scale)
    exact = call(kernel, *(a.astype(np.float64) for a in (x, v, u, gamma, beta)), backend="numpy")
    got = call(kernel, x, v, u, gamma, beta, backend=backend)
    rtol = 1e-5 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(got, exact, rtol=rtol, atol=rtol * np.abs(exact).max())


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_robust_variance_float32(backend, norm):
    """Rows with mean 1e4 and std 1, and with one entry 1e5 times the others."""
    rng = np.random.default_rng(0)
    d = 4096
    rows = np.stack([1e4 + rng.standard_normal(d), np.r_[1e5, np.ones(d - 1)] * rng.uniform(1, 2, d)])
    x = rows.astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, d).astype(np.float32)
    fn = getattr(pe, norm)
    exact = fn(x.astype(np.float64), gamma.astype(np.float64), backend="numpy")
    got = fn(x, gamma, backend=backend)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kernel", NORM_KERNELS)
def test_constant_rows_with_eps(backend, dtype, kernel):
    """A constant row is fine when eps > 0: LayerNorm maps it to beta, with a finite Jacobian."""
    x, v, u, gamma, beta = make_case((3, 8), dtype, seed=3)
    x[1] = 2.5
    ref = call(kernel, x, v, u, gamma, beta, backend="numpy")
    got = call(kernel, x, v, u, gamma, beta, backend=backend)
    assert np.isfinite(got).all()
    assert_close(got, ref, dtype)


@pytest.mark.parametrize("kernel", NORM_KERNELS)
@pytest.mark.parametrize("layout", ["fortran", "strided", "transposed_batch"])
def test_layout_independence(backend, dtype, kernel, layout):
    """Fortran order and strided views give the same answer as contiguous input, untouched."""
    shape = (6, 10)
    base = make_case((2 * shape[0], 2 * shape[1]), dtype, seed=5)
    if layout == "fortran":
        args = [np.asfortranarray(a[: shape[0], : shape[1]]) for a in base[:3]]
    elif layout == "strided":
        args = [a[::2, ::2] for a in base[:3]]
    else:
        args = [a[: shape[1], : shape[0]].T for a in base[:3]]
    gamma, beta = base[3][::2], base[4][1::2]
    assert not args[0].flags.c_contiguous and not gamma.flags.c_contiguous
    copies = [a.copy() for a in (*args, gamma, beta)]
    got = call(kernel, *args, gamma, beta, backend=backend)
    want = call(kernel, *(np.ascontiguousarray(a) for a in (*args, gamma, beta)), backend=backend)
    np.testing.assert_array_equal(got, want)
    for before, after in zip(copies, (*args, gamma, beta)):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("kernel", NORM_KERNELS)
def test_out_argument(backend, dtype, kernel):
    """out= is written and returned; the result equals the allocating call."""
    x, v, u, gamma, beta = make_case((2, 3, 9), dtype, seed=6)
    want = call(kernel, x, v, u, gamma, beta, backend=backend)
    out = np.full(want.shape, np.nan, dtype=dtype)
    got = call(kernel, x, v, u, gamma, beta, backend=backend, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kernel", NORM_KERNELS)
def test_empty_batch(backend, kernel):
    x, v, u, gamma, beta = make_case((0, 5), np.float64)
    got = call(kernel, x, v, u, gamma, beta, backend=backend)
    assert got.shape[0] == 0


@pytest.mark.parametrize("kernel", NORM_KERNELS)
def test_thread_count_does_not_change_bits(compiled, kernel):
    """1 and 2 threads give bit-identical results (each token is one thread's, in fixed order)."""
    shape = (37, 16) if kernel.endswith("_jacobian") else (301, 1000)
    case = make_case(shape, np.float32, seed=8)
    with pe.num_threads(1):
        one = call(kernel, *case, backend=compiled)
    with pe.num_threads(2):
        two = call(kernel, *case, backend=compiled)
    np.testing.assert_array_equal(one, two)


def test_use_backend_context_sets_auto():
    x = make_case((2, 4), np.float64)[0]
    with backends.use_backend("numpy"):
        assert backends.auto_backend("layer_norm") == "numpy"
        pe.layer_norm(x)
    assert backends.auto_backend("layer_norm") in backends.AUTO_ORDER
