"""The one registry of backends: ``(kernel id, backend name) -> callable``.

Backends are ``"cpp"`` (the compiled extension ``pyengine._core``), ``"numba"``
and ``"numpy"`` (the reference, ``pyengine.kernels._reference``). ``"auto"`` picks the
first available of :data:`AUTO_ORDER`. Each backend module registers its kernels
with :func:`register` when it is first imported, and it is imported only when a
kernel of that backend is first asked for, so ``import pyengine`` stays fast and
loads neither Numba nor the extension. A backend that cannot load records why,
and :func:`available_backends` reports it.

The backend is chosen per call (``backend=`` on every public function) or for a
block of code with :func:`use_backend`; nothing is fixed at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "BACKENDS",
    "KERNELS",
    "BackendInfo",
    "available_backends",
    "backend_module",
    "get_num_threads",
    "num_threads",
    "one_blas_thread",
    "register",
    "resolve",
    "set_num_threads",
    "use_backend",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The normalization family: forward, JVP, VJP and dense Jacobian.
NORM_KERNELS: tuple[str, ...] = (
    "layer_norm",
    "layer_norm_jvp",
    "layer_norm_vjp",
    "layer_norm_jacobian",
    "rms_norm",
    "rms_norm_jvp",
    "rms_norm_vjp",
    "rms_norm_jacobian",
)
#: The spectral family: exact sigma_max and fused power iteration of the normalization Jacobians.
SPECTRAL_KERNELS: tuple[str, ...] = (
    "layer_norm_sigma_max",
    "rms_norm_sigma_max",
    "layer_norm_power_iteration",
    "rms_norm_power_iteration",
    "layer_norm_lanczos",
    "rms_norm_lanczos",
)
#: The attention / MLP nonlinearities: masked softmax and its JVP, elementwise
#: activations and their derivatives (``*_grad``: the JVP coefficients).
ACTIVATION_KERNELS: tuple[str, ...] = (
    "softmax",
    "softmax_jvp",
    "gelu",
    "gelu_grad",
    "gelu_tanh",
    "gelu_tanh_grad",
    "relu",
    "relu_grad",
    "silu_gated",
    "silu_gated_grad",
)
#: Attention backward (the score gradient, the advantage) and the fused head (forward,
#: backward) that streams rows instead of storing (Tq, Tk) matrices.
ATTENTION_KERNELS: tuple[str, ...] = (
    "attention_score_grad",
    "attention_advantage",
    "attention_forward",
    "attention_backward",
)
#: Batched Newton–Schulz orthogonalization of gradient matrices (Muon; steepest descent
#: under the spectral norm): products in BLAS, everything else fused around them.
ORTHOGONALIZE_KERNELS: tuple[str, ...] = ("newton_schulz",)
#: Dense layers x @ w with a fused epilogue (bias, residual, activation, JVP coefficient):
#: the block engine's GEMMs.
LINEAR_KERNELS: tuple[str, ...] = ("linear", "linear_act", "linear_mul")
#: The block engine's attention heads in its projections' layout (grouped queries, past keys,
#: K tangents): forward and JVP, by per-head BLAS products next to the dense-layer kernels.
LINEAR_ATTENTION_KERNELS: tuple[str, ...] = ("linear_attention_forward", "linear_attention_jvp")
#: Every kernel id; each must have a ``numpy`` (reference) entry.
KERNELS: tuple[str, ...] = (
    NORM_KERNELS + SPECTRAL_KERNELS + ACTIVATION_KERNELS + ATTENTION_KERNELS + ORTHOGONALIZE_KERNELS
    + LINEAR_KERNELS + LINEAR_ATTENTION_KERNELS
)

#: Backend name -> the module that registers its kernels when imported.
_MODULES: dict[str, str] = {
    "cpp": "pyengine.kernels._cpp",
    "numba": "pyengine.kernels._numba",
    "numpy": "pyengine.kernels._reference",
}
#: The backend names, in registry order.
BACKENDS: tuple[str, ...] = tuple(_MODULES)
#: Preference order of ``backend="auto"``: fastest first.
AUTO_ORDER: tuple[str, ...] = ("cpp", "numba", "numpy")

_TABLE: dict[tuple[str, str], Callable[..., Any]] = {}
_FAILED: dict[str, str] = {}
_LOADED: set[str] = set()
_DEFAULT: contextvars.ContextVar[str] = contextvars.ContextVar("pyengine_backend", default="auto")


class BackendInfo(NamedTuple):
    """Whether a backend loads, and if not, why."""

    name: str
    available: bool
    reason: str


#: The compiled extension, and its typed stub (installed next to this file), from which
#: the registry reads the parameter names of the extension's kernels: pybind11 functions
#: have no signature that :mod:`inspect` can read.
CORE_MODULE = "pyengine._core"
CORE_STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_core.pyi")


@functools.lru_cache(maxsize=None)
def stub_signatures(
    path: str | os.PathLike[str] = CORE_STUB,
) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Parameter names of every function of the stub ``path`` (default :data:`CORE_STUB`).

    Returns ``{name: (names of overload 1, names of overload 2, ...)}``, read once per
    path with :mod:`ast` (nothing is imported). Raises ImportError if the stub cannot be
    read, so that the ``"cpp"`` backend is reported unavailable, with the reason.
    """
    import ast

    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as exc:
        raise ImportError(
            f"the stub of {CORE_MODULE} cannot be read ({exc}); reinstall pyengine"
        ) from exc
    found: dict[str, list[tuple[str, ...]]] = {}
    for node in ast.parse(source, str(path)).body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args)]
            names += [f"*{a.vararg.arg}"] if a.vararg else []
            names += [p.arg for p in a.kwonlyargs]
            names += [f"**{a.kwarg.arg}"] if a.kwarg else []
            found.setdefault(node.name, []).append(tuple(names))
    return {name: tuple(overloads) for name, overloads in found.items()}


