"""Hypothesis invariants of the normalization kernels, on every backend."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pyengine as pe

SETTINGS = settings(max_examples=40, deadline=None)
finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def rows(draw):
    n = draw(st.integers(1, 4))
    d = draw(st.integers(2, 24))
    x = draw(hnp.arrays(np.float64, (n, d), elements=finite))
    v = draw(hnp.arrays(np.float64, (n, d), elements=finite))
    u = draw(hnp.arrays(np.float64, (n, d), elements=finite))
    gamma = draw(hnp.arrays(np.float64, (d,), elements=st.floats(-3, 3)))
    return x, v, u, gamma


@SETTINGS
@given(rows())
def test_layer_norm_standardizes(backend, case):
    x, *_ = case
    y = pe.layer_norm(x, eps=1e-5, backend=backend)
    var = x.var(-1)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-9)
    np.testing.assert_allclose(y.var(-1), var / (var + 1e-5), rtol=1e-8, atol=1e-12)


@SETTINGS
@given(rows(), st.sampled_from(["full", "frozen_scale"]), st.sampled_from(["layer_norm", "rms_norm"]))
def test_jvp_is_jacobian_times_v_and_adjoint_to_vjp(backend, case, mode, norm):
    x, v, u, gamma = case
    jac = getattr(pe, norm + "_jacobian")(x, gamma, 1e-3, mode, backend=backend)
    jv = getattr(pe, norm + "_jvp")(x, v, gamma, 1e-3, mode, backend=backend)
    jtu = getattr(pe, norm + "_vjp")(x, u, gamma, 1e-3, mode, backend=backend)
    scale = np.abs(jac).max(initial=1.0) * (np.abs(v).max(initial=1.0) + np.abs(u).max(initial=1.0))
    np.testing.assert_allclose(jv, np.einsum("nij,nj->ni", jac, v), atol=1e-10 * scale)
    np.testing.assert_allclose((jv * u).sum(-1), (v * jtu).sum(-1), atol=1e-9 * scale * x.shape[1])


@SETTINGS
@given(rows(), st.floats(1e-3, 1e3))
def test_layer_norm_is_scale_invariant_without_eps(backend, case, c):
    x, *_ = case
    assume(x.var(-1).min() > 1e-6 * max(1.0, np.abs(x).max()) ** 2)  # no (nearly) constant rows
    np.testing.assert_allclose(
        pe.layer_norm(c * x, eps=0.0, backend=backend), pe.layer_norm(x, eps=0.0, backend=backend),
        rtol=1e-7, atol=1e-8,
    )
