"""Row reductions shared by the Numba kernels: float64 sums in lanes, in a fixed order.

Longer than ~400 lines by exception: every helper follows the one summation order and scratch
layout (``LANES``, ``acc``) that this docstring specifies, and moving Numba helpers between
modules has changed the callers' speed (see ``layernorm.py``), so they stay together.

Used by :mod:`pyengine.kernels._numba.layernorm` and :mod:`.rmsnorm` (row statistics and
the JVP/VJP sums: :func:`_sum` .. :func:`_sum_sq_dot_gu`, :func:`_sum_sq_f32`), the
attention kernels (:func:`_dot_lanes`, :func:`_sum_lanes` over padded rows) and
:mod:`pyengine.kernels._numba.spectral` and :mod:`pyengine.kernels._numba._secular` (row
statistics, the solver's bulk passes through :func:`._formula.row_sums`, and ``LANES``,
:func:`_zero` and :func:`_fold` for the power iteration's fused passes). Every reduction
accumulates in float64, also for float32 input (:func:`_sum_sq_f32` adds float32 groups of
four squares); ``x``, ``w``, ``g``, ``u`` are rows ``(d,)``, ``c`` a float64 centre (the
mean, or 0 for RMSNorm), ``acc`` a float64 scratch of shape ``(2, LANES)`` (or more rows)
owned by the calling thread (for the helpers that keep their partial sums in one).

Why the reductions look the way they do: without fast-math (see ``_jit.FASTMATH``)
LLVM may not reorder a float sum, so ``s += x[i]`` stays scalar, and Numba leaves
LLVM's SLP vectorizer off, so unrolled scalar accumulators stay scalar too. Two ways
around that, each in an order fixed by the source, so results are the same on every
machine, whatever its vector width:

- The norm kernels' row sums and the secular solver's bulk passes are emitted as LLVM
  vector code by :func:`._formula.row_sums`: 4 doubles a vector, the partial sums in registers
  (its docstring gives the order, and the measurements that made it replace the loops
  below for these sums).
- The other helpers keep ``LANES`` partial sums in a small scratch array ``acc``: the
  loop ``acc[k] += ...`` over k is element-wise, which the loop vectorizer handles
  without reassociation. Four blocks of ``LANES`` values are added (in a fixed
  pairwise order) before each update of ``acc`` where the helper allows it, so that the
  scratch is loaded and stored once per four blocks. The partial sums are then folded
  pairwise (:func:`_fold`) and the ``d % LANES`` leftover values added last.

Helpers are passed no function arguments (a dispatcher argument makes the caller
uncacheable), hence one small reduction helper per combination of sums. The row sums of
the norm kernels (:func:`_sum` .. :func:`_sum_sq_dot_gu`) are ``inline="always"``: LLVM left
them as calls with exploded array arguments, a few tens of ns a row (measured with the loops
over ``LANES`` that :func:`._formula.row_sums` replaced; with LayerNorm's
statistics inlined too: a forward row of d = 768 in L1 390 -> 304 ns; the JVP/VJP kernels
at (2048, 768) float32 2-6 % faster; compiling the six norm kernels for both dtypes 25.5
-> 26.2 s).

Caching: the kernels that call these helpers live in other modules, and Numba's
on-disk cache (``cache=True``) checks only the source file of the function it
caches. After an edit to *this* file, delete ``pyengine/kernels/_numba/__pycache__`` (or
touch the calling modules) so the callers are recompiled.
"""

from __future__ import annotations

import math

import numpy as np

from ._formula import row_sums
from ._jit import inline, jit

__all__ = [
    "LANES",
    "_dot_lanes",
    "_fold",
    "_fold2",
    "_max_fold",
    "_max_lanes",
    "_mean_sq",
    "_scale",
    "_padded",
    "_sum",
    "_sum_pair",
    "_sum_pair_gu",
    "_sum_sq",
    "_sum_sq_f32",
    "_sum_sq_dot",
    "_sum_dot_lanes",
    "_sum_lanes",
    "_sum_sq_dot_gu",
    "_zero",
    "SAFE_HIGH",
    "SAFE_LOW",
    "_ln_slow",
    "_rms_slow",
    "_row_scale",
    "_safe",
]

#: Partial sums per reduction (a power of two). Large enough that LLVM keeps the
#: loop over lanes a loop and vectorizes it (it fully unrolls short constant loops,
#: and unrolled scalar code is not vectorized without SLP); small enough that the
#: scratch, 2 * LANES float64, stays in L1 next to a row.
LANES = 64
_QUAD = 4 * LANES

_f64 = np.float64


