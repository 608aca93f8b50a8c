"""The per-call data of Numba's exact sigma_max (``_secular._pole_data``, compiled) against its
NumPy form: delta = gamma^2, the three largest distinct values, their index groups, the
offsets with +inf on the groups, and the two largest indices by a stable sort."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require


def pole_data_numpy(gamma):
    """The NumPy form the compiled function replaced (the specification)."""
    delta = gamma.astype(np.float64) ** 2
    vals = np.unique(delta[delta > 0])[::-1][:3]
    top = np.zeros(3)
    top[: vals.size] = vals
    g1 = np.flatnonzero(delta == top[0]) if top[0] > 0 else np.zeros(0, np.int64)
    g2 = np.flatnonzero(delta == top[1]) if top[1] > 0 else np.zeros(0, np.int64)
    offs = delta[None, :] - top[:, None]
    offs[:, g1] = np.inf
    offs[:, g2] = np.inf
    order = np.argsort(-delta, kind="stable")[:2]
    return delta, top, g1, g2, offs, order


def gammas():
    rng = np.random.default_rng(3)
    yield "random", rng.uniform(0.5, 1.5, 768)
    yield "one", np.array([2.0])
    yield "two-equal", np.array([-1.5, 1.5])
    yield "zeros", np.zeros(5)
    yield "constant", np.full(7, 0.3)
    tied = rng.choice([0.0, -0.5, 0.5, 1.0, -2.0, 2.0, 0.25], size=97)
    yield "ties-and-zeros", tied
    yield "two-values", np.array([0.0, 1.0, 0.0, 1.0, 3.0])
    yield "descending", np.linspace(2.0, 0.1, 33)
    yield "tiny", np.array([1e-160, -3e-160, 2e-160])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("name", "gamma"), list(gammas()), ids=[n for n, _ in gammas()])
def test_compiled_pole_data_is_the_numpy_form(name, gamma, dtype):
    require("numba")
    from pyengine.kernels._numba._secular import _pole_data

    g = gamma.astype(dtype)
    before = g.copy()
    got = _pole_data(g)
    want = pole_data_numpy(g)
    for a, b, what in zip(got, want, ("delta", "top", "g1", "g2", "offs", "order")):
        assert a.shape == b.shape, (what, a.shape, b.shape)
        np.testing.assert_array_equal(a, b, err_msg=what)
    assert got[2].dtype == got[3].dtype == got[5].dtype == np.int64
    np.testing.assert_array_equal(g, before)
