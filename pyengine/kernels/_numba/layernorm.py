"""Numba kernels of LayerNorm: forward, JVP, VJP and dense Jacobian (RMSNorm: :mod:`.rmsnorm`).

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference` (C-contiguous
float32 or float64 arrays, preallocated ``out``, the number of bad rows returned);
the formulas are in its docstring and in DESIGN.md.

Layout of every kernel: a per-token core ``_<kernel id>_row`` works on one row, and
the registered batch kernel runs it under ``prange`` over chunks of rows only, so each row is
computed by one thread in an order fixed by the source, and results do not depend
on the number of threads. Inside a row there are at most three passes over ``d``:

1. sums of x (and of the tangent w = v, or g * u for a VJP);
2. with the mean known, sums of (x - mu)^2 (and (x - mu) * w): two-pass variance,
   never E[x^2] - E[x]^2; RMSNorm needs only this pass, with centre 0;
3. the output, written once, cast to the dtype of ``out`` only on the store; in
   the same loop the next row is prefetched (see ``_BLOCK``) and the output lines
   ahead are asked for with write intent (see ``_WRITE_AHEAD``), or, for the rows of a
   large output, each block is streamed out from the registers (see
   ``STREAM_SHORT_ROW_MIN_BYTES`` and ``STREAM_ROW_MIN_BYTES``). Two exceptions, as in
   the C++ kernels, both in LayerNorm's forward pass on float32 rows: it computes its
   output in float32 (:func:`_layer_norm_write_f32`), and its pass 2 takes the squared
   deviations from float32(mu) in float32 (:func:`_ln_stats`).

Every reduction accumulates in float64, also for float32 input, in an order fixed by the
source: the row sums are LLVM vector code with 16 partial sums in registers
(:func:`._formula.row_sums`), and the forward's float32 pass 2 adds groups of four float32
squares into ``LANES`` partial sums in a scratch ``acc`` (:func:`._reduce._sum_sq_f32`):
:mod:`._reduce` explains why they look the way they do.

``acc`` (LayerNorm's forward and dense Jacobian only) has shape ``(2, LANES)``. The batch
kernels write ``acc = np.empty(...)`` at
the top of the ``prange`` body, and Numba's parfor pass hoists that allocation out
of the loop: it runs once per thread (per scheduled chunk of rows), not per row,
and each thread gets its own scratch (``kernel.parallel_diagnostics(level=4)``
reports it under "Allocation hoisting"). ``numba.get_num_threads()`` cannot be used
to preallocate instead: it makes a function uncacheable.

The cores are plain ``jit`` functions; LLVM decides whether to inline them (inlining all
of them made compilation slower and the kernels no faster). LayerNorm's forward statistics
(:func:`_ln_stats`) and its float32 writing pass (:func:`_layer_norm_write_f32`) are
``inline``, as are the row sums of :mod:`._reduce` and RMSNorm's statistics: LLVM left them
as calls with their exploded array arguments, measurably slower on short rows
(docs/design.md). The batch kernels share the rows out in ``_CHUNKS`` chunks of contiguous
rows, so the row a core prefetches is almost always its own thread's next one. Outputs are
written with plain stores, except the dense Jacobians' (streamed, see
:func:`_dense_jacobian`) and the rows of large outputs (:data:`STREAM_SHORT_ROW_MIN_BYTES`,
:data:`STREAM_ROW_MIN_BYTES`), which the norm kernels stream out with non-temporal stores
straight from the registers. Every writing pass is a :func:`._formula.block_writer` (the
row's formula as 4-wide LLVM vector code, plain or streaming stores) called once per block
of ``_BLOCK`` values, between the block's prefetches.

Longer than ~400 lines by exception: the row schedule (``_BLOCK``, ``_CHUNKS``,
``_WRITE_AHEAD``, the ``STREAM_*`` thresholds, the prefetch helpers), which RMSNorm, the
softmax and the score gradient import from here, stays in this module: moved into a module
of its own with the same code, it made ``layer_norm`` slower (docs/design.md).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ...backends import register
from ._formula import block_writer
from ._intrinsics import prefetch, prefetch_write, store_fence, stream_affine
from ._jit import inline, jit, pjit
from ._reduce import (
    LANES,
    _f64,
    _ln_slow,
    _safe,
    _scale,
    _sum,
    _sum_pair,
    _sum_pair_gu,
    _sum_sq,
    _sum_sq_f32,
    _sum_sq_dot,
    _sum_sq_dot_gu,
)

__all__ = [
    "LANES",
    "layer_norm",
    "layer_norm_jacobian",
    "layer_norm_jvp",
    "layer_norm_vjp",
]


# --------------------------------------------------------------------------- #
# Row statistics (the sums are in _reduce.py).
# --------------------------------------------------------------------------- #

#: A row whose variance is below this times mu^2 is checked for being exactly
#: constant (see :func:`_constant`). Rounding of the mean leaves a constant row a
#: variance of at most about (d * 2^-52 * mu)^2, far below this threshold.
NEAR_CONSTANT = 1e-16


@jit
def _constant(x, mu, q):
    """True if the row is exactly constant; scanned only when its variance q/d is tiny.

    A constant row has variance exactly 0, but the rounded mean can leave it a
    variance of ~1e-34 instead, and whether it does depends on summation order.
    The kernel contract (see the reference) makes such a row's mean x[0] and its
    variance 0 in every backend, so eps = 0 flags it bad everywhere.
    """
    if not q <= NEAR_CONSTANT * mu * mu * x.size:
        return False
    for i in range(1, x.size):
        if x[i] != x[0]:
            return False
    return True


@inline
def _ln_stats(x, eps, acc, f32_var):
    """(mu, s, bad) of one row: mean, sqrt(var + eps) with the two-pass variance.

    With ``f32_var`` on a float32 row (LayerNorm's forward: the C++ ``ln_mean_var`` for
    float) pass 2 runs in float32: the mean in float64 as always, m = float32(mu), then
    var = mean((x - m)^2) - (mu - m)^2 (sum (x - m)^2 = sum (x - mu)^2 + d (mu - m)^2) with
    the squares summed by :func:`_sum_sq_f32`; rows whose float32 squares may overflow or
    underflow (var outside [2^-60, 2^100]) take the float64 pass. The result is within a few
    float32 roundings of the float64 pass, relative (the float32 output carries that
    much anyway), and the pass runs 16 lanes wide without conversions: ``layer_norm`` at
    (2048, 768) float32 2 threads 0.665 -> 0.45-0.57 ms, (2048, 4096) 4.68 -> 4.04-4.08 ms
    (Zen 4, medians of interleaved calls)."""
    d = x.size
    mu = _sum(x) / d
    q = -1.0
    if f32_var and x.itemsize == 4:
        m = np.float32(mu)
        sh = mu - _f64(m)
        var = _sum_sq_f32(x, m, acc) / d - sh * sh
        if var >= 2.0**-60 and var <= 2.0**100:
            q = var * d
    if q < 0.0:
        q = _sum_sq(x, mu)
    if _constant(x, mu, q):
        mu, q = _f64(x[0]), 0.0
    if not _safe(q / d, eps, mu):  # a row of extreme magnitude: its statistics, rescaled
        mu, s, _, bad = _ln_slow(x, eps, x, x, False, False)
        return mu, s, bad
    s, bad = _scale(q / d, eps)
    return mu, s, bad or not np.isfinite(mu)


# --------------------------------------------------------------------------- #
# The writing pass prefetches the next row.
# --------------------------------------------------------------------------- #

#: Output elements per block of the writing pass. Before each block the same span
#: of the next row is prefetched, so that row streams in from memory while this
#: one is computed and written (the hardware prefetchers follow only the rows
#: being read, so memory would otherwise idle between a row's first pass and the
#: next row's). Measured on Zen 3: LayerNorm and its JVP about 1.2x faster.
_BLOCK = 64
#: Bytes per cache line (64 on x86-64 and on most AArch64).
_LINE = 64
#: Chunks of contiguous rows (each run by one thread, rows in order).
_CHUNKS = 256


#: Bytes ahead of the element being written at which the writing pass asks for its output
#: lines (:func:`._intrinsics.prefetch_write`). A plain store to a line that is not in cache first
#: reads it (read-for-ownership), and without the hint those reads start one line at a
#: time as the stores reach them, so memory waits (the six norm kernels are 10-25 % faster
#: with it when writing to memory; docs/design.md). A
#: row's first bytes are asked for before its statistics (:func:`_prefetch_out_head`);
#: asking for the next row's instead, from inside the loop, made the loop 2x slower in
#: cache (a second output array in the loop).
_WRITE_AHEAD = 2048

#: Jacobians of at least this many bytes are written with non-temporal stores (the C++
#: kernels' ``kStreamMinBytes``, ``csrc/rows.hpp``): a (n, d, d) output cannot stay in any
#: cache, and a plain store first reads its line (read-for-ownership), as much memory
#: traffic again as the write. Smaller outputs stay in cache for the caller. The norm
#: kernels' rows also need :data:`STREAM_SHORT_ROW_MIN_BYTES` (:data:`STREAM_ROW_MIN_BYTES` for
#: LayerNorm's forward pass).
STREAM_MIN_BYTES = 16 << 20


@inline
def _prefetch_block(a, o):
    """Prefetch a[o : o + _BLOCK], one element per cache line, if it lies inside ``a``."""
    if o + _BLOCK <= a.size:
        for k in range(0, _BLOCK, _LINE // a.itemsize):
            prefetch(a, o + k)


@inline
def _prefetch_out(out, o, stream):
    """Prefetch for writing the block of ``out`` :data:`_WRITE_AHEAD` bytes past ``out[o]``,
    if it lies inside the row (:func:`_prefetch_out_head` asks for a row's first bytes);
    nothing when the row is streamed (:func:`_stream_rows`)."""
    if not stream:
        a = o + _WRITE_AHEAD // out.itemsize
        if a + _BLOCK <= out.size:
            for k in range(0, _BLOCK, _LINE // out.itemsize):
                prefetch_write(out, a + k)


@inline
def _prefetch_row_ahead(outf, o, m):
    """Ask for writing (:func:`._intrinsics.prefetch_write`) the m output values that start
    ``_WRITE_AHEAD`` bytes past outf[o] (a later row), if they lie inside ``outf``: for the
    short rows of the softmax kernels and the attention score gradient (Tk = 128: 512
    bytes), so the hint runs per row, some rows ahead, where :func:`_prefetch_out` runs per
    block inside a long row. A plain store to a line not in cache first
    reads it, one line at a time as the stores reach it; softmax_jvp at (64, 12, 128, 128)
    float32 6.1 -> 3.6 ms with the hint (C++, which streams, 3.6-3.8; 1, 2, 4, 8 KiB ahead:
    3.8, 3.6, 3.6, 3.7). Rows longer than ``_WRITE_AHEAD`` bytes get none: a whole row's
    lines at once overflow the line-fill buffers (one head of T = 2000: 2.1 -> 2.3 ms)."""
    a = o + _WRITE_AHEAD // outf.itemsize
    if m * outf.itemsize <= _WRITE_AHEAD and a + m <= outf.size:
        for k in range(0, m, 64 // outf.itemsize):
            prefetch_write(outf, a + k)


@inline
def _prefetch_out_head(out, stream):
    """Prefetch for writing the first :data:`_WRITE_AHEAD` bytes of ``out``, before the row's
    statistics, so they arrive while the sums run; nothing when the row is streamed."""
    if not stream:
        for k in range(0, min(_WRITE_AHEAD // out.itemsize, out.size), _LINE // out.itemsize):
            prefetch_write(out, k)


# --------------------------------------------------------------------------- #
# Long rows of large outputs are streamed out.
# --------------------------------------------------------------------------- #

#: Rows of at least this many bytes, in outputs of at least :data:`STREAM_MIN_BYTES`, are
#: written with non-temporal stores (:func:`_stream_rows`); shorter rows with plain stores and
#: the write prefetch (:data:`_WRITE_AHEAD`). A plain store first reads its line, so a norm
#: kernel writing to memory moves 3 bytes for every 2 it needs (4 for 3 with a tangent).
#: Streamed, the writing pass sends each vector out as it is computed
#: (:func:`._formula.block_writer`), as the C++ kernels do. LayerNorm's forward pass keeps
#: this threshold: on rows of d = 768 float32 it is bound by its arithmetic, and streamed its
#: time is the sum of the arithmetic and the streaming stores, not the larger of the two
#: (docs/design.md). The other norm kernels stream from 2 KiB
#: (:data:`STREAM_SHORT_ROW_MIN_BYTES`).
STREAM_ROW_MIN_BYTES = 8 << 10

#: Rows of at least this many bytes, in outputs of at least :data:`STREAM_MIN_BYTES`, are
#: streamed by all norm kernels but LayerNorm's forward pass (:data:`STREAM_ROW_MIN_BYTES`).
#: Streamed from the registers, rows of d = 768 float32 (3 KiB) in a large output come out
#: slightly faster for every norm kernel but ``layer_norm`` (its float32 pass has too little
#: arithmetic to hide the streaming stores behind), and the kernels stream where the C++
#: kernels do (every output of 16 MiB or more), at the cost of leaving such an output out of
#: the last-level cache for the caller (docs/design.md).
STREAM_SHORT_ROW_MIN_BYTES = 2 << 10


@jit
def _stream_rows(out, min_row):
    """Whether a norm kernel streams the rows of ``out`` (n, d): at least
    :data:`STREAM_MIN_BYTES` in all, rows of at least ``min_row`` bytes
    (:data:`STREAM_SHORT_ROW_MIN_BYTES`, or :data:`STREAM_ROW_MIN_BYTES` for LayerNorm's forward
    pass), and every row starting on a 16-byte boundary (:func:`._formula.block_writer` streams 16
    bytes at a time; a row's partial first and last lines then come whole from two streamed
    rows)."""
    row = out.shape[1] * out.itemsize
    return (out.size * out.itemsize >= STREAM_MIN_BYTES and row >= min_row and row % 16 == 0
            and out.ctypes.data % 16 == 0)


# --------------------------------------------------------------------------- #
# Per-token cores. x, v, u, out : (d,); gamma, beta : (d,); acc : (2, LANES) (forward only).
# x_next (and v_next / u_next): the row(s) of the next token, prefetched while
# this one is written; pass the row itself when there is none. stream: False (the row is
# written with plain stores, its lines prefetched for writing: _prefetch_out_head,
# _prefetch_out) or True (streaming stores, see _stream_rows).
# Each returns True for a bad row (its output is then unspecified).
# --------------------------------------------------------------------------- #

# The writing passes: out[o : o + m] = the row's formula, in float64 (converted on load, cast on
# the store), each operation rounded once as written (see _formula.block_writer).
_write_ln = block_writer(lambda g, x, b, mu, inv: g * ((x - mu) * inv) + b)
_write_ln_jvp = block_writer(lambda g, v, x, mv, m2, mu, inv: g * (((v - mv) - ((x - mu) * inv) * m2) * inv))
_write_ln_vjp = block_writer(lambda g, u, x, mg, m2, mu, inv: ((g * u - mg) - ((x - mu) * inv) * m2) * inv)
#: LayerNorm's float32 forward pass, in float32 (:func:`_layer_norm_write_f32`).
_write_ln_f32 = block_writer(lambda g, x, b, mh, ml, fi: g * (((x - mh) - ml) * fi) + b, f32=True)


@jit
def _layer_norm_row(x, gamma, beta, eps, out, acc, x_next, stream):
    """out = gamma * (x - mu) / s + beta."""
    d = x.size
    _prefetch_out_head(out, stream)
    mu, s, bad = _ln_stats(x, eps, acc, True)
    inv = 1.0 / s
    if out.itemsize == 4 and _f32_pass_ok(mu, inv):
        _layer_norm_write_f32(x, gamma, beta, mu, inv, out, x_next, stream)
        return bad
    nb = d // _BLOCK
    for j in range(nb):
        o = j * _BLOCK
        _prefetch_block(x_next, o)
        _prefetch_out(out, o, stream)
        _write_ln(out, o, _BLOCK, stream, (gamma, x, beta), (mu, inv))
    _write_ln(out, nb * _BLOCK, d - nb * _BLOCK, stream, (gamma, x, beta), (mu, inv))
    return bad


@jit
def _f32_pass_ok(mu, inv):
    """Whether LayerNorm's float32 output pass may run in float32 (C++ ``f32_output_pass_ok``):
    1/s and mu well inside float32's range; other rows keep the float64 pass."""
    return inv >= 2.0**-100 and inv <= 2.0**100 and abs(mu) <= 2.0**100


@inline
def _layer_norm_write_f32(x, gamma, beta, mu, inv, out, x_next, stream):
    """The writing pass of a float32 row in float32 (the C++ kernel's ``write_row_f32``).

    gamma * (((x - mu_hi) - mu_lo) * inv) + beta with mu = mu_hi + mu_lo to about 2^-48
    relative, which keeps the centring exact enough for rows of large mean; the result is
    within a few float32 ulps of the float64 pass, inside the float32 tolerance, and the
    loop runs 16 lanes wide with no conversions (in cache about 2x faster than the
    float64 pass). Compiled for float64 rows too, where it is never called (the caller
    tests ``out.itemsize``).
    """
    d = x.size
    mh = np.float32(mu)
    ml = np.float32(mu - _f64(mh))
    fi = np.float32(inv)
    nb = d // _BLOCK
    for j in range(nb):
        o = j * _BLOCK
        _prefetch_block(x_next, o)
        _prefetch_out(out, o, stream)
        _write_ln_f32(out, o, _BLOCK, stream, (gamma, x, beta), (mh, ml, fi))
    _write_ln_f32(out, nb * _BLOCK, d - nb * _BLOCK, stream, (gamma, x, beta), (mh, ml, fi))


@jit
def _layer_norm_jvp_row(x, v, gamma, eps, frozen, out, x_next, v_next, stream):
    """out = gamma/s * (v - mean v - xh mean(xh v)); frozen drops the xh term."""
    d = x.size
    _prefetch_out_head(out, stream)
    sx, sv = _sum_pair(x, v)
    mu = sx / d
    mv = sv / d
    if frozen:
        q = _sum_sq(x, mu)
        dot = 0.0
    else:
        q, dot = _sum_sq_dot(x, mu, v)
    if _constant(x, mu, q):
        mu, q, dot = _f64(x[0]), 0.0, 0.0
    if _safe(q / d, eps, mu):
        s, bad = _scale(q / d, eps)
        inv = 1.0 / s
        m2 = dot * inv / d  # mean(xh * v), xh = (x - mu) / s
    else:  # a row of extreme magnitude: its statistics, rescaled
        mu, s, m2, bad = _ln_slow(x, eps, v, gamma, False, not frozen)
        inv = 1.0 / s
    nb = d // _BLOCK
    for j in range(nb):
        o = j * _BLOCK
        _prefetch_block(x_next, o)
        _prefetch_block(v_next, o)
        _prefetch_out(out, o, stream)
        _write_ln_jvp(out, o, _BLOCK, stream, (gamma, v, x), (mv, m2, mu, inv))
    _write_ln_jvp(out, nb * _BLOCK, d - nb * _BLOCK, stream, (gamma, v, x), (mv, m2, mu, inv))
    return bad or not (np.isfinite(mu) and np.isfinite(mv) and np.isfinite(m2))


@jit
def _layer_norm_vjp_row(x, u, gamma, eps, frozen, out, x_next, u_next, stream):
    """out = (g - mean g - xh mean(xh g)) / s with g = gamma * u; frozen drops the xh term."""
    d = x.size
    _prefetch_out_head(out, stream)
    sx, sg = _sum_pair_gu(x, gamma, u)
    mu = sx / d
    mg = sg / d
    if frozen:
        q = _sum_sq(x, mu)
        dot = 0.0
    else:
        q, dot = _sum_sq_dot_gu(x, mu, gamma, u)
    if _constant(x, mu, q):
        mu, q, dot = _f64(x[0]), 0.0, 0.0
    if _safe(q / d, eps, mu):
        s, bad = _scale(q / d, eps)
        inv = 1.0 / s
        m2 = dot * inv / d  # mean(xh * g)
    else:  # a row of extreme magnitude: its statistics, rescaled
        mu, s, m2, bad = _ln_slow(x, eps, u, gamma, True, not frozen)
        inv = 1.0 / s
    nb = d // _BLOCK
    for j in range(nb):
        o = j * _BLOCK
        _prefetch_block(x_next, o)
        _prefetch_block(u_next, o)
        _prefetch_out(out, o, stream)
        _write_ln_vjp(out, o, _BLOCK, stream, (gamma, u, x), (mg, m2, mu, inv))
    _write_ln_vjp(out, nb * _BLOCK, d - nb * _BLOCK, stream, (gamma, u, x), (mg, m2, mu, inv))
    return bad or not (np.isfinite(mu) and np.isfinite(mg) and np.isfinite(m2))


@jit
def _affine(dst, src, a, b, c):
    """dst[j] = a * (b - c * src[j]): the plain-store twin of :func:`._intrinsics.stream_affine`."""
    for j in range(src.size):
        dst[j] = a * (b - c * src[j])


@pjit
def _dense_jacobian(x, gamma, centre, scale, c0, frozen, out):
    """out[r, i, :] = row i of token r's Jacobian, J = diag(gamma)/s (I - c0 - xh xh^T / d).

    x : (n, d); gamma : (d,); centre, scale : (n,) float64 (mu and s of each token;
    0 and r for RMSNorm); out : (n, d, d). LayerNorm: c0 = 1/d; RMSNorm: c0 = 0; the
    xh term is dropped when ``frozen``. The second pass of the Jacobian kernels, after
    their statistics: xh = (x - centre) / s of each token in float64, then ``prange``
    over chunks of the n * d output rows, so that one token also uses every thread, as
    ``dense_jacobian`` in ``csrc/layernorm.hpp``. Each output row is written by one
    thread, the same values whatever the thread count. A large output
    (:data:`STREAM_MIN_BYTES`) is written with non-temporal stores
    (:func:`._intrinsics.stream_affine`, the same expression; one :func:`._intrinsics.store_fence`
    per chunk): the same values, bit for bit.
    """
    n, d = x.shape
    xh = np.empty((n, d), dtype=np.float64)
    for r in prange(n):
        inv = 1.0 / scale[r]
        for j in range(d):
            xh[r, j] = (_f64(x[r, j]) - centre[r]) * inv
    m = n * d
    stream = out.size * out.itemsize >= STREAM_MIN_BYTES
    nc = min(m, _CHUNKS)
    for c in prange(nc):
        for k in range(c * m // nc, (c + 1) * m // nc):
            r = k // d
            i = k - r * d
            a = _f64(gamma[i]) / scale[r]
            ci = 0.0 if frozen else xh[r, i] / d
            if stream:
                # [0, i) and (i, d), each with plain stores on its partial lines: the
                # diagonal's line is then never streamed and overwritten (a flush and a reload).
                stream_affine(out[r, i, :i], xh[r, :i], a, 0.0 - c0, ci)
                stream_affine(out[r, i, i + 1 :], xh[r, i + 1 :], a, 0.0 - c0, ci)
            else:
                _affine(out[r, i], xh[r], a, 0.0 - c0, ci)
            out[r, i, i] = a * ((1.0 - c0) - ci * xh[r, i])  # delta_ii = 1
        if stream:
            store_fence()


# --------------------------------------------------------------------------- #
# Registered batch kernels: prange over chunks of rows (tokens) only. Row r prefetches
# row nx = min(r + 1, n - 1); when r + 1 belongs to another thread that is harmless.
# The JVP and VJP kernels of both norms share one shell (_tangent_batch). The forward
# kernels keep their own: LayerNorm's row takes a per-thread scratch ``acc`` allocated at
# the top of the prange body and a beta, and streams from STREAM_ROW_MIN_BYTES; a shared
# shell would need a scratch and parameter-tuple adapter per norm plus a wrapper per norm
# (the registry checks the parameter names), more code than the loop it would share.
# --------------------------------------------------------------------------- #


@register("layer_norm", "numba")
@pjit
def layer_norm(x, gamma, beta, eps, out):
    """x, out : (n, d); gamma, beta : (d,). Returns the number of bad rows."""
    n = x.shape[0]
    nbad = 0
    nc = min(n, _CHUNKS)
    stream = _stream_rows(out, STREAM_ROW_MIN_BYTES)
    for c in prange(nc):
        acc = np.empty((2, LANES), dtype=np.float64)  # hoisted: once per thread
        for r in range(c * n // nc, (c + 1) * n // nc):
            nx = min(r + 1, n - 1)
            if _layer_norm_row(x[r], gamma, beta, eps, out[r], acc, x[nx], stream):
                nbad += 1
        if stream:
            store_fence()
    return nbad


def _tangent_batch(core):
    """The batch kernel of a JVP or VJP row core (LayerNorm's or RMSNorm's), the only part they differ in.

    ``core(x, t, gamma, eps, frozen, out, x_next, t_next, stream)`` computes one row and
    returns True for a bad row. Returns a ``pjit`` function ``(x, t, gamma, eps, frozen, out)``
    -> the number of bad rows, which the registered kernel calls under its own parameter
    names (``v`` or ``u``: the registry checks them against the reference). Each call makes
    a new function closing over its own core: Numba's on-disk cache keys it by the closure's
    contents too, so the kernels' cached machine code stays apart.
    """

    @pjit
    def batch(x, t, gamma, eps, frozen, out):
        n = x.shape[0]
        nbad = 0
        nc = min(n, _CHUNKS)
        stream = _stream_rows(out, STREAM_SHORT_ROW_MIN_BYTES)
        for c in prange(nc):
            for r in range(c * n // nc, (c + 1) * n // nc):
                nx = min(r + 1, n - 1)
                if core(x[r], t[r], gamma, eps, frozen, out[r], x[nx], t[nx], stream):
                    nbad += 1
            if stream:
                store_fence()
        return nbad

    return batch


_layer_norm_jvp_batch = _tangent_batch(_layer_norm_jvp_row)
_layer_norm_vjp_batch = _tangent_batch(_layer_norm_vjp_row)


@register("layer_norm_jvp", "numba")
@jit
def layer_norm_jvp(x, v, gamma, eps, frozen, out):
    """x, v, out : (n, d); gamma : (d,). Returns the number of bad rows."""
    return _layer_norm_jvp_batch(x, v, gamma, eps, frozen, out)


@register("layer_norm_vjp", "numba")
@jit
def layer_norm_vjp(x, u, gamma, eps, frozen, out):
    """x, u, out : (n, d); gamma : (d,). Returns the number of bad rows."""
    return _layer_norm_vjp_batch(x, u, gamma, eps, frozen, out)


@register("layer_norm_jacobian", "numba")
@pjit
def layer_norm_jacobian(x, gamma, eps, frozen, out):
    """x : (n, d); gamma : (d,); out : (n, d, d). Returns the number of bad rows."""
    n = x.shape[0]
    mu = np.empty(n, dtype=np.float64)
    s = np.empty(n, dtype=np.float64)
    bad = np.empty(n, dtype=np.bool_)
    for r in prange(n):
        acc = np.empty((2, LANES), dtype=np.float64)  # hoisted: once per thread
        mu[r], s[r], bad[r] = _ln_stats(x[r], eps, acc, False)
    _dense_jacobian(x, gamma, mu, s, 1.0 / x.shape[1], frozen, out)
    return np.count_nonzero(bad)
