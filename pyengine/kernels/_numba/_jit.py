"""The one place where pyengine's Numba options live.

Every Numba kernel is compiled with :data:`jit` (serial) or :data:`pjit` (``prange``
over tokens), or, in the activation, softmax and power-iteration kernels, with their fused-multiply-add
variants :data:`fma_inline`, :data:`fma_jit` and :data:`fma_pjit` (:data:`CONTRACT`).
No module sets Numba options of its own. No eager signatures: each function is compiled on its first call for
the types it gets (float32 or float64 arrays, which the public layer guarantees)
and then cached on disk (``cache=True``), so ``import pyengine`` never compiles.
Also here: the low-level memory primitives the kernels share, :func:`prefetch` and
:func:`prefetch_write` (hints the norm kernels issue ahead of their rows), and
:func:`stream_affine` and :func:`block_writer` with :func:`store_fence` (non-temporal stores,
as the C++ kernels' ``_mm512_stream_ps`` and ``_mm_stream_ps``), used where an output is far
larger than any cache: the dense Jacobians (:func:`.layernorm._dense_jacobian`) and the norm
kernels' rows (:func:`block_writer`, ``layernorm._stream_rows``). Also the shared pieces of
the intrinsics that emit vector code from a formula (:class:`Ir`, :func:`splat`,
:func:`operands_ok`, :func:`operands`, :func:`load_row_elements`: :func:`block_writer` and
``_reduce._row_sums``).
"""

from __future__ import annotations

import functools
import platform

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "CONTRACT",
    "FASTMATH",
    "fma_inline",
    "fma_jit",
    "fma_pjit",
    "inline",
    "jit",
    "pjit",
    "prefetch",
    "prefetch_write",
    "Ir",
    "WRITE_WIDTH",
    "block_writer",
    "is_row",
    "load_row_elements",
    "operands",
    "operands_ok",
    "splat",
    "store_fence",
    "stream_affine",
]

#: No fast-math, not even per flag (the one exception is :data:`CONTRACT`). Bad-row detection tests the row statistics
#: with ``np.isfinite``; the ``nnan``/``ninf`` flags let LLVM assume that NaN and
#: Inf never occur and fold those tests to ``True``. ``reassoc`` would let the
#: compiler reorder the float64 sums, so results would depend on the vector width
#: of the machine; instead the reductions are vectorized by hand (see
#: ``_reduce.LANES`` and ``_reduce._row_sums``) in an order fixed by the source.
FASTMATH = False

#: Serial kernels and helpers. ``error_model="numpy"``: a division by zero gives
#: inf/NaN instead of raising, as in NumPy; such rows are counted as bad rows.
jit = functools.partial(numba.njit, cache=True, fastmath=FASTMATH, error_model="numpy")

#: Batch kernels: ``prange`` over tokens (rows), each row computed by one thread,
#: so results do not depend on the number of threads. The GIL is *not* released
#: (no ``nogil``): Numba's default ``workqueue`` threading layer aborts the process
#: when two Python threads enter parallel kernels at the same time.
pjit = functools.partial(jit, parallel=True)

if numba.config.DISABLE_JIT:  # pragma: no cover - only in the NUMBA_DISABLE_JIT=1 CI job

    def pjit(fn):  # noqa: F811
        """Run the kernel as Python (for coverage) with NumPy's floating-point warnings off.

        Compiled code (``error_model="numpy"``) never warns; as Python on NumPy
        scalars, a bad row (inf - inf, ...) would warn, and the test suite turns
        warnings into errors. ``functools.wraps`` keeps the signature for
        :func:`pyengine.backends.register`.
        """

        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            with np.errstate(all="ignore"):
                return fn(*args, **kwargs)

        return kernel