def _param_names(
    fn: Callable[..., Any], stub: str | os.PathLike[str] = CORE_STUB
) -> tuple[str, ...]:
    """Parameter names of a Python function, or of a function of the extension (from ``stub``).

    Every overload of an extension function must have the same names.
    """
    if getattr(fn, "__module__", None) == CORE_MODULE:
        name = getattr(fn, "__name__", repr(fn))
        overloads = stub_signatures(stub).get(name)
        if not overloads:
            raise TypeError(f"{CORE_MODULE}.{name} is not in its stub {os.path.basename(stub)}")
        if len(set(overloads)) != 1:
            raise TypeError(
                f"the overloads of {name} in {os.path.basename(stub)} differ in their "
                f"parameter names: {', '.join(map(str, overloads))}"
            )
        return overloads[0]
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        raise TypeError(f"cannot read the signature of {fn!r}") from None


def register(kernel: str, backend: str) -> Callable[[F], F]:
    """Decorator: register ``fn`` as ``backend``'s implementation of ``kernel``.

    Fails loudly, at import, if the kernel id is unknown or the parameter names
    differ from the reference's.
    """

    def deco(fn: F) -> F:
        if kernel not in KERNELS:
            raise KeyError(f"unknown kernel id {kernel!r}; known: {', '.join(KERNELS)}")
        if backend not in _MODULES:
            raise KeyError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
        if backend != "numpy":
            ref = resolve(kernel, "numpy")
            if _param_names(fn) != _param_names(ref):
                raise TypeError(
                    f"{backend} kernel {kernel} has parameters {_param_names(fn)}, "
                    f"the reference has {_param_names(ref)}"
                )
        _TABLE[kernel, backend] = fn
        _RESOLVED.clear()
        return fn

    return deco


def _load(backend: str) -> bool:
    """Import a backend's module once; record the reason if it fails."""
    if backend not in _LOADED and backend not in _FAILED:
        try:
            importlib.import_module(_MODULES[backend])
        except ImportError as exc:  # missing numba, or _core not built
            _FAILED[backend] = f"{type(exc).__name__}: {exc}"
        else:
            _LOADED.add(backend)
    return backend in _LOADED


def check_name(backend: object) -> str:
    """``backend`` itself if it is ``"auto"`` or a known backend name; else a ValueError naming it."""
    if not isinstance(backend, str) or (backend != "auto" and backend not in _MODULES):
        raise ValueError(
            f"backend must be one of 'auto', {', '.join(map(repr, BACKENDS))}; got {backend!r}"
        )
    return backend


#: (kernel id, backend name or "auto" after the default) -> the resolved callable: a
#: backend's loading is decided once, so a resolution never changes (``register`` clears it).
_RESOLVED: dict[tuple[str, str], Callable[..., Any]] = {}


