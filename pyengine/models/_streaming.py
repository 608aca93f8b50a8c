"""Streamed weights: ``load_pretrained(folder, weights="mmap")``.

The safetensors files stay memory-mapped; the global arrays (embeddings, final norm,
LM head) are read once, and block k's arrays are read, converted to the compute dtype
and gamma-scaled when block k runs (``Stack._params(dtype)[0][k]``, which every block
method goes through), then dropped when another block is needed. Peak memory is the
activations, the globals and about one block of weights in the compute dtype (plus the
page cache the kernel may keep for the mapped files, which it can drop at will).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from . import _families, _hf
from .config import StackConfig, expected_arrays

__all__ = ["StreamedBlocks", "streamed"]


class StreamedBlocks(Sequence):
    """Block weight dicts read on demand; only the last one read is kept."""

    def __init__(self, model: Any, dtype: np.dtype) -> None:
        self._model, self._dtype = model, dtype
        self._last: tuple[int, dict[str, np.ndarray]] | None = None

    def __len__(self) -> int:
        return self._model.config.n_layers

    def __getitem__(self, k: Any) -> dict[str, np.ndarray]:  # type: ignore[override]
        if isinstance(k, slice):
            raise TypeError("streamed blocks are read one at a time")
        k = range(len(self))[k]
        if self._last is None or self._last[0] != k:
            self._last = None  # drop the previous block before reading the next
            self._last = (k, self._model._read_block(k, self._dtype))
        return self._last[1]

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for k in range(len(self)):
            yield self[k]


def _prepare(arrays: dict[str, np.ndarray], dtype: np.dtype, gamma_scale: float) -> dict[str, np.ndarray]:
    out = {}
    for name, a in arrays.items():
        a = a.astype(dtype, copy=False)
        if name.endswith(".gamma") and gamma_scale != 1.0:
            a = a * dtype.type(gamma_scale)
        a.flags.writeable = False
        out[name] = a
    return out


@functools.cache
def streamed(cls: type) -> type:
    """The streamed subclass of ``cls`` (a PretrainedModel): same API, weights read per block."""

    class Streamed(cls):  # type: ignore[misc, valid-type]
        streaming = True

        def _init_streamed(self, cfg: StackConfig, hf: dict[str, Any], st: _hf.Shards, where: str,
                           storage: np.dtype) -> None:
            _, glob = _families.read_family(hf, st, where, storage, layers=(), glob=True)
            expected = {n: s for n, s in expected_arrays(cfg).items() if not n.startswith("blocks.")}
            self._init(cfg, _check_arrays_subset(cfg, glob, expected, f"weights from {where!r}"))
            self._hf, self._st, self._where, self._storage = hf, st, where, storage

        def _read_block(self, k: int, dtype: np.dtype) -> dict[str, np.ndarray]:
            _, arrays = _families.read_family(self._hf, self._st, self._where, self._storage, layers=(k,),
                                              glob=False)
            pre = f"blocks.{k}."
            expected = {n[len(pre):]: s for n, s in expected_arrays(self._config).items() if n.startswith(pre)}
            block = {n[len(pre):]: a for n, a in arrays.items()}
            if set(block) != set(expected) or any(block[n].shape != s for n, s in expected.items()):
                raise ValueError(f"{self._where}: block {k}'s arrays do not match the config")
            return _prepare(block, dtype, self._config.gamma_scale)

        def _params(self, dtype: np.dtype) -> tuple[Any, dict[str, np.ndarray]]:
            if dtype not in self._prepared:
                self._prepared[dtype] = (StreamedBlocks(self, dtype),
                                         _prepare(self._weights, dtype, self._config.gamma_scale))
            return self._prepared[dtype]

        @property
        def weights(self) -> dict[str, np.ndarray]:
            """Every array, read in full (the size of a fully loaded model)."""
            _, arrays = _families.read_family(self._hf, self._st, self._where, self._storage)
            return arrays

        def replace(self, **changes: Any) -> Any:
            cfg = dataclasses.replace(self._config, **changes)
            if expected_arrays(cfg) != expected_arrays(self._config):
                raise ValueError("a streamed model can only change config fields that keep the same arrays")
            new = copy.copy(self)
            new._config, new._prepared = cfg, {}
            return new

        def astype(self, dtype: Any) -> Any:
            new = copy.copy(self)
            new._storage = np.dtype(dtype)
            new._weights = {n: a.astype(dtype) for n, a in self._weights.items()}
            new._prepared = {}
            return new

        def save(self, path: Any) -> None:
            raise TypeError("a streamed model is not saved to .npz; load it with weights='load' first")

    Streamed.__name__ = Streamed.__qualname__ = "Streamed" + cls.__name__
    return Streamed


def _check_arrays_subset(cfg: StackConfig, arrays: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]],
                         where: str) -> dict[str, np.ndarray]:
    """The global arrays: exactly the expected ones, right shapes, finite (the reader checked that)."""
    if set(arrays) != set(expected):
        raise ValueError(f"{where}: global arrays {sorted(arrays)} do not match the config's {sorted(expected)}")
    out = {}
    for n, s in expected.items():
        a = np.ascontiguousarray(arrays[n])
        if a.shape != s:
            raise ValueError(f"{where}: array {n!r} must have shape {s}; got {a.shape}")
        a.flags.writeable = False
        out[n] = a
    return out
