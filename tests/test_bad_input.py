"""One case per bad-input rule of DESIGN.md: each error names the argument and what was given."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from helpers import make_case

X, V, U, GAMMA, BETA = make_case((4, 6), np.float64, seed=0)


@pytest.mark.parametrize(
    ("dtype", "hint"),
    [(np.int64, "astype"), (np.longdouble, "float32"), (np.complex128, "complex"), (np.bool_, "astype"),
     (object, "numeric")],
    ids=["int64", "longdouble", "complex", "bool", "object"],
)
def test_unsupported_dtype(dtype, hint):
    with pytest.raises(TypeError, match=rf"x must be a float32 or float64 array; got dtype .*{hint}"):
        pe.layer_norm(np.ones((2, 4), dtype=dtype))


def test_unsupported_dtype_of_tangent_and_gamma():
    with pytest.raises(TypeError, match="^v must be"):
        pe.layer_norm_jvp(X, np.ones(X.shape, np.int32))
    with pytest.raises(TypeError, match="^gamma must be"):
        pe.rms_norm(X, np.ones(6, np.int32))


@pytest.mark.parametrize("x", [np.float64(1.0), np.ones((3, 1)), np.ones(1)], ids=["scalar", "d1", "1d-d1"])
def test_d_below_two(x):
    with pytest.raises(ValueError, match="^x must have"):
        pe.layer_norm(x)


def test_shape_mismatch_of_tangent():
    with pytest.raises(ValueError, match=r"v must have the shape of x, \(4, 6\); got \(4, 5\)"):
        pe.layer_norm_jvp(X, V[:, :5])
    with pytest.raises(ValueError, match=r"^u must have the shape of x"):
        pe.rms_norm_vjp(X, U[None])


@pytest.mark.parametrize("name", ["gamma", "beta"])
def test_mismatched_gamma_beta(name):
    with pytest.raises(ValueError, match=rf"{name} must have shape \(d,\) = \(6,\) to match x; got \(5,\)"):
        pe.layer_norm(X, **{name: np.ones(5)})


@pytest.mark.parametrize("name", ["gamma", "beta"])
def test_nonfinite_gamma_beta(name):
    bad = np.ones(6)
    bad[2] = np.inf
    with pytest.raises(ValueError, match=rf"{name} contains NaN or Inf \(first at index 2"):
        pe.layer_norm(X, **{name: bad})


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_x(backend, value):
    x = np.ones((2, 3, 6))
    x[1, 2, 4] = value
    with pytest.raises(ValueError, match=r"x contains NaN or Inf \(1 bad row\(s\); first in row \(1, 2\), entry 4"):
        pe.layer_norm(x, backend=backend)
    with pytest.raises(ValueError, match="^x contains NaN"):
        pe.rms_norm_jacobian(x, backend=backend)


@pytest.mark.parametrize("kernel", ["layer_norm_jvp", "layer_norm_vjp", "rms_norm_jvp", "rms_norm_vjp"])
def test_nonfinite_tangent(backend, kernel):
    w = V.copy()
    w[3, 0] = np.nan
    name = "v" if kernel.endswith("jvp") else "u"
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or Inf \(1 bad row\(s\); first in row \(3,\)"):
        getattr(pe, kernel)(X, w, backend=backend)


@pytest.mark.parametrize("eps", [-1e-5, np.nan, np.inf])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        pe.layer_norm(X, eps=eps)


@pytest.mark.parametrize("eps", ["1e-5", None, True])
def test_eps_type(eps):
    with pytest.raises(TypeError, match="eps must be a real number"):
        pe.rms_norm(X, eps=eps)


@pytest.mark.parametrize("kernel", ["layer_norm", "layer_norm_jvp", "layer_norm_vjp", "layer_norm_jacobian"])
def test_zero_variance_row_with_eps_zero(backend, kernel):
    x = X.copy()
    x[2] = 7.0
    args = (x, V) if kernel.endswith(("jvp", "vjp")) else (x,)
    with pytest.raises(ValueError, match=r"x row \(2,\) is constant \(zero variance\) and eps = 0.*use eps > 0"):
        getattr(pe, kernel)(*args, eps=0.0, backend=backend)


@pytest.mark.parametrize("kernel", ["rms_norm", "rms_norm_jvp", "rms_norm_vjp", "rms_norm_jacobian"])
def test_zero_row_rms_with_eps_zero(backend, kernel):
    x = X.copy()
    x[1] = 0.0
    args = (x, V) if kernel.endswith(("jvp", "vjp")) else (x,)
    with pytest.raises(ValueError, match=r"x row \(1,\) is all zeros and eps = 0"):
        getattr(pe, kernel)(*args, eps=0.0, backend=backend)


def test_constant_row_rms_is_fine_with_eps_zero():
    """RMSNorm does not centre: a constant non-zero row is valid."""
    y = pe.rms_norm(np.full((2, 4), -3.0), eps=0.0)
    np.testing.assert_allclose(y, -1.0)


def test_statistics_overflow(backend):
    # A row of 1e300 is not refused (its statistics are taken of the row scaled by a power
    # of two); a tangent whose sums overflow still is, naming both.
    x = np.array([[1e300, -1e300, 0.0, 5.0]])
    np.testing.assert_allclose(pe.layer_norm(x, eps=0, backend=backend),
                               pe.layer_norm(x * 2.0**-1000, eps=0, backend=backend), rtol=1e-15)
    v = np.array([[1e308, 1e308, 1e308, -1e308]])
    with pytest.raises(ValueError, match="statistics overflow float64.*rescale x or v"):
        pe.layer_norm_jvp(np.array([[0.0, 1.0, 2.0, 4.0]]), v, backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'cpp', 'numba', 'numpy'; got 'cuda'"):
        pe.layer_norm(X, backend="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        pe.use_backend("torch").__enter__()


def test_unknown_mode():
    with pytest.raises(ValueError, match="mode must be 'full' or 'frozen_scale'; got 'detached'"):
        pe.layer_norm_jvp(X, V, mode="detached")


def test_dense_jacobian_over_budget_refused_before_allocating():
    x = np.zeros((100_000, 4096), dtype=np.float32)  # untouched zeros: no memory is committed
    with pytest.raises(ValueError, match=r"needs 6250.00 GiB, over the budget max_bytes = 2.00 GiB"):
        pe.layer_norm_jacobian(x)
    with pytest.raises(ValueError, match="over the budget"):
        pe.rms_norm_jacobian(X, max_bytes=100)
    assert pe.rms_norm_jacobian(X, max_bytes=4 * 6 * 6 * 8).shape == (4, 6, 6)
    with pytest.raises(ValueError, match="max_bytes must be a positive number"):
        pe.layer_norm_jacobian(X, max_bytes=-1)


def test_bad_out():
    with pytest.raises(ValueError, match=r"out must have shape \(4, 6\); got \(4, 5\)"):
        pe.layer_norm(X, out=np.empty((4, 5)))
    with pytest.raises(ValueError, match="out must have dtype float64"):
        pe.layer_norm(X, out=np.empty((4, 6), np.float32))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        pe.layer_norm(X, out=np.empty((6, 4)).T)
    ro = np.empty((4, 6))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        pe.layer_norm(X, out=ro)
    with pytest.raises(TypeError, match="out must be a numpy.ndarray; got list"):
        pe.layer_norm(X, out=[[0.0] * 6] * 4)


@pytest.mark.parametrize("victim", ["x", "v", "gamma"])
def test_out_overlapping_an_input(victim):
    x, v, gamma = X.copy(), V.copy(), np.ones((4, 6))
    arrays = {"x": x, "v": v, "gamma": gamma}
    with pytest.raises(ValueError, match="out must not overlap any input array"):
        pe.layer_norm_jvp(x, v, gamma[0], out=arrays[victim])


def test_jacobian_out_shape():
    with pytest.raises(ValueError, match=r"out must have shape \(4, 6, 6\)"):
        pe.layer_norm_jacobian(X, out=np.empty((4, 6)))


def test_errors_leave_inputs_untouched():
    x = X.copy()
    x[0] = 1.0
    before = x.copy()
    with pytest.raises(ValueError):
        pe.layer_norm(x, eps=0.0)
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("d", [3, 768, 4097])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inexact_constant_row_is_constant_on_every_backend(backend, d, dtype):
    """A constant row of 1/3 (its mean rounds) is zero-variance on every backend, whatever
    the summation order: an error with eps = 0, exactly beta with eps > 0."""
    x = np.full((2, d), 1 / 3, dtype=dtype)
    x[0] = np.linspace(0, 1, d)
    with pytest.raises(ValueError, match=r"x row \(1,\) is constant"):
        pe.layer_norm(x, eps=0.0, backend=backend)
    with pytest.raises(ValueError, match=r"x row \(1,\) is constant"):
        pe.layer_norm_jvp(x, np.ones_like(x), eps=0.0, backend=backend)
    beta = np.linspace(-1, 1, d).astype(dtype)
    np.testing.assert_array_equal(pe.layer_norm(x, beta=beta, backend=backend)[1], beta)
    assert not pe.layer_norm_vjp(x, np.ones_like(x), backend=backend)[1].any()
