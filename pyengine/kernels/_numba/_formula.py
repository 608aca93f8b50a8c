"""Formulas emitted as 4-wide LLVM vector code: the norm kernels' row sums and row writers.

A formula is a Python function of LLVM values (:class:`Ir`: ``+``, ``-``, ``*``, ``/``, each
rounded once as written) over the elements of some rows and some scalars. Two factories turn
one into an intrinsic that a jitted kernel calls:

- :func:`row_sums`: float64 sums over a row of the formula's terms, 4 doubles a vector with the
  partial sums in registers, in the order its docstring fixes (:func:`ordered_sums` is that
  order in NumPy: the stand-in under ``NUMBA_DISABLE_JIT`` and the specification the tests
  hold it to). Users: the norm kernels' row statistics (``_reduce._sum`` ..
  ``_sum_sq_dot_gu``) and the secular solver's bulk passes (:mod:`._secular`).
- :func:`block_writer`: a span of a row written from the formula, plain or with non-temporal
  stores (``layernorm._write_ln`` .., ``rmsnorm._write_rms`` ..).

Why by hand: without fast-math LLVM keeps a float sum scalar, and its loop vectorizer converts
float32 to float64 8 or 16 values wide, where on Zen 4 the 4-wide conversions are faster per
value; and Numba emits no streaming store from a loop (the docstrings below have the
measurements). The shared codegen pieces are :func:`is_row`, :func:`operands_ok`,
:func:`operands` and :func:`load_row_elements`. Numba's on-disk cache checks only the source
file of the function it caches: after an edit here, delete ``pyengine/kernels/_numba/__pycache__``.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._intrinsics import splat

__all__ = [
    "Ir",
    "SUM_VECTORS",
    "SUM_WIDTH",
    "WRITE_WIDTH",
    "block_writer",
    "is_row",
    "load_row_elements",
    "operands",
    "operands_ok",
    "ordered_sums",
    "row_sums",
]


class Ir:
    """An LLVM value with ``+``, ``-``, ``*`` and ``/`` (no fast-math flags: each operation
    rounded once, as written): the arithmetic of the formulas that :func:`block_writer` and
    :func:`row_sums` turn into vector code."""

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
    :func:`._intrinsics.store_fence` before its kernel returns. Why the norm kernels write their rows
    with it: LLVM vectorizes a Numba loop that converts float32 to float64 8 or 16 values
    wide, and on Zen 4 the 4-wide conversions (``vcvtps2pd ymm, m128``) are faster per
    value; and Numba emits no streaming store from a loop, so a streamed row used to be
    computed into a scratch row and copied out with an intrinsic of its own, two more passes
    over the block (``layernorm.STREAM_ROW_MIN_BYTES`` has the measurements). Call it from
    :data:`._jit.jit` / :data:`._jit.pjit` code only: a caller compiled with :data:`._jit.CONTRACT` may have its
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


#: Doubles per vector of the row sums of :func:`row_sums`, and vectors (partial sums in
#: registers) per sum by default.
SUM_WIDTH = 4
SUM_VECTORS = 4


def _tree(v):
    """Pairwise sum of the list ``v`` (length a power of two): ((v0 + v1) + (v2 + v3)) ..."""
    while len(v) > 1:
        v = [v[k] + v[k + 1] for k in range(0, len(v), 2)]
    return v[0]


def row_sums(terms, nsums, vectors=SUM_VECTORS):
    """The reduction ``sums(arrays, scalars)``: the ``nsums`` float64 sums over i of
    ``terms(*(a[i] for a in arrays), *scalars)``, in the order fixed below.

    ``terms`` builds the ``nsums`` terms of one element from the elements of the arrays
    (converted to float64) and the float64 scalars with ``+``, ``-``, ``*`` and ``/`` only,
    each rounded once as written (no fused multiply-add, no reordering). arrays : a tuple
    of 1-D C-contiguous float32 or float64 arrays of the length of the first; scalars : a
    tuple of numbers, possibly empty. Returns a tuple of ``nsums`` float64. ``vectors``: 1, 2
    or 4 (a power of two). Call it from ``jit`` / ``pjit`` code only: a caller compiled with
    ``_jit.CONTRACT`` may have its multiplies and adds fused.

    The order, with m = 4 * ``vectors`` partial sums per sum (16 by default): element
    i < m * (d // m) is added into partial sum i % m, in order of i; the vectors of 4
    partial sums (partial sums 4k .. 4k + 3 in vector k) are added pairwise, ((v0 + v1) +
    (v2 + v3)) for four, (v0 + v1) for two, and the four lanes of the result as
    ((l0 + l1) + (l2 + l3)); the d % m leftover terms are added last, in order. The same on
    every machine and at every alignment (unaligned loads).

    Why an intrinsic: the norm kernels' row sums are bound by the float32 -> float64
    conversions, and on Zen 4 a conversion of 4 floats into one 256-bit register
    (``vcvtps2pd ymm, m128``) goes about 1.3-1.5x faster per value than of 8 into a
    512-bit one, which is what LLVM's loop vectorizer picks for a Numba loop (the
    ``prefer-vector-width`` function attribute gives 8 floats at 256 bits, or 2 doubles
    at 128: neither). This code emits the 4-wide vectors itself and keeps the partial
    sums in registers, where the loops over ``LANES`` partial sums in a scratch array that
    it replaces (``acc[k] += ...``, four blocks of ``LANES`` per update) load and store
    them. One thread, a row of d = 768 in L1 (a jitted loop over the same row, Zen 4):
    sum(x) and sum(g * u) of float32 rows 208 -> 136 ns, sum((x - c)^2) and
    sum((x - c) g u) 257 -> 164 ns; float64 rows 199 -> 103 and 197 -> 111 ns; at
    d = 4096 (out of L1) 889 -> 714 and 1160 -> 848 ns. ``layer_norm_vjp`` at (1024, 768)
    float32, 2 threads: 797 -> 627 ns a row (C++ 453).
    """
    step = SUM_WIDTH * vectors

    if numba.config.DISABLE_JIT:  # pragma: no cover - intrinsics cannot run as Python

        def sums(arrays, scalars):
            """The same sums, in the same order, in NumPy."""
            return ordered_sums(terms, nsums, vectors, arrays, scalars)

        return sums

    @intrinsic
    def sums(typingctx, arrays, scalars):
        if not (operands_ok(arrays, scalars) and len(arrays) > 0):  # the first array gives d
            return None
        rty = types.UniTuple(types.float64, nsums)

        def codegen(context, builder, sig, args):
            aty, sty = sig.args
            arrs, cs = operands(context, builder, aty, sty, args[0], args[1], types.float64)
            intp = context.get_value_type(types.intp)
            dbl = ir.DoubleType()
            vty = ir.VectorType(dbl, SUM_WIDTH)
            i32 = ir.IntType(32)
            d = builder.extract_value(arrs[0].shape, 0)

            def element_terms(i, vector, consts):
                w = SUM_WIDTH if vector else None
                ys = terms(*load_row_elements(context, builder, arrs, aty, i, w, dbl), *consts)
                return [y.v for y in ys]

            vcs = [Ir(builder, splat(builder, c, SUM_WIDTH)) for c in cs]
            zero = ir.Constant(vty, [0.0] * SUM_WIDTH)
            part = [[cgutils.alloca_once_value(builder, zero) for _ in range(vectors)] for _ in range(nsums)]
            nstep = builder.udiv(d, intp(step))
            with cgutils.for_range(builder, nstep, intp=intp) as loop:
                base = builder.mul(loop.index, intp(step))
                for q in range(vectors):
                    ys = element_terms(builder.add(base, intp(q * SUM_WIDTH)), True, vcs)
                    for s in range(nsums):
                        builder.store(builder.fadd(builder.load(part[s][q]), ys[s]), part[s][q])
            total = []
            for s in range(nsums):
                q = _tree([Ir(builder, builder.load(a)) for a in part[s]]).v
                lanes = _tree([Ir(builder, builder.extract_element(q, i32(j))) for j in range(SUM_WIDTH)]).v
                total.append(cgutils.alloca_once_value(builder, lanes))
            scs = [Ir(builder, c) for c in cs]
            with cgutils.for_range_slice(builder, builder.mul(nstep, intp(step)), d, intp(1), intp) as (i, _):
                ys = element_terms(i, False, scs)
                for s in range(nsums):
                    builder.store(builder.fadd(builder.load(total[s]), ys[s]), total[s])
            return context.make_tuple(builder, rty, [builder.load(t) for t in total])

        return rty(arrays, scalars), codegen

    return sums


def ordered_sums(terms, nsums, vectors, arrays, scalars):
    """The sums of :func:`row_sums` ``(terms, nsums, vectors)`` over ``arrays`` and
    ``scalars``, computed in NumPy in the same order, bit for bit: its stand-in under
    ``NUMBA_DISABLE_JIT``, and its specification in the tests."""
    step = SUM_WIDTH * vectors
    cols = [np.asarray(a, dtype=np.float64) for a in arrays]
    with np.errstate(all="ignore"):  # as compiled code: 1/0 = inf, no warning
        ys = terms(*cols, *[np.float64(c) for c in scalars])
    d = cols[0].size
    body = d - d % step
    out = []
    for y in ys[:nsums]:
        p = np.zeros(step)
        for o in range(0, body, step):
            p += y[o : o + step]
        q = _tree([p[k : k + SUM_WIDTH] for k in range(0, step, SUM_WIDTH)])
        s = _tree([q[j] for j in range(SUM_WIDTH)])
        for i in range(body, d):
            s += y[i]
        out.append(float(s))
    return tuple(out)