#: The one fast-math flag pyengine uses, and only in the activation, softmax and
#: power-iteration kernels (:mod:`._vecmath`, :mod:`.activations`, :mod:`.softmax`, the
#: passes of :mod:`.spectral`'s power iteration): ``contract`` lets LLVM fuse a * b + c
#: into one FMA, rounded once instead of twice (as the C++ kernels, compiled as GNU C++,
#: do everywhere). It assumes nothing about NaN or Inf and reorders no sum, so the
#: bad-row tests and the fixed summation order hold; the polynomials of :mod:`._vecmath`
#: are chains of multiply-adds, and it makes them about 2x faster. On a machine without
#: FMA the same code rounds twice: results there differ in the last bits.
CONTRACT = {"contract"}

if numba.config.DISABLE_JIT:  # pragma: no cover - the NUMBA_DISABLE_JIT=1 CI job
    fma_inline = fma_jit = inline = jit
    fma_pjit = pjit
else:
    #: Row helpers inlined at the Numba IR level, without fast-math: for short rows (the
    #: softmax JVP's Tk = 128) the call itself, with every array argument passed as its
    #: parts, costs as much as the row. The caller's flags apply to inlined code, so a
    #: caller compiled with :data:`CONTRACT` would fuse its products: call it from ``jit``
    #: / ``pjit`` code only.
    inline = functools.partial(jit, inline="always")
    #: Scalar cores: always inlined (at the Numba IR level), because LLVM's inliner
    #: leaves the larger ones (GELU) as calls, and a loop with a call does not vectorize.
    fma_inline = functools.partial(jit, inline="always", fastmath=CONTRACT)
    #: Row helpers that call the cores (inlined cores take their caller's flags).
    fma_jit = functools.partial(jit, fastmath=CONTRACT)
    #: Batch kernels: ``prange`` over rows, as :data:`pjit`.
    fma_pjit = functools.partial(jit, parallel=True, fastmath=CONTRACT)


def _prefetch_codegen(rw):
    """Codegen of ``llvm.prefetch`` of ``a[i]``: rw 0 read, 1 write; locality 3 (all cache levels), data."""

    def codegen(context, builder, sig, args):
        aryty, idxty = sig.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = context.cast(builder, args[1], idxty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [idx])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # (address, rw, locality = 3 all levels, cache type = 1 data)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(rw), i32(3), i32(1)])
        return context.get_dummy_value()

    return codegen


def _is_index(a, i):
    return isinstance(a, types.Array) and a.ndim == 1 and isinstance(i, types.Integer)


@intrinsic
def prefetch(typingctx, a, i):
    """``prefetch(a, i)``: a hint that ``a[i]`` (1-D array, integer index) will be read soon.

    Emits ``llvm.prefetch`` (read, keep in all cache levels, data): ``prefetcht0`` on
    x86-64, ``prfm`` on AArch64, nothing on targets without it. A prefetch never
    faults and never changes a result. The kernels use it to pull the next row in
    from memory while they compute on the current one, since the hardware
    prefetchers only follow the rows being read, and memory would sit idle.
    """
    if not _is_index(a, i):
        return None
    return types.none(a, i), _prefetch_codegen(0)


@intrinsic
def prefetch_write(typingctx, a, i):
    """``prefetch_write(a, i)``: a hint that ``a[i]`` (1-D array, integer index) will be written soon.

    ``llvm.prefetch`` with rw = 1: ``prefetchw`` on x86-64 (``prfm pstl1keep`` on
    AArch64), which fetches the line in a state that can be written. A plain store to a
    line that is not in cache must first read it (read-for-ownership), and the stores of a
    row-writing loop issue those reads one line at a time as they reach it, so memory
    waits on them; asking for the lines a few hundred bytes ahead overlaps them with the
    computation (see ``layernorm._WRITE_AHEAD``). Never faults, never changes a result.
    """
    if not _is_index(a, i):
        return None
    return types.none(a, i), _prefetch_codegen(1)


if numba.config.DISABLE_JIT:  # pragma: no cover - an intrinsic cannot run as Python

    def prefetch(a, i):  # noqa: F811
        """No-op stand-in for the ``prefetch`` intrinsic under ``NUMBA_DISABLE_JIT``."""

    def prefetch_write(a, i):  # noqa: F811
        """No-op stand-in for the ``prefetch_write`` intrinsic under ``NUMBA_DISABLE_JIT``."""


