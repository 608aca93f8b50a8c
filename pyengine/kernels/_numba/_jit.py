"""The one place where pyengine's Numba options live.

Every Numba kernel is compiled with :data:`jit` (serial) or :data:`pjit` (``prange``
over tokens), or, in the activation, softmax and power-iteration kernels, with their fused-multiply-add
variants :data:`fma_inline`, :data:`fma_jit` and :data:`fma_pjit` (:data:`CONTRACT`).
No module sets Numba options of its own. No eager signatures: each function is compiled on its first call for
the types it gets (float32 or float64 arrays, which the public layer guarantees)
and then cached on disk (``cache=True``), so ``import pyengine`` never compiles.
The LLVM intrinsics the kernels share are in :mod:`._intrinsics` (prefetch hints, streaming
stores) and :mod:`._formula` (row sums and row writers emitted as vector code).
"""

from __future__ import annotations

import functools

import numba
import numpy as np

__all__ = [
    "CONTRACT",
    "FASTMATH",
    "fma_inline",
    "fma_jit",
    "fma_pjit",
    "inline",
    "jit",
    "nogil_jit",
    "pjit",
]

#: No fast-math, not even per flag (the one exception is :data:`CONTRACT`). Bad-row detection tests the row statistics
#: with ``np.isfinite``; the ``nnan``/``ninf`` flags let LLVM assume that NaN and
#: Inf never occur and fold those tests to ``True``. ``reassoc`` would let the
#: compiler reorder the float64 sums, so results would depend on the vector width
#: of the machine; instead the reductions are vectorized by hand (see
#: ``_reduce.LANES`` and ``_formula.row_sums``) in an order fixed by the source.
FASTMATH = False

#: Serial kernels and helpers. ``error_model="numpy"``: a division by zero gives
#: inf/NaN instead of raising, as in NumPy; such rows are counted as bad rows.
jit = functools.partial(numba.njit, cache=True, fastmath=FASTMATH, error_model="numpy")

#: Batch kernels: ``prange`` over tokens (rows), each row computed by one thread,
#: so results do not depend on the number of threads. The GIL is *not* released
#: (no ``nogil``): Numba's default ``workqueue`` threading layer aborts the process
#: when two Python threads enter parallel kernels at the same time.
pjit = functools.partial(jit, parallel=True)

#: Serial kernels that release the GIL, for work a background Python thread does while
#: the main thread computes (reading streamed weights); serial, so they never enter the
#: threading layer that :data:`pjit` kernels share.
nogil_jit = functools.partial(jit, nogil=True)

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
