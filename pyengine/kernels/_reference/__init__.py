"""NumPy reference: the executable specification of every pyengine kernel.

One module per kernel family; importing this package registers every reference
kernel as the ``"numpy"`` backend. The kernel contract shared by all backends is
stated in :mod:`pyengine.kernels._reference.layernorm`.
"""

from . import layernorm  # noqa: F401  (registers the normalization kernels)
from . import spectral  # noqa: F401  (registers the spectral kernels)
from . import activations  # noqa: F401  (registers the softmax and activation kernels)
from . import attention  # noqa: F401  (registers the attention backward kernels)
from . import orthogonalize  # noqa: F401  (registers the Newton–Schulz kernel)
from . import linear  # noqa: F401  (registers the dense-layer kernels)
from . import linear_attention  # noqa: F401  (registers the block engine's attention heads)
