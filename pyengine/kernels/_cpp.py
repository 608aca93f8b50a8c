"""The ``"cpp"`` backend: registers the kernels of the compiled extension ``pyengine._core``.

Imported by :mod:`pyengine.backends` the first time a ``"cpp"`` kernel is asked for. If
the extension is missing the ``ImportError`` propagates, and the registry records its
message as the reason the backend is unavailable.
"""

from __future__ import annotations

from .. import backends

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

__all__ = ["get_num_threads", "set_num_threads", "stream_copy"]

# Every kernel id is bound in _core under its own name, one overload per dtype;
# register() checks its parameter names, read from the stub pyengine/_core.pyi (which
# tests/test_stub.py checks against _core), against the reference's. An id that _core
# does not provide (yet) stays unregistered: "auto" then falls back to the next backend.
for _kernel in backends.KERNELS:
    if hasattr(_core, _kernel):
        backends.register(_kernel, "cpp")(getattr(_core, _kernel))
del _kernel

set_num_threads = _core.set_num_threads
get_num_threads = _core.get_num_threads
stream_copy = _core.stream_copy
