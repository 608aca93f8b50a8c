"""The NumPy reference against central finite differences and the identities of DESIGN.md."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from helpers import make_case

REF = "numpy"
NORMS = ("layer_norm", "rms_norm")
SHAPES = [(4, 2), (3, 3), (5, 7), (2, 33)]


def _fwd(norm, x, gamma, beta, eps):
    if norm == "layer_norm":
        return pe.layer_norm(x, gamma, beta, eps, backend=REF)
    return pe.rms_norm(x, gamma, eps, backend=REF)


def _frozen_fwd(norm, x, gamma, beta, eps, x0):
    """The norm with its scale computed at x0 and held fixed (the frozen_scale map)."""
    if norm == "layer_norm":
        s = np.sqrt(x0.var(-1, keepdims=True) + eps)
        return gamma * (x - x.mean(-1, keepdims=True)) / s + beta
    r = np.sqrt(np.mean(x0 * x0, -1, keepdims=True) + eps)
    return gamma * x / r


def _jac(norm, x, gamma, eps, mode="full"):
    return getattr(pe, norm + "_jacobian")(x, gamma, eps, mode, backend=REF)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("mode", ["full", "frozen_scale"])
@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.3])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_jacobian_matches_finite_differences(norm, mode, eps, shape):
    x, _, _, gamma, beta = make_case(shape, np.float64, seed=1)
    jac = _jac(norm, x, gamma, eps, mode)
    h = 1e-6
    fd = np.empty_like(jac)
    for j in range(shape[-1]):
        e = np.zeros(shape[-1])
        e[j] = h
        if mode == "full":
            fp, fm = _fwd(norm, x + e, gamma, beta, eps), _fwd(norm, x - e, gamma, beta, eps)
        else:
            fp, fm = (_frozen_fwd(norm, x + s * e, gamma, beta, eps, x) for s in (1, -1))
        fd[..., :, j] = (fp - fm) / (2 * h)
    np.testing.assert_allclose(jac, fd, rtol=1e-7, atol=1e-7 * max(np.abs(jac).max(), 1.0))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("mode", ["full", "frozen_scale"])
@pytest.mark.parametrize("shape", [(3, 2), (4, 5), (2, 3, 64)], ids=str)
def test_reference_jvp_vjp_agree_with_dense_jacobian(norm, mode, shape):
    x, v, u, gamma, _ = make_case(shape, np.float64, seed=2)
    jac = _jac(norm, x, gamma, 1e-5, mode)
    jv = getattr(pe, norm + "_jvp")(x, v, gamma, 1e-5, mode, backend=REF)
    jtu = getattr(pe, norm + "_vjp")(x, u, gamma, 1e-5, mode, backend=REF)
    np.testing.assert_allclose(jv, np.einsum("...ij,...j->...i", jac, v), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(jtu, np.einsum("...ij,...i->...j", jac, u), rtol=1e-12, atol=1e-12)
    # adjoint identity <Jv, u> = <v, J^T u>, per token
    np.testing.assert_allclose((jv * u).sum(-1), (v * jtu).sum(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["full", "frozen_scale"])
@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_reference_layer_norm_annihilates_ones(mode, eps):
    x, _, _, gamma, _ = make_case((6, 17), np.float64, seed=3)
    ones = np.ones_like(x)
    jv = pe.layer_norm_jvp(x, ones, gamma, eps, mode, backend=REF)
    assert np.abs(jv).max() < 1e-13


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_reference_layer_norm_centred_input_identity(eps):
    """J (x - mu) = (gamma/s)(x - mu) eps/(var + eps): zero when eps = 0 (0-homogeneity)."""
    x, _, _, gamma, _ = make_case((6, 17), np.float64, seed=4, scale=0.7)
    xc = x - x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    s = np.sqrt(var + eps)
    expected = gamma / s * xc * eps / (var + eps)
    got = pe.layer_norm_jvp(x, xc, gamma, eps, backend=REF)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_reference_rms_norm_radial_identity(eps):
    """RMSNorm: J x = (gamma/r) x eps/(ms + eps)."""
    x, _, _, gamma, _ = make_case((6, 17), np.float64, seed=5)
    ms = np.mean(x * x, -1, keepdims=True)
    expected = gamma / np.sqrt(ms + eps) * x * eps / (ms + eps)
    got = pe.rms_norm_jvp(x, x, gamma, eps, backend=REF)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("d", [3, 4, 9, 64])
@pytest.mark.parametrize("g", [1.0, -2.5, 0.3])
def test_reference_sigma_max_constant_gamma(d, g):
    """For gamma = g and d >= 3: sigma_max(J) = |g| / s exactly."""
    x, _, _, _, _ = make_case((5, d), np.float64, seed=6, loc=3.0, scale=2.0)
    eps = 1e-3
    jac = _jac("layer_norm", x, np.full(d, g), eps)
    sigma = np.linalg.svd(jac, compute_uv=False)[:, 0]
    s = np.sqrt(x.var(-1) + eps)
    np.testing.assert_allclose(sigma, abs(g) / s, rtol=1e-12)


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_reference_layer_norm_output_is_standardized(eps):
    x, _, _, _, _ = make_case((7, 50), np.float64, seed=7, loc=-4.0, scale=3.0)
    y = pe.layer_norm(x, eps=eps, backend=REF)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-14)
    var = x.var(-1)
    np.testing.assert_allclose(y.var(-1), var / (var + eps), rtol=1e-12)


def test_reference_rms_norm_output_has_unit_rms():
    x, _, _, _, _ = make_case((7, 50), np.float64, seed=8)
    y = pe.rms_norm(x, eps=0.0, backend=REF)
    np.testing.assert_allclose(np.sqrt(np.mean(y * y, -1)), 1.0, rtol=1e-13)


@pytest.mark.parametrize("norm", NORMS)
def test_reference_float32_is_float64_math_rounded(norm):
    """The float32 reference is the float64 computation on the same values, rounded once."""
    x, _, _, gamma, beta = make_case((9, 31), np.float32, seed=9, loc=1e4)
    y32 = _fwd(norm, x, gamma, beta, 1e-5)
    y64 = _fwd(norm, x.astype(np.float64), gamma.astype(np.float64), beta.astype(np.float64), 1e-5)
    assert y32.dtype == np.float32
    np.testing.assert_array_equal(y32, y64.astype(np.float32))
