"""Numba backend: importing this package registers its kernels (``"numba"``).

If Numba is not installed the ``ImportError`` propagates; the registry
(:mod:`pyengine.backends`) records it as the reason the backend is unavailable.
"""

from __future__ import annotations

from . import layernorm  # noqa: F401  (registers the LayerNorm kernels)
from . import rmsnorm  # noqa: F401  (registers the RMSNorm kernels)
from . import spectral  # noqa: F401  (registers the spectral kernels)
from . import softmax  # noqa: F401  (registers the softmax kernels)
from . import activations  # noqa: F401  (registers the MLP activation kernels)
from . import attention  # noqa: F401  (registers the attention backward kernels)
from . import orthogonalize  # noqa: F401  (registers the Newton–Schulz kernel)
from . import linear  # noqa: F401  (registers the dense-layer kernels)
from . import linear_attention  # noqa: F401  (registers the block engine's attention heads)