def _vector_span(builder, intp, dp, n, size, width_bytes):
    """(head, nvec, vend) of the ``n`` elements of ``size`` bytes at ``dp``: the elements before
    the first ``width_bytes`` boundary (all of them when ``dp`` is not aligned to its element
    size), the whole vectors of ``width_bytes`` after them, and where those end."""
    k = functools.partial(ir.Constant, intp)
    addr = builder.ptrtoint(dp, intp)
    head = builder.udiv(builder.and_(builder.sub(k(width_bytes), builder.and_(addr, k(width_bytes - 1))),
                                     k(width_bytes - 1)), k(size))
    misaligned = builder.icmp_unsigned("!=", builder.and_(addr, k(size - 1)), k(0))
    head = builder.select(builder.or_(misaligned, builder.icmp_signed(">", head, n)), n, head)
    width = width_bytes // size
    nvec = builder.udiv(builder.sub(n, head), k(width))
    return head, nvec, builder.add(head, builder.mul(nvec, k(width)))


@intrinsic
def stream_affine(typingctx, dst, src, a, b, c):
    """``stream_affine(dst, src, a, b, c)``: ``dst[j] = a * (b - c * src[j])`` with non-temporal stores.

    dst : (m,) float32 or float64; src : (m,) float64, both contiguous (other layouts do
    not type-check); a, b, c : float64. Computed in
    float64 in that order (no fused multiply-add), then cast to dst's dtype: bit for bit
    the values of the same expression in a Numba loop. A normal store to a line that is
    not in cache first reads the line (read-for-ownership), as much traffic again as
    the write; non-temporal stores write whole lines straight to memory, as the C++
    kernels do for large outputs (``csrc/rows.hpp``, ``kStreamMinBytes``). Numba emits
    none from a loop (LLVM's vectorizer drops a store it cannot prove aligned), so this
    intrinsic writes the loop itself: 64-byte vector stores marked ``!nontemporal`` on
    the 64-byte-aligned middle of ``dst``, plain stores on its ends (and on all of a
    ``dst`` not aligned to its element size). Its one user is the dense Jacobian row
    (:func:`.layernorm._dense_jacobian`). The stores are weakly ordered: the thread
    must call :func:`store_fence` before the kernel returns.
    """
    f64 = types.float64
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.ndim == 1 and src.ndim == 1
            and dst.layout == "C" and src.layout == "C"
            and dst.dtype in (types.float32, f64) and src.dtype == f64
            and all(isinstance(t, types.Float) for t in (a, b, c))):
        return None

    def codegen(context, builder, sig, args):
        dty, sty = sig.args[:2]
        da = context.make_array(dty)(context, builder, args[0])
        sa = context.make_array(sty)(context, builder, args[1])
        av, bv, cv = (context.cast(builder, v, t, f64) for v, t in zip(args[2:], sig.args[2:]))
        intp = context.get_value_type(types.intp)
        elt = context.get_data_type(dty.dtype)
        dbl = ir.DoubleType()
        size = context.get_abi_sizeof(elt)
        width = 64 // size
        dp, sp = da.data, sa.data
        n = builder.extract_value(da.shape, 0)
        k = functools.partial(ir.Constant, intp)
        head, nvec, vend = _vector_span(builder, intp, dp, n, size, 64)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])

        def value(x, a_, b_, c_):  # a * (b - c * x), then the cast to dst's dtype
            y = builder.fmul(a_, builder.fsub(b_, builder.fmul(c_, x)))
            return y if size == 8 else builder.fptrunc(y, elt if x.type == dbl else ir.VectorType(elt, width))

        def plain(lo, hi):
            with cgutils.for_range_slice(builder, lo, hi, k(1), intp) as (i, _):
                builder.store(value(builder.load(builder.gep(sp, [i])), av, bv, cv), builder.gep(dp, [i]))

        plain(k(0), head)
        va, vb, vc = (splat(builder, v, width) for v in (av, bv, cv))
        with cgutils.for_range(builder, nvec, intp=intp) as loop:
            i = builder.add(head, builder.mul(loop.index, k(width)))
            x = builder.load(builder.bitcast(builder.gep(sp, [i]), ir.VectorType(dbl, width).as_pointer()), align=8)
            st = builder.store(value(x, va, vb, vc),
                               builder.bitcast(builder.gep(dp, [i]), ir.VectorType(elt, width).as_pointer()), align=64)
            st.set_metadata("nontemporal", nontemporal)
        plain(vend, n)
        return context.get_dummy_value()

    return types.none(dst, src, a, b, c), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def store_fence(typingctx):
    """``store_fence()``: order this thread's non-temporal stores before what follows.

    ``sfence`` on x86 (an LLVM ``fence`` orders only ordinary stores there), a
    sequentially consistent fence elsewhere. Call it once per thread after its last
    :func:`stream_affine` or :func:`block_writer`, not per row: it waits for the
    write-combining buffers.
    """

    def codegen(context, builder, sig, args):
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.sfence"), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