# --------------------------------------------------------------------------- #
# Reductions over one row, float64, in a fixed order.
# --------------------------------------------------------------------------- #


@jit
def _zero(acc, m):
    """Set the first ``m`` rows of the scratch ``acc`` (m, LANES) or larger to 0."""
    for j in range(m):
        a = acc[j]
        for k in range(LANES):
            a[k] = 0.0


@jit
def _fold(a):
    """Sum of the ``LANES`` partial sums in ``a``, pairwise, in a fixed order (overwrites ``a``)."""
    h = LANES // 2
    while h > 0:
        for k in range(h):
            a[k] += a[k + h]
        h //= 2
    return a[0]


@jit
def _fold2(a, b):
    """(_fold(a), _fold(b)) in one loop: the same sums, bit for bit, with the two chains of
    dependent adds interleaved (each level waits on the one before; a fold costs ~16 ns)."""
    h = LANES // 2
    while h > 0:
        for k in range(h):
            a[k] += a[k + h]
            b[k] += b[k + h]
        h //= 2
    return a[0], b[0]


_sums_x = row_sums(lambda x: (x,), 1)
_sums_pair = row_sums(lambda x, w: (x, w), 2)
_sums_pair_gu = row_sums(lambda x, g, u: (x, g * u), 2)
_sums_sq = row_sums(lambda x, c: ((x - c) * (x - c),), 1)
_sums_sq_dot = row_sums(lambda x, w, c: ((x - c) * (x - c), (x - c) * w), 2)
_sums_sq_dot_gu = row_sums(lambda x, g, u, c: ((x - c) * (x - c), (x - c) * (g * u)), 2)


@inline
def _sum(x):
    """sum(x) in float64. x : (d,)."""
    return _sums_x((x,), ())[0]


@inline
def _sum_pair(x, w):
    """(sum(x), sum(w)) in float64. x, w : (d,)."""
    return _sums_pair((x, w), ())


@inline
def _sum_pair_gu(x, g, u):
    """(sum(x), sum(g * u)) in float64. x, u : (d,); g : (d,)."""
    return _sums_pair_gu((x, g, u), ())


@inline
def _sum_sq(x, c):
    """sum((x - c)^2) in float64. x : (d,); c : float (mu, or 0 for RMSNorm)."""
    return _sums_sq((x,), (c,))[0]


@inline
def _sum_sq_dot(x, c, w):
    """(sum((x - c)^2), sum((x - c) * w)) in float64. x, w : (d,); c : float."""
    return _sums_sq_dot((x, w), (c,))


@inline
def _sum_sq_dot_gu(x, c, g, u):
    """(sum((x - c)^2), sum((x - c) * (g * u))) in float64. x, u : (d,); g : (d,); c : float."""
    return _sums_sq_dot_gu((x, g, u), (c,))


