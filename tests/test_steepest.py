"""Steepest descent under norms: each direction solves its argmin.

Checks: the dual-norm equality <g, Δ*> = -||g||† ||Δ*|| with ||Δ*|| = lr ||g||†;
optimality against random feasible directions (every t with ||t|| = ||Δ*|| has
<g, t> >= <g, Δ*>, so the objective <g, Δ> + ||Δ||²/(2 lr) is smallest at Δ*, and a
rescaled Δ* is worse); the closed forms of each norm.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine.linalg.steepest import NORMS, dual_norm, norm, steepest_descent


def objective(g, d, which, lr, layout="out_in"):
    return np.sum(g * d, axis=(-2, -1)) + norm(d, which, layout) ** 2 / (2 * lr)


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("which", NORMS)
def test_dual_norm_equality_and_optimality(which, layout):
    rng = np.random.default_rng(0)
    g = rng.standard_normal((3, 12, 20))
    lr = 0.3
    d = steepest_descent(g, which, lr, layout=layout)
    dn = dual_norm(g, which, layout)
    nd = norm(d, which, layout)
    np.testing.assert_allclose(nd, lr * dn, rtol=1e-10)
    np.testing.assert_allclose(np.sum(g * d, axis=(1, 2)), -dn * nd, rtol=1e-10)
    best = objective(g, d, which, lr, layout)
    np.testing.assert_allclose(best, -lr * dn**2 / 2, rtol=1e-10)
    for k in range(200):  # random feasible directions of the same norm
        t = rng.standard_normal(g.shape)
        if k % 2:
            t = np.sign(t) if which == "linf" else t + d / nd[:, None, None]  # near Δ* too
        t *= (nd / norm(t, which, layout))[:, None, None]
        assert np.all(np.sum(g * t, axis=(1, 2)) >= np.sum(g * d, axis=(1, 2)) - 1e-9)
        assert np.all(objective(g, t, which, lr, layout) >= best - 1e-9)
    for c in (0.5, 0.9, 1.1, 2.0):
        assert np.all(objective(g, c * d, which, lr, layout) > best)


def test_closed_forms():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((8, 5))
    np.testing.assert_allclose(steepest_descent(g, "l2", 2.0), -2.0 * g)
    np.testing.assert_allclose(steepest_descent(g, "linf", 1.0), -np.abs(g).sum() * np.sign(g))
    u, s, vt = np.linalg.svd(g, full_matrices=False)
    np.testing.assert_allclose(steepest_descent(g, "spectral"), -s.sum() * u @ vt, atol=1e-12)
    np.testing.assert_allclose(steepest_descent(g, "rms_to_rms"), -(8 / 5) * s.sum() * u @ vt, atol=1e-12)
    np.testing.assert_allclose(steepest_descent(g, "rms_to_rms", layout="in_out"), -(5 / 8) * s.sum() * u @ vt,
                               atol=1e-12)
    assert pe.steepest_descent is steepest_descent


def test_newton_schulz_directions(backend):
    rng = np.random.default_rng(2)
    g = rng.standard_normal((2, 24, 48))
    exact = steepest_descent(g, "spectral")
    conv = steepest_descent(g, "spectral", method="newton_schulz", schedule="hybrid", backend=backend)
    np.testing.assert_allclose(conv, exact, atol=1e-8 * np.abs(exact).max())
    quin = steepest_descent(g, "spectral", method="newton_schulz", backend=backend)
    cos = np.sum(quin * exact, axis=(1, 2)) / np.linalg.norm(quin, axis=(1, 2)) / np.linalg.norm(exact, axis=(1, 2))
    assert np.all(cos > 0.97)  # the quintic's S' in [0.68, 1.13]: close, not equal
    g32 = g.astype(np.float32)
    assert steepest_descent(g32, "spectral", method="newton_schulz", backend=backend).dtype == np.float32


def test_bad_input():
    with pytest.raises(ValueError, match="norm"):
        steepest_descent(np.ones((2, 2)), "l1")
    with pytest.raises(ValueError, match="lr"):
        steepest_descent(np.ones((2, 2)), "l2", -1.0)
    with pytest.raises(ValueError, match="method"):
        steepest_descent(np.ones((2, 2)), "spectral", method="qr")
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        steepest_descent(np.ones(2), "l2")
    with pytest.raises(ValueError, match="layout"):
        steepest_descent(np.ones((2, 2)), "rms_to_rms", layout="rows")
