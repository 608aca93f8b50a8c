"""Softmax and its JVP: the reference against the definition and finite differences, every
backend against the reference, identities, awkward scores, rows of any length, bad input
(the MLP activations, and what the two families share, are in test_activations.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from pyengine import backends
from pyengine.kernels import activations as pa
from conftest import require
from helpers import assert_rounded as assert_close, naive_softmax, scores, visible_mask

X = scores((2, 3, 4), np.float64, seed=19)

# --------------------------------------------------------------------------- the reference

SOFTMAX_CASES = [  # (N, Tq, Tk), offset
    ((1, 1, 1), 0), ((3, 1, 1), None), ((2, 5, 5), 0), ((2, 5, 7), 2), ((2, 4, 9), None),
    ((1, 6, 6), 3), ((3, 17, 33), 16), ((2, 33, 33), 0), ((1, 9, 130), 0), ((2, 64, 64), None),
]

@pytest.mark.parametrize(("shape", "offset"), SOFTMAX_CASES, ids=lambda v: str(v))
def test_reference_softmax_is_the_definition(shape, offset):
    x = scores(shape, np.float64, seed=sum(shape))
    got = pa.softmax(x, offset=offset, backend="numpy")
    np.testing.assert_allclose(got, naive_softmax(x, offset), rtol=1e-14, atol=1e-16)

@pytest.mark.parametrize(("shape", "offset"), [((2, 5, 5), 0), ((2, 4, 7), 3), ((1, 6, 6), None)])
def test_reference_softmax_jvp_is_the_central_difference(shape, offset):
    rng = np.random.default_rng(3)
    x = scores(shape, np.float64, seed=4)
    dx = rng.standard_normal((2,) + shape)
    p = pa.softmax(x, offset=offset, backend="numpy")
    h = 1e-6
    fd = np.stack([(pa.softmax(x + h * d, offset=offset, backend="numpy")
                    - pa.softmax(x - h * d, offset=offset, backend="numpy")) / (2 * h) for d in dx])
    np.testing.assert_allclose(pa.softmax_jvp(p, dx, backend="numpy"), fd, rtol=1e-7, atol=1e-9)

# --------------------------------------------------------------------------- every backend vs the reference

@pytest.mark.parametrize(("shape", "offset"), SOFTMAX_CASES, ids=lambda v: str(v))
def test_softmax_matches_reference(compiled, dtype, shape, offset):
    x = scores(shape, dtype, seed=sum(shape))
    ref = pa.softmax(x, offset=offset, backend="numpy")
    got = pa.softmax(x, offset=offset, backend=compiled)
    assert got.dtype == dtype and got.shape == shape
    assert_close(got, ref, dtype, scale=1.0)
    np.testing.assert_array_equal(got[..., ~visible_mask(*shape[1:], offset)], 0.0)

@pytest.mark.parametrize(("p_shape", "dx_shape"), [
    ((1, 1, 1), (1, 1, 1)), ((2, 5, 5), (2, 5, 5)), ((2, 5, 5), (3, 2, 5, 5)),
    ((1, 3, 7, 7), (4, 3, 7, 7)), ((3, 9, 130), (2, 3, 9, 130)), ((1, 1, 33, 33), (2, 5, 1, 33, 33)),
], ids=str)
def test_softmax_jvp_matches_reference(compiled, dtype, p_shape, dx_shape):
    p = pa.softmax(scores(p_shape, dtype, seed=5), offset=0)
    dx = np.random.default_rng(6).standard_normal(dx_shape).astype(dtype)
    ref = pa.softmax_jvp(p, dx, backend="numpy")
    got = pa.softmax_jvp(p, dx, backend=compiled)
    assert got.dtype == dtype and got.shape == dx_shape
    assert_close(got, ref, dtype, scale=np.abs(dx).max())  # judged by its terms: it cancels

# --------------------------------------------------------------------------- identities and awkward scores, every backend

@pytest.mark.parametrize(("shape", "offset"), [((3, 7, 7), 0), ((2, 5, 9), 4), ((2, 6, 11), None)])
def test_softmax_identities(backend, dtype, shape, offset):
    """Rows sum to 1 over the visible keys, masked keys are exactly 0, a per-row shift changes nothing."""
    x = scores(shape, dtype, seed=7)
    p = pa.softmax(x, offset=offset, backend=backend)
    vis = visible_mask(*shape[1:], offset)
    np.testing.assert_array_equal(p[..., ~vis], 0.0)
    assert (p[..., vis] > 0).all()
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=4 * np.finfo(dtype).eps * shape[-1])
    shifted = pa.softmax(x + np.array(2.0, dtype) * np.arange(shape[1], dtype=dtype)[:, None], offset=offset,
                         backend=backend)
    assert_close(shifted, p, dtype, scale=1.0)

def test_softmax_jvp_identities(backend, dtype):
    """JVP rows sum to 0; entries where p = 0 (masked) are exactly 0."""
    p = pa.softmax(scores((2, 6, 6), dtype, seed=8), offset=0)
    dx = np.random.default_rng(9).standard_normal((3, 2, 6, 6)).astype(dtype)
    dp = pa.softmax_jvp(p, dx, backend=backend)
    np.testing.assert_array_equal(dp[..., ~visible_mask(6, 6, 0)], 0.0)
    np.testing.assert_allclose(dp.sum(-1), 0.0, atol=10 * np.finfo(dtype).eps)
    # A tangent along the row (a shift of the scores) does not move the softmax.
    np.testing.assert_allclose(pa.softmax_jvp(p, np.ones_like(dx), backend=backend), 0.0,
                               atol=10 * np.finfo(dtype).eps)

@pytest.mark.parametrize("case", ["huge", "tiny", "equal", "caller_masked", "one_visible"])
def test_softmax_awkward_scores(backend, dtype, case):
    x = scores((2, 4, 6), dtype, seed=10)
    if case == "huge":  # +-1e4: one key takes everything, nothing overflows
        x = np.where(x > 0, 1e4, -1e4).astype(dtype)
        x[..., 0] = 1e4
    elif case == "tiny":
        x = (x * 1e-30).astype(dtype)
    elif case == "equal":
        x[...] = 7.0
    elif case == "caller_masked":  # -inf = masked by the caller (a padding mask): exactly 0
        x[..., 1:3] = -np.inf
    else:
        x[..., 1:] = -np.inf
    got = pa.softmax(x, backend=backend)
    assert np.isfinite(got).all()
    assert_close(got, pa.softmax(x.astype(np.float64), backend="numpy"), dtype, scale=1.0)
    if case == "equal":
        np.testing.assert_allclose(got, 1.0 / 6, rtol=2 * np.finfo(dtype).eps)
    if case == "caller_masked":
        np.testing.assert_array_equal(got[..., 1:3], 0.0)
    if case == "one_visible":
        np.testing.assert_array_equal(got[..., 0], 1.0)
        np.testing.assert_array_equal(got[..., 1:], 0.0)

def test_softmax_masked_entries_are_never_read(backend):
    x = scores((2, 5, 5), np.float64, seed=11)
    x2 = x.copy()
    x2[..., ~visible_mask(5, 5, 0)] = np.nan
    np.testing.assert_array_equal(pa.softmax(x2, offset=0, backend=backend),
                                  pa.softmax(x, offset=0, backend=backend))

@pytest.mark.parametrize("tk", [7, 100, 130])
def test_softmax_rows_of_any_length(backend, dtype, tk):
    """The Numba kernel reads a row's visible scores rounded up to 64, into the next row (or,
    for the last rows, a staging copy). Masked keys that are +inf there, bad rows next to
    good ones, the last row bad, and in place on two threads: each row as when alone."""
    x = scores((3, 9, tk), dtype, seed=tk)
    x[0, 2, :] = np.nan  # a bad row; the row before reads into it
    x[1, 4, 1] = np.inf  # a bad row
    x[-1, -1, 0] = np.nan  # the very last row bad (the staged tail)
    x[..., ~visible_mask(9, tk, 3)] = np.inf  # the masked keys: never part of a result
    kernel = pa.kernel("softmax", backend)
    want = np.empty_like(x)
    for i in range(3):
        kernel(x[i:i + 1].copy(), 3, want[i:i + 1])
    with backends.num_threads(2):
        got = np.empty_like(x)
        assert kernel(x, 3, got) == 3
        y = x.copy()
        assert kernel(y, 3, y) == 3
    for z in (got, y):
        np.testing.assert_array_equal(np.isnan(z).all(-1), np.isnan(want).all(-1))
        np.testing.assert_array_equal(z[~np.isnan(want)], want[~np.isnan(want)])
    good = np.ones((3, 9), bool)
    good[0, 2] = good[1, 4] = good[-1, -1] = False
    ref = np.empty_like(x, dtype=np.float64)
    pa.kernel("softmax", "numpy")(x.astype(np.float64), 3, ref)
    assert np.isnan(want[~good]).all()
    assert_close(want[good], ref[good], dtype, scale=1.0)

def test_raw_softmax_of_empty_rows(compiled):
    """Rows of Tk = 0 (the public layer refuses them) are bad rows, not a crash, in both backends."""
    x = np.zeros((2, 3, 0), np.float32)
    assert pa.kernel("softmax", compiled)(x, 0, x.copy()) == 6

_BOUNDS = """
import numpy as np
from pyengine.kernels import activations as pa
k = pa.kernel("softmax", "numba")
for tk in (7, 100, 130, 128):
    for dt in (np.float32, np.float64):
        x = np.random.default_rng(tk).standard_normal((2, 5, tk)).astype(dt)
        out = np.empty_like(x)
        assert k(x, 0, out) == 0 and k(x, tk, out) == 0
