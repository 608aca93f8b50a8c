"""LLVM intrinsics for what Numba does not emit from a loop: memory hints and streaming stores.

:func:`prefetch` and :func:`prefetch_write` (hints the norm kernels issue ahead of their rows),
:func:`stream_affine` (a row written with non-temporal stores, as the C++ kernels'
``_mm512_stream_ps``: the dense Jacobians, :func:`.layernorm._dense_jacobian`) and
:func:`store_fence`, which a thread calls after its last streaming store (also after those of
:func:`._formula.block_writer`). Each has a plain-Python stand-in under ``NUMBA_DISABLE_JIT``.
:func:`splat` is the one LLVM helper these and :mod:`._formula` share.

The options every kernel is compiled with are in :mod:`._jit`; the formulas emitted as vector
code (row sums and row writers) in :mod:`._formula`. Numba's on-disk cache checks only the
source file of the function it caches: after an edit here, delete
``pyengine/kernels/_numba/__pycache__``.
"""

from __future__ import annotations

import functools
import platform

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["prefetch", "prefetch_write", "splat", "store_fence", "stream_affine"]


def splat(builder, c, width):
    """The LLVM vector of ``width`` copies of the scalar ``c``."""
    v = ir.Constant(ir.VectorType(c.type, width), ir.Undefined)
    for j in range(width):
        v = builder.insert_element(v, c, ir.IntType(32)(j))
    return v


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
    :func:`stream_affine` or :func:`._formula.block_writer`, not per row: it waits for the
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
