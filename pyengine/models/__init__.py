"""Layer 2 (beside linalg): transformer stacks, their configuration, initialization and pretrained readers."""

from .config import StackConfig, expected_arrays
from .initialization import init_weights
from .linearization import BlockCache
from .pretrained import PretrainedModel, load_pretrained
from .stack import Stack
