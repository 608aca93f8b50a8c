"""The attention kernels' BLAS paths and their fallbacks, in both compiled backends: C++
(csrc/attention_blas.hpp; attention_force_fallback forces its register-blocked kernels) and
Numba (kernels/_numba/_attention_blas.py; ``attention.BLAS = False`` forces its row
kernels). Each against the NumPy reference on head-sized shapes (widths >= 16), odd lengths,
Tq != Tk with an offset, batched heads; bit-identical results for any thread count; the
bad-row counts of the raw kernels."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import pyengine as pe
from conftest import require
from pyengine import backends
from pyengine.kernels import attention as pa
from test_attention import assert_close, case, head, visible


@pytest.fixture(scope="module")
def core():
    require("cpp")
    from pyengine import _core

    return _core


@contextlib.contextmanager
def fallback(backend: str, on: bool):
    """The BLAS path of ``backend`` ("cpp" or "numba") switched off inside the block when ``on``."""
    if backend == "cpp":
        from pyengine import _core

        _core.attention_force_fallback(on)
        try:
            yield
        finally:
            _core.attention_force_fallback(False)
    else:
        from pyengine.kernels._numba import attention as na

        na.BLAS = not on
        try:
            yield
        finally:
            na.BLAS = True


PATHS = [False, True]
PATH_IDS = ["blas", "fallback"]


@pytest.fixture(params=["cpp", "numba"])
def compiled(request):
    """A compiled backend (skipped where not built, failed under PYENGINE_REQUIRE)."""
    require(request.param)
    return request.param

# (lead, Tq, Tk, dv, offset): widths >= 16, so the BLAS path serves them; 45 and 97 rows
# leave a partial block of 32; (1,) 37 x 70 with offset 33 is Tq != Tk; 20 x 60 with offset
# 10 leaves keys 30..59 seen by no query (their dk, dv are 0).
SCORE_CASES = [((12,), 128, 128, 64, 0), ((3,), 45, 45, 16, None), ((2, 2), 97, 97, 24, 0),
               ((1,), 37, 70, 20, 33), ((1,), 33, 33, 64, 5), ((2,), 20, 60, 16, 10)]
# (lead, Tq, Tk, dk, dv, offset): C++'s BLAS backward needs n >= 4 or Tq Tk <= 256^2 (the rest
# is its register-blocked kernel); Numba's takes every one of these, the last three in chunks of
# query blocks (_attention_blas.chunk_bounds: 2 per head), the first of them a narrow head.
FUSED_CASES = [((12,), 128, 128, 64, 64, 0), ((4,), 45, 45, 16, 24, None), ((2, 3), 97, 97, 32, 16, 0),
               ((1,), 37, 70, 20, 17, 33), ((5,), 65, 65, 16, 16, 64), ((2,), 20, 60, 16, 16, 10),
               ((1,), 300, 300, 10, 8, 0), ((2,), 260, 300, 16, 16, 40), ((1,), 257, 257, 16, 24, None)]


#: max |error| / max |result| of the float32 backward (float compute, both paths): measured
#: 3.5e-7 .. 6.5e-7 on FUSED_CASES; the bound of test_attention's FLOAT32_CASES at qk_scale 1.
FLOAT32_BOUND = 1.5e-6


def test_blas_path_is_taken_where_numpy_has_openblas(core):
    info = core.attention_blas_info()
    assert info.startswith("BLAS") == (not core.linear_blas_info().startswith("numpy matmul")), info
    with fallback("cpp", True):
        assert "forced" in core.attention_blas_info()
    assert core.attention_blas_info() == info


@pytest.mark.parametrize("forced", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("advantage", [False, True], ids=["grad", "advantage"])
@pytest.mark.parametrize(("lead", "tq", "tk", "dv", "offset"), SCORE_CASES,
                         ids=[f"{c[1]}x{c[2]}x{c[3]}-off{c[4]}" for c in SCORE_CASES])
def test_score_grad_paths_match_the_reference(compiled, dtype, lead, tq, tk, dv, offset, advantage, forced):
    p, u, v = case(lead, tq, tk, dv, offset, dtype, seed=tq + dv)
    if offset is not None:
        p[..., ~visible(tq, tk, offset)] = np.nan  # masked entries are never read
    before = [a.copy() for a in (p, u, v)]
    want = pa.attention_score_grad(np.nan_to_num(p), u, v, offset=offset, advantage=advantage, backend="numpy")
    with fallback(compiled, forced):
        got = pa.attention_score_grad(p, u, v, offset=offset, advantage=advantage, backend=compiled)
    scale = float(np.abs(np.einsum("...id,...jd->...ij", u.astype(np.float64), v)).max())
    for g, w in zip(got if advantage else (got,), want if advantage else (want,)):
        assert g.dtype == dtype and g.shape == p.shape
        assert_close(g, w, dtype, scale=scale)
        if offset is not None:
            assert (g[..., ~visible(tq, tk, offset)] == 0).all()
    for a, b in zip((p, u, v), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("forced", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("lead", "tq", "tk", "dk", "dv", "offset"), FUSED_CASES,
                         ids=[f"{c[1]}x{c[2]}-dk{c[3]}dv{c[4]}-off{c[5]}" for c in FUSED_CASES])
def test_backward_paths_match_the_reference(compiled, dtype, lead, tq, tk, dk, dv, offset, forced):
    q, k, v, d_o = head(lead, tq, tk, dk, dv, dtype, seed=tq + dk)
    before = [a.copy() for a in (q, k, v, d_o)]
    f = pa.attention_forward(q, k, v, offset=offset, backend="numpy")
    want = pa.attention_backward(q, k, v, d_o, f.lse, o=f.out, offset=offset, backend="numpy")
    with fallback(compiled, forced):
        got = pa.attention_backward(q, k, v, d_o, f.lse, o=f.out, offset=offset, backend=compiled)
    for name in ("dq", "dk", "dv", "spread"):
        w = getattr(want, name)
        g = getattr(got, name)
        assert g.shape == w.shape and g.dtype == (np.float64 if name == "spread" else dtype)
        if dtype == np.float64:
            assert_close(g, w, dtype, scale=float(np.abs(w).max()) + 1e-300)
        else:  # both paths compute in float: the bound of test_attention's FLOAT32_CASES (s1)
            err = np.abs(g.astype(np.float64) - w).max() / np.abs(w).max()
            assert err <= FLOAT32_BOUND, (name, err)
    for a, b in zip((q, k, v, d_o), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("forced", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("lead", "tq", "tk", "dk", "dv", "offset"), FUSED_CASES,
                         ids=[f"{c[1]}x{c[2]}-dk{c[3]}dv{c[4]}-off{c[5]}" for c in FUSED_CASES])
def test_numba_forward_paths_match_the_reference(dtype, lead, tq, tk, dk, dv, offset, forced):
    """Numba's forward pass also has a BLAS path (C++'s is the register-blocked kernel alone)."""
    require("numba")
    q, k, v, _ = head(lead, tq, tk, dk, dv, dtype, seed=tq + dv)
    before = [a.copy() for a in (q, k, v)]
    want = pa.attention_forward(q, k, v, offset=offset, backend="numpy")
    with fallback("numba", forced):
        got = pa.attention_forward(q, k, v, offset=offset, backend="numba")
    assert got.out.dtype == dtype and got.out.shape == want.out.shape
    if dtype == np.float32 and not forced:  # the BLAS path computes in float, as the backward test
        err = np.abs(got.out.astype(np.float64) - want.out).max() / np.abs(want.out).max()
        assert err <= FLOAT32_BOUND, err  # 257 x 257 bidirectional: 8.1e-7 (C++ 7.4e-7)
    else:  # the row kernels compute in float64
        assert_close(got.out, want.out, dtype, scale=float(np.abs(want.out).max()))
    for name in ("lse", "entropy"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=0, atol=(1e-12 if dtype == np.float64 else 2e-6) * np.abs(w).max())
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)


def test_numba_blas_path_is_taken_on_head_shapes(monkeypatch):
    """serves() takes every head but the tiny narrow ones, and the dispatch calls the BLAS
    kernels where it says so."""
    require("numba")
    from pyengine.kernels._numba import _attention_blas as nb

    assert nb.serves(128, 128, 64, 64) and nb.serves(2000, 2000, 64, 64) and nb.serves(1, 3, 16, 16)
    assert nb.serves(2000, 2000, 10, 8) and nb.serves(128, 128, 10, 64) and nb.serves(64, 256, 2, 2)
    assert not nb.serves(40, 40, 10, 10) and not nb.serves(127, 128, 64, 8) and not nb.serves(0, 128, 64, 64)
    calls = []
    for name in ("forward", "backward", "score_grad"):
        fn = getattr(nb, name)
        monkeypatch.setattr(nb, name, lambda *a, _f=fn, _n=name: calls.append(_n) or _f(*a))
    q, k, v, d_o = head((4,), 40, 40, 16, 16, np.float32)
    f = pa.attention_forward(q, k, v, offset=0, backend="numba")
    pa.attention_backward(q, k, v, d_o, f.lse, o=f.out, offset=0, backend="numba")
    pa.attention_score_grad(np.ones((4, 40, 40), np.float32), d_o, v, offset=0, backend="numba")
    assert calls == ["forward", "backward", "score_grad"]
    q, k, v, d_o = head((4,), 40, 40, 10, 10, np.float32)  # dk = 10: the row kernels
    pa.attention_forward(q, k, v, offset=0, backend="numba")
    assert calls == ["forward", "backward", "score_grad"]


@pytest.mark.parametrize("offset", [0, None, 37], ids=["causal", "bidirectional", "off37"])
@pytest.mark.parametrize(("n", "t"), [(6, 100), (1, 300)], ids=["heads", "one-head"])
def test_blas_path_threads_do_not_change_results(compiled, dtype, offset, n, t):
    """(1, 300): Numba's backward pass in 2 chunks of query blocks, C++'s register-blocked one."""
    q, k, v, d_o = head((n,), t, t, 16, 24, dtype, seed=4)
    p, u, vv = case((n,), t, t, 24, offset, dtype, seed=4)
    f = pa.attention_forward(q, k, v, offset=offset, backend="numpy")

    def run():
        return (*pa.attention_forward(q, k, v, offset=offset, backend=compiled),
                *pa.attention_backward(q, k, v, d_o, f.lse, o=f.out, offset=offset, backend=compiled),
                *pa.attention_score_grad(p, u, vv, offset=offset, advantage=True, backend=compiled))

    with pe.num_threads(1):
        first = run()
    for nt in (2, 3):
        with pe.num_threads(nt):
            again = run()
        for x, y in zip(first, again):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("forced", PATHS, ids=PATH_IDS)
def test_raw_kernels_count_bad_rows_as_the_reference(compiled, forced):
    """The raw kernels (no validation) count the rows that overflow as the reference does."""
    p, u, v = case((4,), 40, 40, 16, 0, np.float64, seed=1)
    u = u.copy()
    u[1, 3, 0] = np.inf  # row 3 of head 1: b is inf or NaN
    q, k, vv, d_o = head((4,), 40, 40, 16, 16, np.float64, seed=1)
    f = pa.attention_forward(q, k, vv, offset=0, backend="numpy")
    d_o = d_o.copy()
    d_o[2, 5, 1] = np.inf  # row 5 of head 2: D and the advantage not finite
    counts = {}
    for be in ("numpy", compiled):
        with fallback(compiled, forced):
            sg = backends.resolve("attention_score_grad", be)
            bw = backends.resolve("attention_backward", be)
            n1 = sg(p, u, v, 0, np.zeros_like(p))
            outs = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(vv), np.zeros((4, 40))]
            n2 = bw(q, k, vv, f.out, d_o, f.lse, 0, 0.25, *outs)
            qb = q.copy()
            qb[3, 7, 2] = np.inf  # row 7 of head 3: its scores, lse and out are not finite
            fw = backends.resolve("attention_forward", be)
            n3 = fw(qb, k, vv, 0, 0.25, np.zeros((4, 40, 16)), np.zeros((4, 40)), np.zeros((4, 40)))
        counts[be] = (n1, n2, n3)
    assert counts[compiled] == counts["numpy"]
    assert counts[compiled][0] == 1 and counts[compiled][1] >= 1 and counts[compiled][2] == 1


@pytest.mark.parametrize("forced", PATHS, ids=PATH_IDS)
def test_forward_of_huge_scores_matches_the_reference(compiled, dtype, forced):
    """Scores near the dtype's range (all positive, so the row maximum is huge): Numba's BLAS
    forward once padded its rows with m - 2048, which rounds to m itself from |m| ~ 2^35 in
    float32 (2^63 in float64), and each pad then added 1 to z (max error 2.9, no bad row)."""
    q, k, v, _ = head((2,), 100, 100, 16, 16, dtype, seed=4)
    big = 1e5 if dtype == np.float32 else 1e75  # scores of about 1e11, 1e151
    q, k = np.abs(q) * big, np.abs(k) * big
    want = pa.attention_forward(q, k, v, offset=0, backend="numpy")
    assert np.isfinite(want.lse).all() and want.lse.min() > 1e10
    with fallback(compiled, forced):
        got = pa.attention_forward(q, k, v, offset=0, backend=compiled)
    err = np.abs(got.out.astype(np.float64) - want.out).max() / np.abs(want.out).max()
    assert err <= (FLOAT32_BOUND if dtype == np.float32 else 1e-12), err


def test_numba_backward_chunks_cover_the_blocks_by_shape():
    """chunk_bounds: at least JOBS jobs where the blocks allow, >= MIN_BLOCKS blocks per chunk,
    every block once, work split about evenly, the same bounds for the same shape."""
    require("numba")
    from pyengine.kernels._numba import _attention_blas as nb

    for n, tq, tk, offset in [(1, 2000, 2000, 0), (2, 300, 300, 0), (3, 2000, 2000, 0), (4, 2000, 2000, 0),
                              (1, 100, 100, 0), (1, 520, 600, 80), (1, 1000, 1000, 1 << 62), (1, 640, 640, -300)]:
        b = nb.chunk_bounds(n, tq, tk, offset)
        blocks = -(-tq // nb.ROWS)
        nch = b.size - 1
        assert b[0] == 0 and b[-1] == blocks and (np.diff(b) >= 1).all(), (n, tq, b)
        assert nch == max(1, min(blocks // nb.MIN_BLOCKS, -(-nb.JOBS // n))), (n, tq, b)
        np.testing.assert_array_equal(b, nb.chunk_bounds(n, tq, tk, offset))
        if nch > 1 and offset == 0:  # causal: later blocks see more keys, so later chunks are shorter
            assert np.diff(b)[0] > np.diff(b)[-1], b


def test_numba_backward_chunks_count_bad_rows_as_the_reference():
    """One head in chunks (the partials summed afterwards) counts bad rows as the reference."""
    require("numba")
    q, k, v, d_o = head((1,), 300, 300, 16, 16, np.float64, seed=2)
    f = pa.attention_forward(q, k, v, offset=0, backend="numpy")
    d_o = d_o.copy()
    d_o[0, 250, 1] = np.inf  # a row of the second chunk
    counts = []
    for be in ("numpy", "numba"):
        outs = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v), np.zeros((1, 300))]
        counts.append(backends.resolve("attention_backward", be)(q, k, v, f.out, d_o, f.lse, 0, 0.25, *outs))
    assert counts[1] == counts[0] >= 1


def test_bad_input_names_the_argument_on_blas_shapes(compiled):
    q, k, v, d_o = head((4,), 40, 40, 16, 16, np.float64)
    f = pa.attention_forward(q, k, v, offset=0, backend=compiled)
    with pytest.raises(ValueError, match="d_o must have shape"):
        pa.attention_backward(q, k, v, d_o[..., :8], f.lse, o=f.out, offset=0, backend=compiled)
    bad = d_o.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="d_o contains NaN or Inf"):
        pa.attention_backward(q, k, v, bad, f.lse, o=f.out, offset=0, backend=compiled)
    p, u, vv = case((4,), 40, 40, 16, 0, np.float64)
    with pytest.raises(ValueError, match=r"u must have shape .* and v .*got u \(4, 40, 16\), v \(4, 40, 8\)"):
        pa.attention_score_grad(p, u, vv[..., :8], offset=0, backend=compiled)
