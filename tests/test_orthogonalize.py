"""The Newton–Schulz kernel: every backend against the reference, and against the SVD polar factor.

Test matrices are Gaussian (m, n) with m != n, so that sigma_min / ||G||_F is about
(sqrt(l) - sqrt(s)) / sqrt(m n) (a few 1e-2): inside the quintic's band of inputs
[3e-3, 1], where it maps every singular value into [0.68, 1.13] (RESEARCH.md B).
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine import backends
from pyengine.kernels.orthogonalize import QUINTIC, newton_schulz_coefficients, orthogonalize

SHAPES = [(1, 16, 40), (3, 40, 16), (2, 24, 24), (1, 1, 9), (2, 9, 1), (4, 2, 3)]


def polar(g):
    u, _, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
    return u @ vt


def gaussian(shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_reference_is_the_polynomial_on_singular_values():
    """X_S = U p(...p(Σ/||G||_F)) Vᵀ: the iteration acts on each singular value alone."""
    g = gaussian((1, 12, 30))[0]
    u, s, vt = np.linalg.svd(g, full_matrices=False)
    x = s / np.linalg.norm(g)
    for a, b, c in newton_schulz_coefficients("quintic"):
        x = a * x + b * x**3 + c * x**5
    got = orthogonalize(g, backend="numpy")
    np.testing.assert_allclose(got, (u * x) @ vt, atol=1e-12)


@pytest.mark.parametrize("schedule", ["quintic", "cubic", "hybrid"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(compiled, dtype, shape, schedule):
    g = gaussian(shape, dtype, seed=sum(shape))
    cf = newton_schulz_coefficients(schedule, 6)
    want, got = np.zeros_like(g), np.full_like(g, np.nan)
    assert backends.resolve("newton_schulz", "numpy")(g, cf, want) == 0
    assert backends.resolve("newton_schulz", compiled)(g, cf, got) == 0
    tol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    assert got.dtype == dtype


@pytest.mark.parametrize("shape", [(3, 32, 64), (2, 64, 32), (1, 48, 48 + 8)], ids=str)
def test_quintic_is_within_its_band(backend, dtype, shape):
    g = gaussian(shape, dtype, seed=1)
    r = orthogonalize(g, "quintic", return_info=True, backend=backend)
    assert r.q.dtype == dtype and r.q.shape == shape
    assert r.sigma.min() > 0.68 - 0.01 and r.sigma.max() < 1.13 + 0.01
    assert r.distance.shape == shape[:1] and np.all(r.distance < 0.33)
    # the singular vectors are the polar factor's: Q = U S' Vᵀ, so <Q, U Vᵀ> = tr S'
    p = polar(g)
    np.testing.assert_allclose(np.sum(r.q * p, axis=(1, 2)), r.sigma.sum(axis=1), rtol=1e-4)


@pytest.mark.parametrize("schedule", ["cubic", "hybrid"])
@pytest.mark.parametrize("shape", [(3, 32, 64), (2, 64, 32), (1, 20, 24)], ids=str)
def test_convergent_schedules_reach_the_polar_factor(backend, shape, schedule):
    g = gaussian(shape, seed=2)
    steps = {"cubic": 30, "hybrid": 12}[schedule]
    r = orthogonalize(g, schedule, steps, return_info=True, backend=backend)
    assert np.abs(r.q - polar(g)).max() < 1e-6
    assert r.distance.max() < 1e-6


def test_float32_hybrid_is_orthogonal_to_float32_rounding(backend):
    g = gaussian((2, 64, 128), np.float32, seed=3)
    r = orthogonalize(g, "hybrid", return_info=True, backend=backend)
    assert r.distance.max() < 1e-4


def test_default_steps_and_custom_coefficients():
    g = gaussian((40, 16), seed=4)
    assert newton_schulz_coefficients("quintic").shape == (5, 3)
    np.testing.assert_array_equal(newton_schulz_coefficients("hybrid", 3), [QUINTIC] * 3)
    a = orthogonalize(g, coeffs=np.array([QUINTIC] * 5), backend="numpy")
    np.testing.assert_array_equal(a, orthogonalize(g, backend="numpy"))


def test_zero_matrix_is_zero_and_scale_free(backend):
    g = np.zeros((2, 5, 7))
    g[1] = gaussian((5, 7))
    q = orthogonalize(g, backend=backend)
    np.testing.assert_array_equal(q[0], 0.0)
    np.testing.assert_allclose(orthogonalize(1e30 * g[1], backend=backend), q[1], atol=1e-12)
    assert pe.orthogonalize is orthogonalize


def test_inputs_are_not_modified_and_any_layout_works(backend):
    g = np.asfortranarray(gaussian((30, 12)))
    before = g.copy()
    q = orthogonalize(g, backend=backend)
    np.testing.assert_array_equal(g, before)
    np.testing.assert_allclose(q, orthogonalize(np.ascontiguousarray(g), backend="numpy"), atol=1e-12)
    out = np.empty((30, 12))
    assert orthogonalize(g, out=out, backend=backend) is out


def test_bad_input():
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        orthogonalize(np.ones(3))
    with pytest.raises(TypeError, match="float32 or float64"):
        orthogonalize(np.ones((3, 3), int))
    g = np.ones((3, 3))
    g[1, 1] = np.nan
    with pytest.raises(ValueError, match="g"):
        orthogonalize(g)
    with pytest.raises(ValueError, match="schedule"):
        orthogonalize(np.ones((3, 3)), "quartic")
    with pytest.raises(ValueError, match="steps"):
        orthogonalize(np.ones((3, 3)), steps=0)
    with pytest.raises(ValueError, match="coeffs"):
        orthogonalize(np.ones((3, 3)), coeffs=np.ones((2, 2)))
    with pytest.raises(ValueError, match="out"):
        orthogonalize(np.ones((3, 3)), out=np.empty((3, 3), np.float32))
    with pytest.raises(ValueError, match="backend"):
        orthogonalize(np.ones((3, 3)), backend="cuda")