def resolve(kernel: str, backend: str = "auto") -> Callable[..., Any]:
    """Return the callable for ``kernel`` on ``backend`` (``"auto"``: fastest available)."""
    if type(backend) is not str or type(kernel) is not str:
        return _resolve(kernel, backend)  # the checks and their messages
    key = (kernel, _DEFAULT.get() if backend == "auto" else backend)
    fn = _RESOLVED.get(key)
    if fn is None:
        fn = _RESOLVED[key] = _resolve(kernel, backend)
    return fn


def _resolve(kernel: str, backend: str) -> Callable[..., Any]:
    if kernel not in KERNELS:
        raise KeyError(f"unknown kernel id {kernel!r}")
    backend = check_name(backend)
    if backend == "auto":
        backend = _DEFAULT.get()
    candidates = AUTO_ORDER if backend == "auto" else (backend,)
    for name in candidates:
        if _load(name) and (kernel, name) in _TABLE:
            return _TABLE[kernel, name]
    if backend == "auto":
        raise RuntimeError(f"no backend provides {kernel!r}")  # unreachable: numpy has all
    if backend in _FAILED:
        raise ValueError(f"backend {backend!r} is not available: {_FAILED[backend]}")
    raise ValueError(f"backend {backend!r} has no kernel {kernel!r}")


def provides(kernel: str, backend: str) -> bool:
    """Whether ``backend`` loads and has an implementation of ``kernel``."""
    return _load(backend) and (kernel, backend) in _TABLE


def auto_backend(kernel: str) -> str:
    """Name of the backend that ``backend="auto"`` selects for ``kernel``."""
    fn = resolve(kernel)
    return next(b for (k, b), f in _TABLE.items() if k == kernel and f is fn)


def backend_module(backend: str) -> Any:
    """The loaded module of ``backend`` (``"cpp"``: :mod:`pyengine.kernels._cpp`, whose public
    functions are the extension's threads, copy probe and BLAS description), or None where the
    backend does not load (:func:`available_backends` says why)."""
    return importlib.import_module(_MODULES[backend]) if _load(backend) else None


def available_backends() -> dict[str, BackendInfo]:
    """Load every backend and report which are available and, for the others, why.

    Returns
    -------
    dict
        ``{name: BackendInfo(name, available, reason)}`` in preference order.
    """
    return {
        name: BackendInfo(name, _load(name), _FAILED.get(name, ""))
        for name in AUTO_ORDER
    }


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Make ``backend`` what ``backend="auto"`` means inside a ``with`` block."""
    token = _DEFAULT.set(check_name(backend))
    try:
        yield
    finally:
        _DEFAULT.reset(token)


def set_num_threads(n: int) -> None:
    """Use ``n`` threads in the compiled backends (the C++ OpenMP pool and Numba).

    Results do not depend on it: every token is computed by one thread in a fixed
    order. BLAS threads are separate; limit them with ``threadpoolctl``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int; got {n!r}")
    cpp = backend_module("cpp")
    if cpp is not None:
        cpp.set_num_threads(n)
    if _load("numba"):
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the compiled backends with ``n`` threads inside a ``with`` block."""
    before = get_num_threads()
    set_num_threads(n)
    try:
        yield
    finally:
        set_num_threads(before)


_BLAS_CONTROLLER: tuple[Any, bool] | None = None  # (threadpoolctl controller, made after scipy.linalg loaded)


def one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """Single-threaded BLAS/LAPACK inside a ``with`` block, in every BLAS library loaded (NumPy's
    and SciPy's OpenBLAS are two libraries with two thread pools).

    For many small or block-sized dense problems: threaded OpenBLAS on them gains little on a
    quiet machine and loses orders of magnitude on a busy one (its barriers wait for
    descheduled threads), and one library's pool still spinning after a call slows the
    other's threads.
    """
    global _BLAS_CONTROLLER
    scipy_loaded = "scipy.linalg" in sys.modules
    if _BLAS_CONTROLLER is None or _BLAS_CONTROLLER[1] != scipy_loaded:
        from threadpoolctl import ThreadpoolController

        _BLAS_CONTROLLER = (ThreadpoolController(), scipy_loaded)
    return _BLAS_CONTROLLER[0].limit(limits=1, user_api="blas")


def get_num_threads() -> int:
    """Threads used by the compiled backends (the C++ pool's, else Numba's, else 1)."""
    cpp = backend_module("cpp")
    if cpp is not None:
        return int(cpp.get_num_threads())
    if _load("numba"):
        import numba

        return int(numba.get_num_threads())
    return 1