@inline
def _sum_sq_rest(x, c, a, start):
    """The end of :func:`_sum_sq_f32`: the whole blocks of ``LANES`` from
    block ``start`` on added into the float64 lanes ``a``, the lanes folded, the
    ``d % LANES`` leftover values added last; returns sum((x - c)^2) of the row."""
    d = x.size
    for j in range(start, d // LANES):
        o = j * LANES
        for k in range(LANES):
            t0 = _f64(x[o + k]) - c
            a[k] += t0 * t0
    s = _fold(a)
    for i in range(d - d % LANES, d):
        t0 = _f64(x[i]) - c
        s += t0 * t0
    return s


@inline
def _sum_sq_f32(x, m, acc):
    """sum((x - m)^2) of a float32 row with m a float32 centre: the differences, their
    squares and the pairwise sums of four squares in float32 (16 lanes a vector, no
    conversions), each such sum widened and added into the float64 lanes; the values
    past the last block of 4 * LANES widened first, as in :func:`_sum_sq`. Each difference
    is one float32 rounding relative to itself and every term is positive, so the result is
    within about five float32 roundings of the exact sum, relative (the LayerNorm
    forward's variance pass for float32 rows: ``layernorm._ln_stats``)."""
    d = x.size
    _zero(acc, 1)
    a = acc[0]
    nq = d // _QUAD
    for j in range(nq):
        o = j * _QUAD
        for k in range(LANES):
            t0 = x[o + k] - m
            t1 = x[o + LANES + k] - m
            t2 = x[o + 2 * LANES + k] - m
            t3 = x[o + 3 * LANES + k] - m
            a[k] += _f64((t0 * t0 + t1 * t1) + (t2 * t2 + t3 * t3))
    return _sum_sq_rest(x, _f64(m), a, 4 * nq)


@jit
def _mean_sq(x, centre):
    """(mu, mean((x - mu)^2)) in float64 by two passes; mu = 0 (no centring) unless ``centre``."""
    d = x.size
    mu = _sum(x) / d if centre else 0.0
    return mu, _sum_sq(x, mu) / d


@jit
def _scale(ms, eps):
    """(sqrt(ms + eps), bad): bad when ms + eps is not finite or not > 0 (then the scale is 1)."""
    sq = ms + eps
    if np.isfinite(sq) and sq > 0.0:
        return np.sqrt(sq), False
    return 1.0, True


# --------------------------------------------------------------------------- #
# Rows of extreme magnitude: the statistics again, of the row scaled by 2^-e.
# --------------------------------------------------------------------------- #

#: The fast path's statistics keep full precision while the squared scale
#: ms + eps lies in [SAFE_LOW, SAFE_HIGH]: no square that matters is subnormal, and no
#: sum of squares or of products with an ordinary tangent overflows. Outside (rows
#: like 1e-160 or 1e+200, or a sum that overflowed) the row is redone by
#: :func:`_ln_slow` / :func:`_rms_slow` on the row scaled by a power of two, as the
#: reference (``_reference.layernorm.row_scale``) does for every row.
SAFE_LOW = 2.0**-960
SAFE_HIGH = 2.0**960


@jit
def _safe(ms, eps, mu):
    """True when the fast path's (mean square ms, mean mu) need no rescaling."""
    sq = ms + eps
    return sq >= SAFE_LOW and sq <= SAFE_HIGH and np.isfinite(mu)


@jit
def _row_scale(x, eps):
    """c = 2^-e that brings max(max|x|, sqrt(eps)) into [0.5, 1); 1 for a non-finite or zero row.

    Multiplying by c is exact, and c^2 eps <= 1 never overflows. The same rule as the
    reference's ``row_scale``: e is clipped to [-1022, 1024] (2^1074 is no float64).
    """
    m = np.sqrt(eps)
    for i in range(x.size):
        a = abs(_f64(x[i]))
        if a > m:
            m = a
        elif a != a:
            return 1.0
    if not (np.isfinite(m) and m > 0.0):
        return 1.0
    e = math.frexp(m)[1]
    return math.ldexp(1.0, -min(max(e, -1022), 1024))


@jit
def _ln_slow(x, eps, w, g, use_g, want_dot):
    """LayerNorm statistics of a row of extreme magnitude: (mu, s, m2, bad).

    Serial sums of the row scaled by c (:func:`_row_scale`), in source order (rows
    of this kind are rare; no lanes needed): mu and s of the row itself, and
    m2 = mean(xh * w) with w = g * u if ``use_g`` else w (when ``want_dot``; else 0).
    The constant-row rule of :func:`layernorm._constant` holds here too.
    """
    d = x.size
    c = _row_scale(x, eps)
    t = 0.0
    const = True
    for i in range(d):
        t += _f64(x[i]) * c
        const = const and x[i] == x[0]
    mu = t / d
    if const:
        mu = _f64(x[0]) * c
    q = 0.0
    dot = 0.0
    for i in range(d):
        xc = 0.0 if const else _f64(x[i]) * c - mu
        q += xc * xc
        if want_dot:
            wi = _f64(g[i]) * _f64(w[i]) if use_g else _f64(w[i])
            dot += xc * wi
    sq = q / d + eps * c * c  # (eps * c) * c: c * c alone may overflow, c^2 eps <= 1 does not
    if not (np.isfinite(sq) and sq > 0.0 and np.isfinite(dot)):
        return 1.0, 1.0, 0.0, True
    sc = np.sqrt(sq)  # the scale of the scaled row; the row's own is sc / c
    return mu / c, sc / c, dot / sc / d, not np.isfinite(mu / c)


@jit
def _rms_slow(x, eps, w, g, use_g, want_dot):
    """RMSNorm statistics of a row of extreme magnitude: (r, coef, bad), coef = mean(x w) / r^2
    (w = g * u if ``use_g``; 0 unless ``want_dot``), from the row scaled by c as in :func:`_ln_slow`."""
    d = x.size
    c = _row_scale(x, eps)
    q = 0.0
    dot = 0.0
    for i in range(d):
        xs = _f64(x[i]) * c
        q += xs * xs
        if want_dot:
            wi = _f64(g[i]) * _f64(w[i]) if use_g else _f64(w[i])
            dot += xs * wi
    sq = q / d + eps * c * c
    if not (np.isfinite(sq) and sq > 0.0 and np.isfinite(dot)):
        return 1.0, 0.0, True
    # mean(x w) / r^2 = c mean(xs w) / rs^2, rs = sqrt(sq) the scaled row's r.
    return np.sqrt(sq) / c, c * ((dot / d) / sq), False

# --------------------------------------------------------------------------- #
# Sums over a length already rounded up to a multiple of LANES (the caller pads its
# float64 scratch with 0), so there is no scalar tail: the attention kernels' sums over
# tokens (row kernels and BLAS kernels alike).
# --------------------------------------------------------------------------- #


@jit
def _padded(n):
    """n rounded up to a multiple of LANES."""
    return (n + LANES - 1) // LANES * LANES


@jit
def _dot_lanes(a, b, n, acc):
    """sum_x a[x] b[x], x < n (a multiple of LANES), in LANES partial sums folded pairwise."""
    for k in range(LANES):
        acc[k] = 0.0
    nq = n // _QUAD
    for jb in range(nq):
        o = jb * _QUAD
        for k in range(LANES):
            acc[k] += (a[o + k] * b[o + k] + a[o + LANES + k] * b[o + LANES + k]) + (
                a[o + 2 * LANES + k] * b[o + 2 * LANES + k] + a[o + 3 * LANES + k] * b[o + 3 * LANES + k])
    for jb in range(4 * nq, n // LANES):
        o = jb * LANES
        for k in range(LANES):
            acc[k] += a[o + k] * b[o + k]
    return _fold(acc)


@inline
def _sum_dot_lanes(e, x, n, acc):
    """(sum_i e[i], sum_i e[i] x[i]) in float64, i < n (a multiple of LANES), acc : (2, LANES);
    each in the order of :func:`_dot_lanes` (the attention softmax's z and its entropy term)."""
    a, b = acc[0], acc[1]
    for k in range(LANES):
        a[k] = 0.0
        b[k] = 0.0
    nq = n // _QUAD
    for jb in range(nq):
        o = jb * _QUAD
        for k in range(LANES):
            i0 = o + k
            i1 = i0 + LANES
            i2 = i1 + LANES
            i3 = i2 + LANES
            e0, e1, e2, e3 = _f64(e[i0]), _f64(e[i1]), _f64(e[i2]), _f64(e[i3])
            a[k] += (e0 + e1) + (e2 + e3)
            b[k] += (e0 * _f64(x[i0]) + e1 * _f64(x[i1])) + (e2 * _f64(x[i2]) + e3 * _f64(x[i3]))
    for jb in range(4 * nq, n // LANES):
        o = jb * LANES
        for k in range(LANES):
            ev = _f64(e[o + k])
            a[k] += ev
            b[k] += ev * _f64(x[o + k])
    return _fold2(a, b)


@inline
def _sum_lanes(a, n, acc):
    """sum_x a[x], x < n (a multiple of LANES), in the order of _dot_lanes."""
    for k in range(LANES):
        acc[k] = 0.0
    nq = n // _QUAD
    for jb in range(nq):
        o = jb * _QUAD
        for k in range(LANES):
            acc[k] += (a[o + k] + a[o + LANES + k]) + (a[o + 2 * LANES + k] + a[o + 3 * LANES + k])
    for jb in range(4 * nq, n // LANES):
        o = jb * LANES
        for k in range(LANES):
            acc[k] += a[o + k]
    return _fold(acc)


@inline
def _max_lanes(x, n, acc):
    """max(x[:n]) over the non-NaN values (-inf if none), in float64, in LANES running maxima.

    A loop ``m = max(m, x[i])`` is a chain of dependent compares, which LLVM does not
    vectorize without fast-math; LANES elementwise maxima do vectorize, and the maximum is
    the same in any order. Inlined (``inline="always"``): the softmax calls it per row of
    Tk = 128, where a call costs as much as the row.
    """
    for k in range(LANES):
        acc[k] = -np.inf
    nb = n // LANES
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            v = _f64(x[o + k])
            acc[k] = v if v > acc[k] else acc[k]
    m = _f64(_max_fold(acc))
    for i in range(nb * LANES, n):
        v = _f64(x[i])
        m = v if v > m else m
    return m


@inline
def _max_fold(acc):
    """max(acc[:LANES]) (none NaN), folded pairwise like :func:`_fold` (overwrites acc): the
    maximum is the same in any order, and a chain of LANES dependent compares cost about
    45 ns more a row (an attention row of 64 scores: 229 -> 183 ns)."""
    h = LANES // 2
    while h > 0:
        for k in range(h):
            acc[k] = acc[k + h] if acc[k + h] > acc[k] else acc[k]
        h //= 2
    return acc[0]
