"""What the base classes of :class:`~pyengine.Stack` call on ``self``: the :class:`StackLike` protocol.

:class:`~pyengine.models.sites.Sites`, :class:`~pyengine.models.linearization.Linearization`
and :class:`~pyengine.models.reverse.ReverseMode` hold methods of a Stack; they type ``self``
with this protocol, which sits below them and below ``stack.py``, so that none of them
imports ``stack.py`` (not even for annotations) and the models layer has no import cycle.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .config import StackConfig

__all__ = ["StackLike"]

Params = tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]


class StackLike(Protocol):
    """The part of :class:`~pyengine.Stack` that its base classes use (``BlockCache`` is ``Any`` here)."""

    _config: StackConfig
    _weights: dict[str, np.ndarray]

    @property
    def config(self) -> StackConfig: ...

    def _params(self, dtype: np.dtype) -> Params: ...

    def block_index(self, k: Any) -> int: ...

    def as_stream(self, h: Any, name: str = "h", dtype: Any = None) -> tuple[np.ndarray, bool]: ...

    def block_forward(self, k: int, h: Any, return_cache: bool = False, *, past: Any = None) -> Any: ...

    def forward(self, input_ids: Any, dtype: Any = None, *, cache_from: int | None = None,
                attention_mask: Any = None, token_type_ids: Any = None) -> tuple[np.ndarray, list[Any]]: ...

    def hidden_states(self, input_ids: Any, dtype: Any = None, *, attention_mask: Any = None,
                      token_type_ids: Any = None) -> np.ndarray: ...

    def logits(self, input_ids: Any, dtype: Any = None, *, interventions: Any = None,
               attention_mask: Any = None, token_type_ids: Any = None) -> np.ndarray: ...

    def _norm(self, glob: dict[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray: ...

    def _embed_input(self, x: Any, dtype: Any, attention_mask: Any, token_type_ids: Any
                     ) -> tuple[np.ndarray, bool, np.ndarray | None, np.ndarray | None]: ...

    def _run(self, x: Any, dtype: Any = None, attention_mask: Any = None, token_type_ids: Any = None,
             hooks: Any = None, first: int | None = None, pre: tuple | None = None
             ) -> tuple[np.ndarray, bool, Any, list[dict]]: ...

    # Sites
    def site_names(self) -> list[str]: ...

    def _match_sites(self, sites: Any) -> list[str]: ...

    def _prepare(self, x: Any, sites: Any, interventions: Any, dtype: Any, attention_mask: Any,
                 token_type_ids: Any) -> tuple[Any, tuple]: ...

    def run_with_cache(self, input_ids: Any, sites: Any = "*", *, attention_mask: Any = None,
                       token_type_ids: Any = None, dtype: Any = None, interventions: Any = None
                       ) -> tuple[np.ndarray, Any]: ...

    def run(self, input_ids: Any, interventions: Any = None, *, attention_mask: Any = None,
            token_type_ids: Any = None, dtype: Any = None) -> np.ndarray: ...

    def _output(self, h: np.ndarray) -> np.ndarray: ...

    def _read_out(self, h: np.ndarray) -> np.ndarray: ...

    # Linearization
    def _owns(self, cache: Any, k: int, name: str = "cache") -> None: ...

    def _linearize(self, k: Any, h: Any, dh: Any, rows: Any, mode: str, cache: Any, arg: str = "dh"
                   ) -> tuple[int, np.ndarray, bool, Any]: ...
