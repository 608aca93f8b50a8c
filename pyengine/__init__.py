"""pyengine: compiled-kernel numerics for the dynamics of the transformer residual stream.

Every kernel exists three times behind one registry (:mod:`pyengine.backends`):
in C++ (``"cpp"``), in Numba (``"numba"``) and as the NumPy reference
(``"numpy"``). Public functions take ``backend="auto"`` (the fastest available).
Importing pyengine loads neither Numba nor the extension; the first call does.
"""

from __future__ import annotations

import os as _os

from ._version import __version__

# The C++ kernels and Numba's "omp" threading layer share libgomp, whose idle threads
# spin for GOMP_SPINCOUNT rounds (300000 by default, a few ms) before they sleep. On a
# 2-core machine such a spinning team starved the other backend's: a 100-token LayerNorm
# JVP took 8 ms instead of 0.08-0.14 ms (alternating cpp and numba calls). Not spinning
# at all (OMP_WAIT_POLICY=PASSIVE, the setting before issue 18's fourth session) makes
# every parallel region wake its threads through the kernel: 70-80 us per region on this
# VM, more than the work of a 100-token LayerNorm JVP (C++ 94 us passive against 24 us
# spinning; an empty Numba prange 76 us against 2 us). 10000 rounds (about 0.1 ms)
# span the gap between back-to-back calls and stop before they cost a NumPy product
# that follows (a kernel right after a 512 x 512 matmul: passive 76-120 us, 10000 rounds
# 99-124, 30000 rounds 386-433, 100000 rounds 1.3 ms). libgomp reads it when it loads;
# a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each threaded product before
# they sleep, and a compiled kernel that starts meanwhile shares the cores with them: the
# attention forward at (192, 128, 128, 64) float32 took 20-21 ms right after a NumPy matmul
# instead of 9-10 (both backends; measured). 2^20 cycles (~0.4 ms) still spans back-to-back
# products and gave the 10 ms back. OpenBLAS reads it when it loads, so it counts where
# pyengine is imported before NumPy (the pyengine command, its benchmarks and their
# workers, which inherit it); a user's setting wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")

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
