"""The Numba kernels' non-temporal stores. The dense Jacobians: an output over
``layernorm.STREAM_MIN_BYTES`` is written by ``_intrinsics.stream_affine``. The norm kernels: long rows
of large outputs (``layernorm._stream_rows``) are streamed out from the registers by
``_formula.block_writer``. Their values must be bit for bit those of the plain path, whatever the
output's alignment. Also the prefetch hints the norm kernels issue ahead of their rows
(``_intrinsics.prefetch``, ``_intrinsics.prefetch_write``)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require
from pyengine.backends import resolve


@pytest.fixture(scope="module")
def nb():
    """(layernorm of the Numba backend, a jitted caller of stream_affine, the same expression as a loop)."""
    require("numba")
    import numba

    from pyengine.kernels._numba import _intrinsics, layernorm

    @numba.njit
    def affine(dst, src, a, b, c):
        _intrinsics.stream_affine(dst, src, a, b, c)
        _intrinsics.store_fence()

    @numba.njit
    def loop(dst, src, a, b, c):  # the same expression as a plain Numba loop
        for j in range(src.size):
            dst[j] = a * (b - c * src[j])

    return layernorm, affine, loop


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 64, 1000])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_stream_affine_intrinsic(nb, dtype, n, offset):
    """Every element equals the plain loop's (and NumPy's), whatever dst's alignment; only dst is written."""
    _, affine, loop = nb
    rng = np.random.default_rng(n)
    src = rng.standard_normal(n)
    src_copy = src.copy()
    a, b, c = 1.7, -0.3, 0.123456789
    store = np.full(n + offset + 2, -1.0, dtype)
    dst = store[offset : offset + n]
    affine(dst, src, a, b, c)
    ref = np.empty(n, dtype)
    loop(ref, src, a, b, c)
    np.testing.assert_array_equal(dst, ref)
    np.testing.assert_array_equal(dst, (a * (b - c * src)).astype(dtype))
    assert (store[:offset] == -1).all() and (store[offset + n :] == -1).all()
    np.testing.assert_array_equal(src, src_copy)


def test_stream_affine_misaligned_bytes(nb):
    """A float64 destination that is not 8-byte aligned (a byte view) is written with plain stores."""
    _, affine, _ = nb
    raw = np.zeros(8 * 200 + 3, np.uint8)
    dst = raw[3 : 3 + 8 * 200].view(np.float64)
    assert not dst.flags.aligned
    src = np.arange(200, dtype=np.float64)
    affine(dst, src, 2.0, 1.0, 0.5)
    np.testing.assert_array_equal(dst, 2.0 * (1.0 - 0.5 * src))


def test_stream_affine_refuses_strided_arrays(nb):
    """The intrinsic indexes memory directly, so a non-contiguous dst or src must not type-check."""
    import numba

    if numba.config.DISABLE_JIT:
        pytest.skip("typing is compiled-mode only")
    _, affine, _ = nb
    src = np.arange(40, dtype=np.float64)
    with pytest.raises(numba.core.errors.TypingError):
        affine(np.zeros(40, np.float32)[::2], src[::2], 1.0, 0.0, 1.0)
    with pytest.raises(numba.core.errors.TypingError):
        affine(np.zeros(20, np.float32), src[::2], 1.0, 0.0, 1.0)


def test_prefetch_hints_never_fault_nor_write():
    """``prefetch`` / ``prefetch_write`` on indices far outside the array (the norm kernels ask
    for lines ahead of the row being written) neither fault nor change a value."""
    require("numba")
    import numba

    from pyengine.kernels._numba import _intrinsics

    @numba.njit
    def touch(a, lo, hi, step):
        for i in range(lo, hi, step):
            _intrinsics.prefetch(a, i)
            _intrinsics.prefetch_write(a, i)
        return a.sum()

    for dtype in (np.float32, np.float64):
        a = np.arange(100, dtype=dtype)
        before = a.copy()
        assert touch(a, -(1 << 20), 1 << 20, 61) == before.sum()
        np.testing.assert_array_equal(a, before)
    if not numba.config.DISABLE_JIT:
        with pytest.raises(numba.core.errors.TypingError):
            touch(np.zeros((4, 4)), 0, 4, 1)  # 1-D arrays only


