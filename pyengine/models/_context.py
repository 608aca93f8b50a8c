"""The types the block engine passes around: :class:`Context`, ``Weights`` and ``Cache``.

Their own module, below :mod:`pyengine.models._blocks` and
:mod:`pyengine.models._attention` (which both use them), so that neither imports the other
for its annotations.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["Cache", "Context", "Weights"]

Weights = dict[str, np.ndarray]
Cache = dict[str, Any]


class Context(NamedTuple):
    """What a block needs besides weights: the config and the per-(T, dtype) tables.

    ``start`` > 0 (causal stacks only) means the arrays carry only the rows
    start..T-1 of a length-T sequence: the earlier rows' keys and values come from
    a base cache (forward: ``cache["attn.past"]``; JVP: a ``_blocks.suffix`` cache), and
    the rotary tables are sliced to those rows (query row i is position start + i).
    ``rows`` (JVP only, from ``_blocks.diagonal``) selects the per-token diagonal
    Jacobian blocks.
    """

    cfg: Any  # StackConfig
    rope_q: tuple[np.ndarray, np.ndarray] | None  # (cos, sin) * 1/sqrt(dh): scale folded into q
    rope_k: tuple[np.ndarray, np.ndarray] | None
    start: int = 0
    rows: np.ndarray | None = None
    #: Forward only (``models/sites.py``): ``hook(site, x) -> x`` at every named site of
    #: the block (x itself, or a fresh array that replaces it), and the padding mask of
    #: the keys, bool (B, 1, 1, 1, Tk), True where a key is padding.
    hook: Any = None
    key_mask: np.ndarray | None = None
    #: The sliding window of the block this context serves (0: none): ``cfg.window(k)``.
    window: int = 0
