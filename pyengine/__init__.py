"""pyengine: compiled-kernel numerics for the dynamics of the transformer residual stream.

Every kernel exists three times behind one registry (:mod:`pyengine.backends`):
in C++ (``"cpp"``), in Numba (``"numba"``) and as the NumPy reference
(``"numpy"``). Public functions take ``backend="auto"`` (the fastest available).
Importing pyengine loads neither Numba nor the extension; the first call does.
"""

from __future__ import annotations

from .backends import (
    available_backends,
    get_num_threads,
    num_threads,
    set_num_threads,
    use_backend,
)
from .layernorm import (
    layer_norm,
    layer_norm_jacobian,
    layer_norm_jvp,
    layer_norm_vjp,
    rms_norm,
    rms_norm_jacobian,
    rms_norm_jvp,
    rms_norm_vjp,
)

__version__ = "0.1.0"

__all__ = [
    "available_backends",
    "get_num_threads",
    "layer_norm",
    "layer_norm_jacobian",
    "layer_norm_jvp",
    "layer_norm_vjp",
    "num_threads",
    "rms_norm",
    "rms_norm_jacobian",
    "rms_norm_jvp",
    "rms_norm_vjp",
    "set_num_threads",
    "use_backend",
]


def __dir__() -> list[str]:
    return __all__