if numba.config.DISABLE_JIT:  # pragma: no cover - intrinsics cannot run as Python

    def stream_affine(dst, src, a, b, c):  # noqa: F811
        """Plain-store stand-in for the ``stream_affine`` intrinsic under ``NUMBA_DISABLE_JIT``."""
        dst[:] = a * (b - c * src)

    def store_fence():  # noqa: F811
        """No-op stand-in for the ``store_fence`` intrinsic under ``NUMBA_DISABLE_JIT``."""


class Ir:
    """An LLVM value with ``+``, ``-``, ``*`` and ``/`` (no fast-math flags: each operation
    rounded once, as written): the arithmetic of the formulas that :func:`block_writer` and
    ``_reduce._row_sums`` turn into vector code."""

    __slots__ = ("b", "v")

    def __init__(self, b, v):
        self.b, self.v = b, v

    def __add__(self, o):
        return Ir(self.b, self.b.fadd(self.v, o.v))

    def __sub__(self, o):
        return Ir(self.b, self.b.fsub(self.v, o.v))

    def __mul__(self, o):
        return Ir(self.b, self.b.fmul(self.v, o.v))

    def __truediv__(self, o):
        return Ir(self.b, self.b.fdiv(self.v, o.v))


#: Values per vector of :func:`block_writer`.
WRITE_WIDTH = 4


def splat(builder, c, width):
    """The LLVM vector of ``width`` copies of the scalar ``c``."""
    v = ir.Constant(ir.VectorType(c.type, width), ir.Undefined)
    for j in range(width):
        v = builder.insert_element(v, c, ir.IntType(32)(j))
    return v


def is_row(a):
    """Whether the Numba type ``a`` is a 1-D C-contiguous float32 or float64 array."""
    return isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype in (types.float32, types.float64)


def operands_ok(arrays, scalars):
    """Whether the Numba types ``arrays`` and ``scalars`` are a formula's operands: a tuple of
    rows (:func:`is_row`) and a tuple of numbers (either possibly empty)."""
    return (isinstance(arrays, types.BaseTuple) and all(is_row(a) for a in arrays)
            and isinstance(scalars, types.BaseTuple)
            and all(isinstance(c, (types.Float, types.Integer)) for c in scalars))


def operands(context, builder, aty, sty, arrays, scalars, ct):
    """The operands of a formula in codegen: the array structs of the tuple ``arrays`` (Numba
    types ``aty``), and the tuple ``scalars`` (types ``sty``) cast to the Numba float type ``ct``."""
    arrs = [context.make_array(t)(context, builder, builder.extract_value(arrays, j)) for j, t in enumerate(aty)]
    cs = [context.cast(builder, builder.extract_value(scalars, j), t, ct) for j, t in enumerate(sty)]
    return arrs, cs


