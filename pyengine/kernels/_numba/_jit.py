"""The one place where pyengine's Numba options live.

Every Numba kernel is compiled with :data:`jit` (serial) or :data:`pjit` (``prange``
over tokens), or, in the activation and softmax kernels, with their fused-multiply-add
variants :data:`fma_inline`, :data:`fma_jit` and :data:`fma_pjit` (:data:`CONTRACT`).
No module sets Numba options of its own. No eager signatures: each function is compiled on its first call for
the types it gets (float32 or float64 arrays, which the public layer guarantees)
and then cached on disk (``cache=True``), so ``import pyengine`` never compiles.
Also here: the low-level memory primitive the kernels share, :func:`prefetch`.
"""

from __future__ import annotations

import functools

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
    "jit",
    "pjit",
    "prefetch",
]

#: No fast-math, not even per flag (the one exception is :data:`CONTRACT`). Bad-row detection tests the row statistics
#: with ``np.isfinite``; the ``nnan``/``ninf`` flags let LLVM assume that NaN and
#: Inf never occur and fold those tests to ``True``. ``reassoc`` would let the
#: compiler reorder the float64 sums, so results would depend on the vector width
#: of the machine; instead the reductions are vectorized by hand (see
#: ``layernorm.LANES``) in an order fixed by the source.
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


#: The one fast-math flag pyengine uses, and only in the activation and softmax
#: kernels (:mod:`._vecmath`, :mod:`.activations`, :mod:`.softmax`): ``contract`` lets
#: LLVM fuse a * b + c into one FMA, rounded once instead of twice. It assumes nothing
#: about NaN or Inf and reorders no sum, so the bad-row tests and the fixed summation
#: order hold; the polynomials of :mod:`._vecmath` are chains of multiply-adds, and it
#: makes them about 2x faster.
CONTRACT = {"contract"}

if numba.config.DISABLE_JIT:  # pragma: no cover - the NUMBA_DISABLE_JIT=1 CI job
    fma_inline = fma_jit = jit
    fma_pjit = pjit
else:
    #: Scalar cores: always inlined (at the Numba IR level), because LLVM's inliner
    #: leaves the larger ones (GELU) as calls, and a loop with a call does not vectorize.
    fma_inline = functools.partial(jit, inline="always", fastmath=CONTRACT)
    #: Row helpers that call the cores (inlined cores take their caller's flags).
    fma_jit = functools.partial(jit, fastmath=CONTRACT)
    #: Batch kernels: ``prange`` over rows, as :data:`pjit`.
    fma_pjit = functools.partial(jit, parallel=True, fastmath=CONTRACT)


@intrinsic
def prefetch(typingctx, a, i):
    """``prefetch(a, i)``: a hint that ``a[i]`` (1-D array, integer index) will be read soon.

    Emits ``llvm.prefetch`` (read, keep in all cache levels, data): ``prefetcht0`` on
    x86-64, ``prfm`` on AArch64, nothing on targets without it. A prefetch never
    faults and never changes a result. The kernels use it to pull the next row in
    from memory while they compute on the current one, since the hardware
    prefetchers only follow the rows being read, and memory would sit idle.
    """
    if not (isinstance(a, types.Array) and a.ndim == 1 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        aryty, idxty = sig.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = context.cast(builder, args[1], idxty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [idx])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # (address, rw = 0 read, locality = 3 all levels, cache type = 1 data)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(a, i), codegen


if numba.config.DISABLE_JIT:  # pragma: no cover - an intrinsic cannot run as Python

    def prefetch(a, i):  # noqa: F811
        """No-op stand-in for the ``prefetch`` intrinsic under ``NUMBA_DISABLE_JIT``."""
