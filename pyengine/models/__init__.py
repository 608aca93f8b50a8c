"""Layer 2 (beside linalg): transformer stacks, their configuration, initialization and pretrained readers."""

from .initialization import init_weights
from .pretrained import PretrainedModel, load_pretrained
from .stack import BlockCache, Stack, StackConfig, expected_arrays