def load_row_elements(context, builder, arrs, aty, i, width, ft):
    """Element ``i`` (or the vectors of ``width`` from ``i``) of each array, converted to the
    LLVM float type ``ft``, as :class:`Ir` values (:func:`_load_as`)."""
    return [Ir(builder, _load_as(context, builder, a, t, i, width, ft)) for a, t in zip(arrs, aty)]


def _load_as(context, builder, ary, aty, i, width, ft):
    """``ary[i]`` (``width`` None) or the vector ``ary[i : i + width]`` of the 1-D contiguous
    array ``ary`` (Numba type ``aty``, float32 or float64; unaligned loads), converted to the
    LLVM float type ``ft``."""
    et = context.get_data_type(aty.dtype)
    p = builder.gep(ary.data, [i])
    if width:
        p = builder.bitcast(p, ir.VectorType(et, width).as_pointer())
    v = builder.load(p, align=context.get_abi_sizeof(et))
    if et == ft:
        return v
    cast = builder.fpext if isinstance(ft, ir.DoubleType) else builder.fptrunc
    return cast(v, ir.VectorType(ft, width) if width else ft)


def block_writer(value, f32=False):
    """The row writer ``write(out, o, m, stream, arrays, scalars)``:
    ``out[o + j] = value(*(a[o + j] for a in arrays), *scalars)`` for j in [0, m).

    out : 1-D C-contiguous float32 or float64; arrays : a tuple of such arrays (indexed like
    ``out``, at least ``o + m`` long: not checked, the caller's row); scalars : a tuple of
    numbers; o, m : integers; stream : bool. ``value`` combines its arguments with ``+``,
    ``-``, ``*`` and ``/`` (:class:`Ir`), in float64 (elements converted, the result cast to
    ``out``'s dtype on the store), or with ``f32`` in float32 (elements and scalars cast to
    float32; LayerNorm's float32 forward pass, compiled but never called for float64 rows):
    each operation rounded once as written, so a value is bit for bit that of the same
    expression in a Numba loop, whatever the vector width.

    Nothing is written for ``m <= 0``. Vectors of :data:`WRITE_WIDTH` values, a scalar loop
    for the last ``m % 4``. With ``stream`` (and ``out[o]`` on a 16-byte boundary) the vectors,
    and for float64 the 16 bytes left after them, are written with non-temporal 16-byte
    stores (``movntps`` / ``movntpd``, as the C++ kernels'
    ``_mm_stream_ps``), straight from the registers; the thread must call
    :func:`store_fence` before its kernel returns. Why the norm kernels write their rows
    with it: LLVM vectorizes a Numba loop that converts float32 to float64 8 or 16 values
    wide, and on Zen 4 the 4-wide conversions (``vcvtps2pd ymm, m128``) are faster per
    value; and Numba emits no streaming store from a loop, so a streamed row used to be
    computed into a scratch row and copied out with an intrinsic of its own, two more passes
    over the block (``layernorm.STREAM_ROW_MIN_BYTES`` has the measurements). Call it from
    :data:`jit` / :data:`pjit` code only: a caller compiled with :data:`CONTRACT` may have its
    multiplies and adds fused.
    """
    if numba.config.DISABLE_JIT:  # pragma: no cover - intrinsics cannot run as Python

        def write(out, o, m, stream, arrays, scalars):
            """The same values with NumPy (plain stores)."""
            if m <= 0:
                return
            dt = np.float32 if f32 else np.float64
            with np.errstate(all="ignore"):
                y = value(*[np.asarray(a[o : o + m], dt) for a in arrays], *[dt(c) for c in scalars])
            out[o : o + m] = y

        return write

    @intrinsic
    def write(typingctx, out, o, m, stream, arrays, scalars):
        if not (is_row(out) and isinstance(o, types.Integer) and isinstance(m, types.Integer)
                and isinstance(stream, types.Boolean) and operands_ok(arrays, scalars)):
            return None

        def codegen(context, builder, sig, args):
            oty, _, _, _, aty, sty = sig.args
            da = context.make_array(oty)(context, builder, args[0])
            arrs, cs = operands(context, builder, aty, sty, args[4], args[5], types.float32 if f32 else types.float64)
            intp = context.get_value_type(types.intp)
            i32 = ir.IntType(32)
            k = functools.partial(ir.Constant, intp)
            ft = ir.FloatType() if f32 else ir.DoubleType()
            et = context.get_data_type(oty.dtype)
            esize = context.get_abi_sizeof(et)
            start = context.cast(builder, args[1], sig.args[1], types.intp)
            n = context.cast(builder, args[2], sig.args[2], types.intp)
            nontemporal = builder.module.add_metadata([i32(1)])

            def compute(i, width, consts):  # width None: the scalar out[i]
                y = value(*load_row_elements(context, builder, arrs, aty, i, width, ft), *consts).v
                if (oty.dtype == types.float32) != f32:
                    cast = builder.fpext if f32 else builder.fptrunc
                    y = cast(y, ir.VectorType(et, width) if width else et)
                return y

            def store(y, i, width, streaming):
                p = builder.bitcast(builder.gep(da.data, [i]), ir.VectorType(et, width).as_pointer())
                if streaming:
                    builder.store(y, p, align=16).set_metadata("nontemporal", nontemporal)
                else:
                    builder.store(y, p, align=esize)

            n = builder.select(builder.icmp_signed("<", n, k(0)), k(0), n)  # m < 0: nothing
            nvec = builder.udiv(n, k(WRITE_WIDTH))
            lo = builder.add(start, builder.mul(nvec, k(WRITE_WIDTH)))
            piece = 16 // esize  # values per 16-byte streaming store
            # float64: the whole 16 bytes left after the vectors are streamed too, so that a row's
            # partial last line comes whole from two streamed rows
            npiece = builder.udiv(builder.sub(n, builder.mul(nvec, k(WRITE_WIDTH))), k(piece))
            addr = builder.ptrtoint(builder.gep(da.data, [start]), intp)
            nt = builder.and_(args[3], builder.icmp_unsigned("==", builder.and_(addr, k(15)), k(0)))
            vcs = [Ir(builder, splat(builder, c, WRITE_WIDTH)) for c in cs]
            with builder.if_else(nt) as (streamed, plain):
                with streamed:
                    with cgutils.for_range(builder, nvec, intp=intp) as loop:
                        i = builder.add(start, builder.mul(loop.index, k(WRITE_WIDTH)))
                        y = compute(i, WRITE_WIDTH, vcs)
                        for q in range(0, WRITE_WIDTH, piece):  # 16 bytes a store
                            part = y if piece == WRITE_WIDTH else builder.shuffle_vector(
                                y, y, ir.Constant(ir.VectorType(i32, piece), [q + t for t in range(piece)]))
                            store(part, builder.add(i, k(q)), piece, True)
                    if piece < WRITE_WIDTH:
                        pcs = [Ir(builder, splat(builder, c, piece)) for c in cs]
                        with cgutils.for_range(builder, npiece, intp=intp) as loop:
                            i = builder.add(lo, builder.mul(loop.index, k(piece)))
                            store(compute(i, piece, pcs), i, piece, True)
                with plain:
                    with cgutils.for_range(builder, nvec, intp=intp) as loop:
                        i = builder.add(start, builder.mul(loop.index, k(WRITE_WIDTH)))
                        store(compute(i, WRITE_WIDTH, vcs), i, WRITE_WIDTH, False)
            if piece < WRITE_WIDTH:
                lo = builder.select(nt, builder.add(lo, builder.mul(npiece, k(piece))), lo)
            scs = [Ir(builder, c) for c in cs]
            with cgutils.for_range_slice(builder, lo, builder.add(start, n), k(1), intp) as (i, _):
                builder.store(compute(i, None, scs), builder.gep(da.data, [i]))
            return context.get_dummy_value()

        return types.none(out, o, m, stream, arrays, scalars), codegen

    return write
