"""Hypothesis invariants of the normalization kernels, on every backend."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pyengine as pe
from helpers import tangent_scale

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


# -- the classes behind the reliability cases of test_reliability.py ----------------------

NORM_CALLS = {
    "layer_norm": lambda x, v, b: pe.layer_norm(x, eps=0.0, backend=b),
    "rms_norm": lambda x, v, b: pe.rms_norm(x, eps=0.0, backend=b),
    "layer_norm_jvp": lambda x, v, b: pe.layer_norm_jvp(x, v, eps=0.0, backend=b),
    "layer_norm_vjp": lambda x, v, b: pe.layer_norm_vjp(x, v, eps=0.0, backend=b),
    "rms_norm_jvp": lambda x, v, b: pe.rms_norm_jvp(x, v, eps=0.0, backend=b),
    "rms_norm_vjp": lambda x, v, b: pe.rms_norm_vjp(x, v, eps=0.0, backend=b),
}


@SETTINGS
@given(seed=st.integers(0, 2**31), d=st.integers(2, 80), k=st.integers(-500, 500), kernel=st.sampled_from(sorted(NORM_CALLS)))
def test_eps0_scale_invariance_at_extreme_scales(backend, seed, d, k, kernel):
    """With eps = 0 a row scaled by 2^k (exact) normalizes to the same output (forward) and
    its JVP/VJP scales by 2^-k, to a few ulps, for |k| <= 500 on every backend."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, d)) * rng.lognormal(0, 1, (3, 1))
    assume((x.max(axis=1) > x.min(axis=1)).all())
    v = rng.standard_normal((3, d))
    call = NORM_CALLS[kernel]
    ref = call(x, v, backend)
    got = call(np.ldexp(x, k), v, backend)
    if kernel.endswith(("jvp", "vjp")):
        got = np.ldexp(got, k)
    # Yardstick: the size of the terms the result adds up (a JVP can cancel to rounding noise,
    # e.g. LayerNorm's for d = 2): |xh| <= sqrt(d) forward, |v| / scale for the JVP/VJP.
    norm = "layer_norm" if kernel.startswith("layer") else "rms_norm"
    size = tangent_scale(norm, x, v, np.ones(d), eps=0.0) if kernel.endswith(("jvp", "vjp")) else np.sqrt(d)
    np.testing.assert_allclose(got, ref, rtol=0, atol=32 * np.finfo(np.float64).eps * size)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 4), eps=st.sampled_from([0.0, 1e-5, 1.0]),
       gamma_kind=st.sampled_from(["ones", "random"]), method=st.sampled_from(["exact", "power", "lanczos"]))
def test_d2_and_constant_rows_in_every_spectral_method(backend, seed, n, eps, gamma_kind, method):
    """d = 2 (J = 0 when eps = 0: sigma 0, converged) and constant rows (eps > 0) give the exact
    answer from every method, with no warning, and a residual that agrees with converged."""
    rng = np.random.default_rng(seed)
    for d, x in ((2, rng.standard_normal((n, 2))), (8, np.repeat(rng.standard_normal((n, 1)), 8, axis=1))):
        if eps == 0 and d == 8:
            continue  # a constant row with eps = 0 is refused (its own test)
        g = np.ones(d) if gamma_kind == "ones" else rng.lognormal(0, 0.5, d)
        for fn in (pe.layer_norm_spectral_norm, pe.rms_norm_spectral_norm):
            exact = pe.layer_norm_spectral_norm(x, g, eps, method="exact", backend="numpy").sigma \
                if fn is pe.layer_norm_spectral_norm else None
            r = fn(x, g, eps, method=method, backend=backend, tol=1e-8, max_iter=200)
            assert np.isfinite(r.sigma).all() and np.isfinite(r.upper).all()
            assert (r.converged == (r.residual <= r.tol)).all()
            assert (r.iterations <= 200).all()
            if exact is not None and r.converged.all():
                np.testing.assert_allclose(r.sigma, exact, rtol=1e-6, atol=1e-12)
            if fn is pe.layer_norm_spectral_norm and d == 2 and eps == 0:
                assert (r.sigma == 0).all() and (r.upper == 0).all() and r.converged.all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 5), d=st.integers(2, 24), max_iter=st.integers(1, 60),
       tol=st.sampled_from([1e-3, 1e-6, 1e-10, 1e-14]), method=st.sampled_from(["power", "lanczos"]),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_every_solver_keeps_its_contract(seed, n, d, max_iter, tol, method, dtype):
    """iterations <= max_iter and converged == (residual <= tol): spectral_norm (dense and norm
    Jacobian operators, power and Lanczos) and spectral_radius; no warnings."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(dtype)
    g = rng.lognormal(0, 0.5, d).astype(dtype)
    for r in (pe.layer_norm_spectral_norm(x, g, method=method, max_iter=max_iter, tol=tol),
              pe.rms_norm_spectral_norm(x, g, method=method, max_iter=max_iter, tol=tol),
              pe.spectral_norm(rng.standard_normal((n, d, d)).astype(dtype), method=method, max_iter=max_iter,
                               tol=tol)):
        assert (r.iterations <= max_iter).all() and (r.iterations >= 1).all()
        assert (r.converged == (r.residual <= tol)).all()
    if d >= 3:
        rr = pe.spectral_radius(rng.standard_normal((n, d, d)), max_iter=max_iter, tol=min(tol, 1e-3))
        assert (rr.converged == (rr.residual <= rr.tol)).all()


@settings(max_examples=15, deadline=None)
@given(k=st.integers(-1000, 1000), seed=st.integers(0, 2**31), linearized=st.booleans())
def test_propagate_directions_of_extreme_norm(k, seed, linearized):
    """A direction is normalized exactly whatever its norm (2^-1000 .. 2^1000): |delta| at the
    injection is the scale."""
    model = _small_stack()
    v = np.ldexp(np.random.default_rng(seed).standard_normal(model.config.d_model), k)
    p = pe.propagate(model, np.arange(6) % 50, v, 0.5, 1, linearized=linearized)
    np.testing.assert_allclose(p.delta_norm[0], 0.5, rtol=1e-14)


_STACK = []


def _small_stack():
    if not _STACK:
        _STACK.append(pe.init_weights(pe.StackConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=50), seed=0))
    return _STACK[0]