@pytest.mark.parametrize("kernel", ["layer_norm_jacobian", "rms_norm_jacobian"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("frozen", [False, True], ids=["full", "frozen"])
@pytest.mark.parametrize("offset", [0, 1, 5], ids=["aligned", "off1", "off5"])
def test_streamed_jacobian_equals_plain(nb, kernel, dtype, frozen, offset):
    """A streamed (n, d, d) Jacobian holds exactly what one-token calls (plain stores) write."""
    layernorm = nb[0]
    fn = resolve(kernel, "numba")
    item = np.dtype(dtype).itemsize
    d = 1031  # odd: unaligned row starts and ends, and a diagonal in every position of a line
    n = -(-layernorm.STREAM_MIN_BYTES // (item * d * d)) + 1
    assert d * d * item < layernorm.STREAM_MIN_BYTES  # one token: the plain path
    rng = np.random.default_rng(3)
    x = (2.0 + rng.standard_normal((n, d))).astype(dtype)
    x[1, 17] = np.nan  # a bad row is counted on both paths
    gamma = rng.uniform(0.5, 1.5, d).astype(dtype)
    keep = x.copy(), gamma.copy()
    store = np.full(n * d * d + offset, 7.0, dtype)
    out = store[offset:].reshape(n, d, d)  # not 64-byte aligned unless offset = 0
    assert out.nbytes >= layernorm.STREAM_MIN_BYTES
    assert fn(x, gamma, 1e-5, frozen, out) == 1
    assert (store[:offset] == 7.0).all()  # nothing written before out
    for r in range(n):
        one = np.empty((1, d, d), dtype)
        bad = fn(x[r : r + 1], gamma, 1e-5, frozen, one)
        if not bad:
            np.testing.assert_array_equal(out[r], one[0])
    np.testing.assert_array_equal(x, keep[0])
    np.testing.assert_array_equal(gamma, keep[1])


# --------------------------------------------------------------------------- #
# The norm kernels' writing passes: _formula.block_writer, and layernorm._stream_rows.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def writer():
    """A jitted caller of a block_writer (dst[o:o+m] = 2 * src - c), with the fence."""
    require("numba")
    import numba

    from pyengine.kernels._numba import _formula, _intrinsics

    write = _formula.block_writer(lambda a, two, c: two * a - c)

    @numba.njit
    def run(dst, src, o, m, stream):
        write(dst, o, m, stream, (src,), (2.0, 0.5))
        _intrinsics.store_fence()

    return run


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("offset", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("o, m", [(0, 0), (0, 1), (0, 7), (0, 64), (3, 61), (5, 195), (64, 64), (190, 10)])
def test_block_writer_writes_exactly_the_span(writer, stream, dtype, offset, o, m):
    """dst[o:o+m] = 2 src - 0.5 computed in float64 and cast once (NaN, -0, inf, subnormals
    included), whatever dst's alignment, plain or streamed; nothing else of dst, and nothing of
    src, changes."""
    n = 200
    rng = np.random.default_rng(offset * 1000 + m)
    src = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(dtype)
    src[:4] = [np.nan, -0.0, np.finfo(dtype).smallest_subnormal, np.inf]
    keep = src.copy()
    store = np.full(n + offset + 3, 7.0, dtype)
    dst = store[offset : offset + n]
    writer(dst, src, o, m, stream)
    want = np.full(n, 7.0, dtype)
    want[o : o + m] = (2.0 * src[o : o + m].astype(np.float64) - 0.5).astype(dtype)
    np.testing.assert_array_equal(dst, want)
    np.testing.assert_array_equal(np.signbit(dst), np.signbit(want))  # -0.0 stays -0.0
    assert (store[:offset] == 7.0).all() and (store[offset + n :] == 7.0).all()
    np.testing.assert_array_equal(src, keep)


def test_block_writer_emits_streaming_stores(writer):
    """The streamed branch really is non-temporal (``!nontemporal`` stores in the IR), and a
    negative count writes nothing."""
    import numba

    if numba.config.DISABLE_JIT:
        pytest.skip("compiled-mode only")
    for dtype in (np.float32, np.float64):
        dst, src = np.zeros(16, dtype), np.ones(16, dtype)
        writer(dst, src, 3, -2, True)
        assert not dst.any()
        llvm = "".join(writer.inspect_llvm().values())
        assert "!nontemporal" in llvm


def _writer_cases():
    """(module, writer, arrays, scalars, the formula in NumPy, f32): every norm kernel's writer."""
    f = np.float32
    return [
        ("layernorm", "_write_ln", 3, (0.25, 1.5), lambda g, x, b, mu, inv: g * ((x - mu) * inv) + b, False),
        ("layernorm", "_write_ln_jvp", 3, (0.1, -0.3, 0.25, 1.5),
         lambda g, v, x, mv, m2, mu, inv: g * (((v - mv) - ((x - mu) * inv) * m2) * inv), False),
        ("layernorm", "_write_ln_vjp", 3, (0.1, -0.3, 0.25, 1.5),
         lambda g, u, x, mg, m2, mu, inv: ((g * u - mg) - ((x - mu) * inv) * m2) * inv, False),
        ("layernorm", "_write_ln_f32", 3, (f(0.25), f(1e-9), f(1.5)),
         lambda g, x, b, mh, ml, fi: g * (((x - mh) - ml) * fi) + b, True),
        ("rmsnorm", "_write_rms", 2, (1.5,), lambda g, x, inv: g * (x * inv), False),
        ("rmsnorm", "_write_rms_jvp", 3, (0.3, 1.5), lambda g, v, x, c, inv: g * ((v - x * c) * inv), False),
        ("rmsnorm", "_write_rms_vjp", 3, (0.3, 1.5), lambda g, u, x, c, inv: (g * u - x * c) * inv, False),
    ]


@pytest.mark.parametrize("case, dtype", [(c, t) for c in range(7) for t in (np.float32, np.float64)
                                         if not (c == 3 and t == np.float64)])  # 3: float32 rows only
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_norm_writers_compute_their_formulas(case, dtype, stream):
    """Each norm kernel's writer computes its row formula bit for bit as NumPy does, operation
    by operation (in float64, cast once; LayerNorm's float32 pass in float32)."""
    require("numba")
    import importlib

    import numba

    module, name, narrays, scalars, formula, f32 = _writer_cases()[case]
    from pyengine.kernels._numba._intrinsics import store_fence

    write = getattr(importlib.import_module(f"pyengine.kernels._numba.{module}"), name)

    @numba.njit
    def run(out, stream, arrays, scalars):
        write(out, 0, out.size, stream, arrays, scalars)
        store_fence()

    rng = np.random.default_rng(case)
    d = 302
    arrays = tuple((rng.standard_normal(d) * 3).astype(dtype) for _ in range(narrays))
    out = np.empty(d, dtype)
    run(out, stream, arrays, scalars)
    ct = np.float32 if f32 else np.float64
    want = formula(*[a.astype(ct) for a in arrays], *[ct(c) for c in scalars]).astype(dtype)
    np.testing.assert_array_equal(out, want)


def test_block_writer_refuses_strided_arrays(writer):
    import numba

    if numba.config.DISABLE_JIT:
        pytest.skip("typing is compiled-mode only")
    src = np.arange(40, dtype=np.float32)
    with pytest.raises(numba.core.errors.TypingError):
        writer(np.zeros(40, np.float32)[::2], src[::2], 0, 20, True)


def _placed(n, d, dtype, shift):
    """(raw, start, out): out, an (n, d) view of ``raw`` (filled with 7.0) that starts ``shift``
    bytes past a 64-byte line, at raw[start]."""
    item = np.dtype(dtype).itemsize
    raw = np.full(n * d + 64, 7.0, dtype)
    start = (-raw.ctypes.data % 64 + shift) // item
    out = raw[start : start + n * d].reshape(n, d)
    assert out.ctypes.data % 64 == shift
    return raw, start, out


def test_stream_rows_rule(nb):
    """Streamed: >= STREAM_MIN_BYTES in all, rows >= the kernel's minimum, rows on 16-byte
    boundaries. Not: small outputs, short rows, rows off 16-byte boundaries."""
    layernorm = nb[0]
    assert layernorm.STREAM_ROW_MIN_BYTES == 8 << 10 and layernorm.STREAM_MIN_BYTES == 16 << 20
    assert layernorm.STREAM_SHORT_ROW_MIN_BYTES == 2 << 10

    def rule(out, min_row=layernorm.STREAM_ROW_MIN_BYTES):
        return layernorm._stream_rows(out, min_row)

    def aligned(n, d, dtype, shift=0):
        return _placed(n, d, dtype, shift)[2]

    assert rule(aligned(2048, 4096, np.float32))  # 32 MiB, 16 KiB rows
    assert rule(aligned(2048, 2048, np.float32))  # exactly 16 MiB, 8 KiB rows
    assert rule(aligned(2048, 1024, np.float64))
    assert rule(aligned(2048, 2048, np.float32, shift=16))  # 16 bytes past a line
    assert not rule(aligned(2047, 2048, np.float32))  # just under 16 MiB
    assert not rule(aligned(8192, 768, np.float32))  # 24 MiB of 3 KiB rows
    assert not rule(aligned(4096, 2047, np.float32))  # 8188-byte rows
    assert not rule(aligned(2048, 2048, np.float32, shift=4))  # rows 4 bytes past 16
    assert not rule(aligned(2048, 2049, np.float32))  # rows that drift off 16 bytes
    short = layernorm.STREAM_SHORT_ROW_MIN_BYTES
    assert rule(aligned(8192, 768, np.float32), short)  # 3 KiB rows stream from 2 KiB
    assert rule(aligned(8192, 512, np.float32), short)  # exactly 16 MiB, 2 KiB rows
    assert not rule(aligned(16384, 508, np.float32), short)  # 2032-byte rows
    assert not rule(aligned(8191, 512, np.float32), short)  # just under 16 MiB
    assert not rule(aligned(8192, 768, np.float32, shift=8), short)


_NORM_ARGS = {
    "layer_norm": lambda x, t, g, b: (x, g, b, 1e-5),
    "layer_norm_jvp": lambda x, t, g, b: (x, t, g, 1e-5, False),
    "layer_norm_vjp": lambda x, t, g, b: (x, t, g, 1e-5, False),
    "rms_norm": lambda x, t, g, b: (x, g, 1e-5),
    "rms_norm_jvp": lambda x, t, g, b: (x, t, g, 1e-5, False),
    "rms_norm_vjp": lambda x, t, g, b: (x, t, g, 1e-5, False),
}


@pytest.mark.parametrize("kernel", sorted(_NORM_ARGS))
@pytest.mark.parametrize("dtype, d", [(np.float32, 2052), (np.float64, 1024), (np.float32, 772)],
                         ids=["float32", "float64", "float32-short"])
@pytest.mark.parametrize("shift", [0, 16, 8], ids=["line", "16B", "8B"])
def test_streamed_norm_rows_equal_plain(nb, kernel, dtype, d, shift):
    """A norm kernel's output streamed (16 MiB or more, long rows) equals, bit for bit, what the
    same kernel writes with plain stores on slices of a few rows (its rows are independent);
    an output whose rows are off 16-byte boundaries (``shift`` 8 bytes past a line) takes the
    plain path and agrees too. The float32 rows include the d % 64 tail (d = 2052), a row whose mean takes
    LayerNorm's float64 writing pass, and a bad row, counted on both paths. Rows of 3 KiB
    (d = 772) stream in every kernel but LayerNorm's forward pass."""
    import numba

    if numba.config.DISABLE_JIT:
        pytest.skip("16 MiB through Python; the stand-ins are checked by the block_writer tests")
    layernorm = nb[0]
    fn = resolve(kernel, "numba")
    item = np.dtype(dtype).itemsize
    n = -(-layernorm.STREAM_MIN_BYTES // (item * d))
    rng = np.random.default_rng(11)
    x = (1.0 + rng.standard_normal((n, d))).astype(dtype)
    t = rng.standard_normal((n, d)).astype(dtype)
    x[5] += 2.0**110  # LayerNorm: mu beyond 2^100, the float64 writing pass (float32 rows)
    x[9, 3] = np.nan
    g = rng.uniform(0.5, 1.5, d).astype(dtype)
    b = rng.standard_normal(d).astype(dtype)
    keep = [a.copy() for a in (x, t, g, b)]
    raw, start, out = _placed(n, d, dtype, shift)
    long_only = kernel == "layer_norm"
    min_row = layernorm.STREAM_ROW_MIN_BYTES if long_only else layernorm.STREAM_SHORT_ROW_MIN_BYTES
    streams = shift % 16 == 0 and d * item >= min_row
    assert bool(layernorm._stream_rows(out, min_row)) == streams
    assert streams or shift % 16 or (long_only and d == 772)
    bad = fn(*_NORM_ARGS[kernel](x, t, g, b), out)
    assert bad == 1
    assert (raw[:start] == 7.0).all() and (raw[start + n * d :] == 7.0).all()
    step = 256  # 256 rows: 2 MiB, plain stores
    total = 0
    for r in range(0, n, step):
        part = np.empty((min(step, n - r), d), dtype)
        total += fn(*_NORM_ARGS[kernel](x[r : r + step], t[r : r + step], g, b), part)
        rows = np.arange(r, r + part.shape[0]) != 9
        np.testing.assert_array_equal(out[r : r + step][rows], part[rows])
    assert total == 1
    for a, k in zip((x, t, g, b), keep):
        np.testing.assert_array_equal(a, k)


_CORES = {  # a kernel's row core, how many next rows it takes, and whether it takes a scratch
    # ``acc`` (its arguments before out are the kernel's, _NORM_ARGS; then out, [acc,] the
    # next rows, stream)
    "layer_norm": ("layernorm", "_layer_norm_row", 1, True),
    "layer_norm_jvp": ("layernorm", "_layer_norm_jvp_row", 2, False),
    "layer_norm_vjp": ("layernorm", "_layer_norm_vjp_row", 2, False),
    "rms_norm": ("rmsnorm", "_rms_norm_row", 1, False),
    "rms_norm_jvp": ("rmsnorm", "_rms_norm_jvp_row", 2, False),
    "rms_norm_vjp": ("rmsnorm", "_rms_norm_vjp_row", 2, False),
}


@pytest.mark.parametrize("kernel", sorted(_CORES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("shift", [0, 1, 4], ids=["aligned", "shift1", "shift4"])
@pytest.mark.parametrize("d", [300, 302])
def test_row_core_streamed_and_plain_agree(kernel, dtype, shift, d):
    """Streamed (streaming stores from the registers, on a 16-byte-aligned row; plain stores
    where it is not) or not, a core writes the same values, bit for bit, and every value of its
    row (d = 300, 302: blocks, a partial block, for float64 302 a streamed 16-byte piece, and a
    scalar tail), and nothing past it."""
    require("numba")
    import importlib

    from pyengine.kernels._numba._reduce import LANES

    module, name, nexts, takes_acc = _CORES[kernel]
    core = getattr(importlib.import_module(f"pyengine.kernels._numba.{module}"), name)
    rng = np.random.default_rng(5)
    x = (1.0 + rng.standard_normal(d)).astype(dtype)
    t = rng.standard_normal(d).astype(dtype)
    g = rng.uniform(0.5, 1.5, d).astype(dtype)
    acc = (np.empty((2, LANES)),) if takes_acc else ()
    space = np.full(d + 24, 7.0, dtype)
    streamed, plain = space[shift : shift + d], np.full(d, 7.0, dtype)
    args = _NORM_ARGS[kernel](x, t, g, g)
    assert not core(*args, streamed, *acc, *([x] * nexts), True)
    assert not core(*args, plain, *acc, *([x] * nexts), False)
    np.testing.assert_array_equal(plain, streamed)
    assert not (plain == 7.0).any()
    assert (space[:shift] == 7.0).all() and (space[shift + d :] == 7.0).all()
