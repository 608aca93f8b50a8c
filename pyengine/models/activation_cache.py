"""The cache of :meth:`~pyengine.Stack.run_with_cache`: a mapping site -> array."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .tl_names import canonical, unknown_hint

__all__ = ["ActivationCache"]


class ActivationCache(Mapping[str, np.ndarray]):
    """Site name -> array, in forward order; lookups take pyengine or TransformerLens names.

    ``cache["blocks.0.hook_resid_post"]`` is ``cache["blocks.0.resid_post"]`` (the same
    array, pyengine's layout). Iteration and ``keys()`` give pyengine names.
    """

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self._arrays = dict(arrays)

    def __getitem__(self, name: str) -> np.ndarray:
        key = canonical(name)
        if not isinstance(key, str) or key not in self._arrays:
            raise KeyError(f"site {name!r} is not in this cache" + unknown_hint(name, key, list(self._arrays)))
        return self._arrays[key]

    def __contains__(self, name: object) -> bool:
        try:
            return isinstance(name, str) and canonical(name) in self._arrays
        except ValueError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        return f"ActivationCache({list(self._arrays)})"

    def stack(self, pattern: str) -> np.ndarray:
        """The cached sites matching ``pattern`` (a glob over block indices, e.g.
        ``"blocks.*.resid_post"`` or ``"blocks.*.hook_resid_post"``), stacked along a new
        leading axis in block order: ``(n_matched, *site_shape)``.

        Raises
        ------
        KeyError
            If no cached site matches ``pattern``.
        ValueError
            If the matched sites differ in shape.
        """
        key = canonical(pattern)
        hit = [n for n in self._arrays if fnmatch.fnmatchcase(n, key)]
        if not hit:
            raise KeyError(f"pattern {pattern!r} matches no cached site" + unknown_hint(pattern, key, list(self._arrays)))
        shapes = {self._arrays[n].shape for n in hit}
        if len(shapes) > 1:
            raise ValueError(f"pattern {pattern!r} matches sites of different shapes {sorted(shapes)}; "
                             "stack one kind of site")
        return np.stack([self._arrays[n] for n in hit])
