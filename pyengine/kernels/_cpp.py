"""The ``"cpp"`` backend: registers the kernels of the compiled extension ``pyengine._core``.

Imported by :mod:`pyengine.backends` the first time a ``"cpp"`` kernel is asked for. If
the extension is missing the ``ImportError`` propagates, and the registry records its
message as the reason the backend is unavailable.

This is the only module that imports ``_core``: the rest of the package reaches the
extension through the registry and the public functions here (threads, the copy probe,
which BLAS the products take). On import it hands the extension its BLAS, found once by
:func:`pyengine.kernels._blas.find` (a bad ``PYENGINE_BLAS`` raises its ValueError here,
so every compiled call fails instead of falling back silently). Where no BLAS was found
(or ``_core.linear_force_fallback(True)``, for tests) the compiled ``linear``, ``linear_act`` and
``linear_mul`` return -1, and the kernels registered here take ``numpy.matmul`` and the
compiled epilogue instead; ``linear_attention_forward`` and ``linear_attention_jvp``
return -1 to their caller, who then takes another path.
"""

from __future__ import annotations

import numpy as np

from .. import backends
from . import _blas

try:
    from .. import _core
except ImportError as exc:
    # Keep the original error (it says which symbol or file is missing) and add the fix.
    raise ImportError(
        f"{exc}; pyengine._core is not built: run `pip install .` "
        "(or `pip install --no-build-isolation -Cbuild-dir=build -ve .` for development)",
        name=exc.name,
        path=exc.path,
    ) from exc

__all__ = ["bf16_pack", "get_num_threads", "linear", "linear_act", "linear_act_bf16", "linear_bf16",
           "linear_bf16_info", "linear_bf16_ready", "linear_blas_info",
           "linear_blas_ready", "linear_mul", "linear_mul_bf16",
           "set_num_threads", "stream_copy"]

_core.set_blas(*_blas.find())
_core.set_blas_bf16(*_blas.find_bf16(_core.linear_blas_info()))


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, r: np.ndarray | None, out: np.ndarray) -> int:
    """The compiled ``linear``; without its BLAS, ``numpy.matmul`` then the compiled epilogue."""
    nbad = _core.linear(x, w, b, r, out)
    if nbad >= 0:
        return nbad
    if r is out:  # the product first, then added to out
        return _core.linear_epilogue(np.matmul(x, w), b, out, "none", None, out)
    np.matmul(x, w, out=out)
    return _core.linear_epilogue(out, b, r, "none", None, out)


def linear_act(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, activation: str, u: np.ndarray | None,
               out: np.ndarray) -> int:
    """The compiled ``linear_act``; without its BLAS, ``numpy.matmul`` then the compiled epilogue."""
    nbad = _core.linear_act(x, w, b, activation, u, out)
    if nbad >= 0:
        return nbad
    p = out if u is None else u
    np.matmul(x, w, out=p)
    return _core.linear_epilogue(p, b, None, activation, None, out)


def linear_mul(x: np.ndarray, w: np.ndarray, coef: np.ndarray, out: np.ndarray) -> int:
    """The compiled ``linear_mul``; without its BLAS, ``numpy.matmul`` then the compiled epilogue."""
    nbad = _core.linear_mul(x, w, coef, out)
    if nbad >= 0:
        return nbad
    np.matmul(x, w, out=out)
    return _core.linear_epilogue(out, None, None, "none", coef, out)


_WITH_FALLBACK = {"linear": linear, "linear_act": linear_act, "linear_mul": linear_mul}

# Every kernel id is bound in _core under its own name, one overload per dtype;
# register() checks its parameter names, read from the stub pyengine/_core.pyi (which
# tests/test_stub.py checks against _core), against the reference's. An id that _core
# does not provide (yet) stays unregistered: "auto" then falls back to the next backend.
for _kernel in backends.KERNELS:
    if _kernel in _WITH_FALLBACK:
        backends.register(_kernel, "cpp")(_WITH_FALLBACK[_kernel])
    elif hasattr(_core, _kernel):
        backends.register(_kernel, "cpp")(getattr(_core, _kernel))
del _kernel

set_num_threads = _core.set_num_threads
get_num_threads = _core.get_num_threads
stream_copy = _core.stream_copy
linear_blas_info = _core.linear_blas_info
linear_blas_ready = _core.linear_blas_ready
linear_bf16_info = _core.linear_bf16_info
linear_bf16_ready = _core.linear_bf16_ready
# The bf16 products (pyengine.kernels.linear_bf16): no numpy fallback, they raise when refused.
bf16_pack = _core.linear_bf16_pack
linear_bf16 = _core.linear_bf16
linear_act_bf16 = _core.linear_act_bf16
linear_mul_bf16 = _core.linear_mul_bf16
