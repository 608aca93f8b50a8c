"""pyengine: compiled-kernel numerics for the dynamics of the transformer residual stream.

Every kernel exists three times behind one registry (:mod:`pyengine.backends`):
in C++ (``"cpp"``), in Numba (``"numba"``) and as the NumPy reference
(``"numpy"``). Public functions take ``backend="auto"`` (the fastest available).
Importing pyengine loads neither Numba nor the extension; the first call does, and it
sets no environment variable (see :func:`pyengine.bench.tuned_environment`).
"""

from __future__ import annotations

from ._version import __version__
from .kernels.activations import activation, activation_jvp_coef, softmax, softmax_jvp
from .kernels.orthogonalize import orthogonalize
from .kernels.attention import attention_backward, attention_forward, attention_score_grad
from .backends import (
    available_backends,
    get_num_threads,
    num_threads,
    set_num_threads,
    use_backend,
)
from .kernels.layernorm import (
    layer_norm,
    layer_norm_jacobian,
    layer_norm_jvp,
    layer_norm_vjp,
    rms_norm,
    rms_norm_jacobian,
    rms_norm_jvp,
    rms_norm_vjp,
)
from .linalg.dense import DenseOperator
from .linalg.norm_jacobians import LayerNormJacobian, RMSNormJacobian
from .linalg.operators import BatchedOperator, Identity, Product, Scaled, Sum
from .linalg.convert import as_linear_operator, from_linear_operator
from .linalg.results import SpectralRadiusResult, SpectralResult, WeightScan
from .linalg.spectral import layer_norm_spectral_norm, rms_norm_spectral_norm, spectral_norm, spectral_radius
from .linalg.weights import weight_scan
from .linalg.steepest import steepest_descent
from .models import PretrainedModel, Stack, StackConfig, init_weights, load_pretrained
from .models import Intervention, TokenizedText, ablate_head  # sites and interventions
from .analysis import BlockJacobian, DecayFit, Propagation, block_jacobian_norm, fit_decay, propagate
from .distributed import scan  # pyengine.scan(job, grid, ...); pyengine.scan.load(out)


def get_include() -> str:
    """Folder of pyengine's C++ kernel headers, for building other packages' extensions.

    ``#include <pyengine/layernorm.hpp>`` with this folder on the include path gives
    the pure C++17 templates behind the ``"cpp"`` backend (header-only; they need
    OpenMP). Raises FileNotFoundError if the package was not installed with them.
    """
    import importlib.util
    import os

    # Installed by CMake next to the extension (also in an editable install, where
    # this file stays in the source tree).
    spec = importlib.util.find_spec("pyengine._core")
    where = os.path.dirname(spec.origin) if spec and spec.origin else os.path.dirname(__file__)
    path = os.path.join(where, "include")
    if not os.path.isdir(os.path.join(path, "pyengine")):
        raise FileNotFoundError(f"pyengine's C++ headers are not installed under {path}; reinstall with pip")
    return path

__all__ = [
    "Intervention",
    "TokenizedText",
    "ablate_head",
    "BatchedOperator",
    "BlockJacobian",
    "DecayFit",
    "DenseOperator",
    "Identity",
    "LayerNormJacobian",
    "PretrainedModel",
    "Product",
    "Propagation",
    "RMSNormJacobian",
    "Scaled",
    "SpectralRadiusResult",
    "SpectralResult",
    "Stack",
    "StackConfig",
    "Sum",
    "WeightScan",
    "activation",
    "activation_jvp_coef",
    "as_linear_operator",
    "attention_backward",
    "attention_forward",
    "attention_score_grad",
    "available_backends",
    "block_jacobian_norm",
    "fit_decay",
    "from_linear_operator",
    "get_include",
    "get_num_threads",
    "init_weights",
    "layer_norm",
    "layer_norm_jacobian",
    "layer_norm_jvp",
    "layer_norm_spectral_norm",
    "layer_norm_vjp",
    "load_pretrained",
    "num_threads",
    "orthogonalize",
    "propagate",
    "rms_norm",
    "rms_norm_jacobian",
    "rms_norm_jvp",
    "rms_norm_spectral_norm",
    "rms_norm_vjp",
    "scan",
    "set_num_threads",
    "softmax",
    "softmax_jvp",
    "spectral_norm",
    "spectral_radius",
    "steepest_descent",
    "use_backend",
    "weight_scan",
]


def __dir__() -> list[str]:
    return __all__
