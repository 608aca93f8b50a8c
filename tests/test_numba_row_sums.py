"""The Numba row-sum intrinsic (``_formula.row_sums``): its documented order, bit for bit.

The norm kernels' row sums and the secular solver's bulk passes are LLVM vector code built by
``row_sums``; ``_formula.ordered_sums`` computes the same sums in NumPy in the documented
order. Compiled sums must equal it exactly (any other order of the float64 additions differs
in the last bits on random data), not depend on the alignment of the rows, and stay close
to the exactly rounded sum.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import require


def _terms():
    """(name, terms, nsums, number of arrays, scalars): the forms the kernels use."""
    from pyengine.kernels._numba import _secular

    return [
        ("x", lambda x: (x,), 1, 1, ()),
        ("x, w", lambda x, w: (x, w), 2, 2, ()),
        ("x, g u", lambda x, g, u: (x, g * u), 2, 3, ()),
        ("(x - c)^2", lambda x, c: ((x - c) * (x - c),), 1, 1, (0.75,)),
        ("(x - c)^2, (x - c) g u", lambda x, g, u, c: ((x - c) * (x - c), (x - c) * (g * u)), 2, 3, (-0.5,)),
        ("LayerNorm bulk", _secular._ln2_terms, 6, 2, (0.25, 0.125, 1.0)),
    ]


def _compiled(terms, nsums, vectors):
    from numba import njit

    from pyengine.kernels._numba._formula import row_sums

    sums = row_sums(terms, nsums, vectors)

    @njit
    def run(arrays, scalars):
        return sums(arrays, scalars)

    return run


@pytest.mark.parametrize("vectors", [1, 2, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_row_sums_follow_their_documented_order(vectors, dtype):
    require("numba")
    from pyengine.kernels._numba._formula import ordered_sums

    rng = np.random.default_rng(11)
    for name, terms, nsums, narrays, scalars in _terms():
        run = _compiled(terms, nsums, vectors)
        for d in (1, 3, 4, 15, 16, 17, 63, 300, 771):
            arrays = tuple((rng.standard_normal(d) * 10.0 ** rng.integers(-3, 4, d) + (k == 0)).astype(dtype)
                           for k in range(narrays))
            if name == "LayerNorm bulk":  # offsets e > 0, as the solver's
                arrays = (arrays[0], np.abs(arrays[1]) + 0.5)
            keep = [a.copy() for a in arrays]
            got = run(arrays, scalars)
            want = ordered_sums(terms, nsums, vectors, arrays, scalars)
            assert got == want, (name, d)
            for a, k in zip(arrays, keep):
                np.testing.assert_array_equal(a, k)
            # and close to the exactly rounded sums of the float64 terms
            cols = [np.asarray(a, np.float64) for a in arrays]
            for s, y in zip(got, terms(*cols, *map(np.float64, scalars))):
                assert abs(s - math.fsum(y)) <= 1e-14 * math.fsum(np.abs(y)), (name, d)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_norm_row_sums_are_the_documented_sums(dtype):
    """The norm kernels' helpers (``_reduce._sum`` .. ``_sum_sq_dot_gu``) are these sums in
    this order: the module's own intrinsics, through the helpers the kernels call."""
    require("numba")
    from numba import njit

    from pyengine.kernels._numba import _formula as F
    from pyengine.kernels._numba import _reduce as R

    @njit
    def helpers(x, w, g, c):
        return (R._sum(x), R._sum_pair(x, w), R._sum_pair_gu(x, g, w), R._sum_sq(x, c),
                R._sum_sq_dot(x, c, w), R._sum_sq_dot_gu(x, c, g, w))

    rng = np.random.default_rng(7)
    for d in (2, 19, 768, 771):
        x, w, g = (rng.standard_normal(d).astype(dtype) + 0.5 for _ in range(3))
        c = 0.375
        got = helpers(x, w, g, c)
        spec = [
            F.ordered_sums(lambda x: (x,), 1, 4, (x,), ()),
            F.ordered_sums(lambda x, w: (x, w), 2, 4, (x, w), ()),
            F.ordered_sums(lambda x, g, u: (x, g * u), 2, 4, (x, g, w), ()),
            F.ordered_sums(lambda x, c: ((x - c) * (x - c),), 1, 4, (x,), (c,)),
            F.ordered_sums(lambda x, w, c: ((x - c) * (x - c), (x - c) * w), 2, 4, (x, w), (c,)),
            F.ordered_sums(lambda x, g, u, c: ((x - c) * (x - c), (x - c) * (g * u)), 2, 4, (x, g, w), (c,)),
        ]
        assert got[0] == spec[0][0] and got[3] == spec[3][0], d
        for k in (1, 2, 4, 5):
            assert got[k] == spec[k], (k, d)


def test_row_sums_do_not_depend_on_alignment():
    """Rows at every offset from a 64-byte boundary give the same sums (unaligned loads, no
    alignment-dependent head)."""
    require("numba")
    terms = lambda x, g, u, c: ((x - c) * (x - c), (x - c) * (g * u))  # noqa: E731
    run = _compiled(terms, 2, 4)
    rng = np.random.default_rng(3)
    base = [rng.standard_normal(400).astype(np.float32) for _ in range(3)]
    want = run(tuple(b[:300].copy() for b in base), (0.1,))
    for off in range(1, 17):
        shifted = []
        for b in base:
            buf = np.empty(320, np.float32)
            buf[off : off + 300] = b[:300]
            shifted.append(buf[off : off + 300])
        assert run(tuple(shifted), (0.1,)) == want, off


def test_row_sums_add_the_leftover_terms_last():
    """d = 20 with 16 partial sums (four vectors): 2^53 in the first, then the four leftover
    ones added one at a time, each rounded away (an order that added them first would give
    2^53 + 4; with one vector, d = 20 has no leftover, and the ones land in the lanes)."""
    require("numba")
    run = _compiled(lambda x: (x,), 1, 4)
    x = np.zeros(20)
    x[0] = 2.0**53
    x[16:] = 1.0
    assert run((x,), ()) == (2.0**53,)
    # one vector: lanes (2^53 + 1 -> 2^53, 1, 1, 1) folded as ((l0 + l1) + (l2 + l3))
    assert _compiled(lambda x: (x,), 1, 1)((x,), ()) == (2.0**53 + 2.0,)


def test_row_sums_reject_strided_rows():
    """The intrinsic indexes memory directly, so a non-contiguous row must not type-check."""
    require("numba")
    import numba

    if numba.config.DISABLE_JIT:
        pytest.skip("typing is compiled-mode only")
    run = _compiled(lambda x: (x,), 1, 4)
    with pytest.raises(numba.core.errors.TypingError):
        run((np.ones(10)[::2],), ())
