"""pyengine asv suites, one file per kernel family, one class per kernel id.

Importing this package fails if a registry kernel has no benchmark class (as
numpy's bench_ufunc.py does for ufuncs), so a new kernel cannot land unmeasured.
"""

from pyengine import backends

from . import (bench_activations, bench_attention, bench_layernorm, bench_linear, bench_model, bench_operators,
               bench_orthogonalize, bench_spectral)
from .common import camel

_SUITES = (bench_activations, bench_attention, bench_layernorm, bench_linear, bench_model, bench_operators,
           bench_orthogonalize, bench_spectral)
_classes = {name for mod in _SUITES for name in vars(mod)}
_missing = [k for k in backends.KERNELS if camel(k) not in _classes]
if _missing:
    raise ImportError(f"registry kernels without an asv benchmark class: {_missing}")
