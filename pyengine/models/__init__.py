"""Layer 2 (beside linalg): transformer stacks, their configuration, initialization and pretrained readers."""

from .config import StackConfig, expected_arrays
from .initialization import init_weights
from ._linear import bf16_products
from .linearization import BlockCache
from .interventions import HookPoint, Intervention, ablate_head
from .pretrained import PretrainedModel, TokenizedText, from_hf, load_pretrained
from .sites import as_input
from .stack import Stack
