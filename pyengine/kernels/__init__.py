"""Layer 1: the kernels, each id in three backends behind the registry.

``_reference/`` (NumPy, the executable specification), ``_numba/`` and ``_cpp.py`` (the
compiled extension) register each kernel id with :mod:`pyengine.backends`; one public
file per family (:mod:`.layernorm`, :mod:`.activations`, :mod:`.orthogonalize`, ...) validates once and dispatches.
"""

from .activations import activation, activation_jvp_coef, softmax, softmax_jvp
from .orthogonalize import Orthogonalized, newton_schulz_coefficients, orthogonalize
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