"""

def test_softmax_reads_stay_inside_x(tmp_path):
    """The Numba softmax's reach into the next row never leaves x: recompiled with Numba's
    bounds checks (NUMBA_BOUNDSCHECK=1, in a fresh process and cache), any read past the
    last row raises. About 15 s of compilation."""
    require("numba")
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _BOUNDS], env=env, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]

def test_offsets_mean_what_they_say(backend):
    """offset >= Tk - 1 is no mask; a causal suffix equals the last rows of the full causal softmax."""
    x = scores((2, 9, 9), np.float64, seed=12)
    full = pa.softmax(x, backend=backend)
    np.testing.assert_array_equal(pa.softmax(x, offset=8, backend=backend), full)
    np.testing.assert_array_equal(pa.softmax(x, offset=10**30, backend=backend), full)
    causal = pa.softmax(x, offset=0, backend=backend)
    np.testing.assert_array_equal(pa.softmax(x[:, 5:], offset=5, backend=backend), causal[:, 5:])

# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize(("offset", "exc", "msg"), [
    (-1, ValueError, "offset must be >= 0"), (1.0, TypeError, "offset must be None or an int"),
    (True, TypeError, "offset must be None or an int"), ("0", TypeError, "offset must be None"),
])
def test_bad_offset(offset, exc, msg):
    with pytest.raises(exc, match=f"^{msg}"):
        pa.softmax(X, offset=offset)

def test_numpy_integer_offset_is_fine():
    np.testing.assert_array_equal(pa.softmax(X, offset=np.int64(1)), pa.softmax(X, offset=1))

@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_visible_scores(backend, value):
    x = X.copy()
    x[1, 2, 1] = value
    with pytest.raises(ValueError, match=r"^x contains NaN or \+Inf among the visible scores \(1 bad row\(s\); "
                                         r"first in row \(1, 2\), key 1"):
        pa.softmax(x, offset=0, backend=backend)

def test_row_without_a_finite_visible_score(backend):
    x = X.copy()
    x[0, 1, :2] = -np.inf  # query 1 sees keys 0 and 1 only
    with pytest.raises(ValueError, match=r"^x row \(0, 1\) has no finite visible score \(all -inf\)"):
        pa.softmax(x, offset=0, backend=backend)
    x[0, 1, 2:] = 0.0  # ... but without a mask it sees finite keys
    assert np.isfinite(pa.softmax(x, backend=backend)).all()

@pytest.mark.parametrize("name", ["p", "dx"])
def test_nonfinite_jvp_input(backend, name):
    p = pa.softmax(X, offset=0)
    dx = np.ones((2,) + X.shape)
    (p if name == "p" else dx)[..., 1, 3] = np.nan
    where = r"\(0, 1\)" if name == "p" else r"\(0, 0, 1\)"
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or Inf \(\d+ bad row\(s\); first in row {where}, entry 3"):
        pa.softmax_jvp(p, dx, backend=backend)
