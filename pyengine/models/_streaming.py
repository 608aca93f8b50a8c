"""Streamed weights: ``load_pretrained(folder, weights="mmap")``.

The safetensors files stay memory-mapped; the global arrays (embeddings, final norm,
LM head) are read once, and block k's arrays are read, converted to the compute dtype
and gamma-scaled when block k runs (``Stack._params(dtype)[0][k]``, which every block
method goes through), then dropped when another block is needed.

Reading a block is one pass per weight: :func:`pyengine.kernels.widen.bf16_transpose_into`
widens bf16 (a shift), transposes and places each HF Linear weight in its columns of the
Stack's stacked array, inside a buffer of a pool of two that is reused (``_Pooled``); the
NumPy route it replaces made five passes (uint32 copy, shift, finiteness check,
concatenation, transposed copy), of which the transposed copy and the uint32 copy were
three quarters of the time (docs/performance.md has the breakdown). While block k runs,
block k + 1 (after the last block, the first) is read on a daemon thread
(:class:`StreamedBlocks`), the kernels releasing the GIL. Peak memory is the activations,
the globals and about two blocks of weights in the compute dtype (plus the page cache the
kernel may keep for the mapped files, which it can drop at will).
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from . import _families, _hf
from .config import StackConfig, expected_arrays

__all__ = ["StreamedBlocks", "streamed"]

#: Buffers a StreamedBlocks keeps for reuse: the block in use and the one read ahead.
_POOL = 2
#: Alignment (bytes) of each array carved from a buffer.
_ALIGN = 64
#: sys.getrefcount of a pool's buffer that nothing else references: the pool's list and the call's argument.
_IDLE_REFS = 2


class _Ahead(threading.Thread):
    """Block ``k`` read on a daemon thread; :meth:`result` waits and re-raises its error in the caller."""

    def __init__(self, read: Callable[[int], dict[str, np.ndarray]], k: int) -> None:
        super().__init__(name=f"pyengine-read-ahead-{k}", daemon=True)
        self.k, self._read = k, read
        self._out: dict[str, np.ndarray] | None = None
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self._out = self._read(self.k)
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that asks for the block
            self._error = exc
        finally:
            self._read = None  # type: ignore[assignment]  # the model is not kept alive by a finished thread

    def result(self) -> dict[str, np.ndarray]:
        self.join()
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out


class _Pooled:
    """Shards whose stacked Linear weights (``linear``) are carved from one buffer of the pool,
    taken on first use; every other read is passed through."""

    def __init__(self, st: _hf.Shards, take: Callable[[], np.ndarray]) -> None:
        self.st, self._take, self._buf, self._used = st, take, None, 0
        self.names = st.names

    def get(self, name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return self.st.get(name, shape, dtype)

    def lacks(self, name: str) -> ValueError:
        return self.st.lacks(name)

    def linear(self, parts: list[tuple[str, tuple[int, int]]], dtype: Any = np.float32) -> np.ndarray:
        if self._buf is None:
            self._buf = self._take()
        shape = (parts[0][1][1], sum(s[0] for _, s in parts))
        step = _ALIGN // self._buf.itemsize
        start, n = -(-self._used // step) * step, math.prod(shape)
        if self._buf.dtype != np.dtype(dtype) or start + n > self._buf.size:
            return self.st.linear(parts, dtype)
        self._used = start + n
        return self.st.linear(parts, dtype, out=self._buf[start:start + n].reshape(shape))


class StreamedBlocks(Sequence):
    """Block weight dicts read on demand: the block asked for, and (``ahead``) the next one (after
    the last, the first) read on a background thread meanwhile, so that at most two blocks are held.

    The stacked Linear weights of a block live in a buffer of a pool of two, reused when no
    array of the block it held is referenced any more (its reference count, so a block the
    caller kept, or any view of it, is never overwritten; a new buffer is made instead). The
    pool is the model's, shared with its ``replace``/``astype`` copies, which release the
    blocks the original holds (:meth:`release`): a sequence of ablation copies reuses two
    buffers instead of holding two each.
    """

    def __init__(self, model: Any, dtype: np.dtype, ahead: bool = True) -> None:
        self._model, self._dtype, self._ahead_on = model, dtype, ahead
        self._last: tuple[int, dict[str, np.ndarray]] | None = None
        self._ahead: _Ahead | None = None  # the read of the next block
        self._stale: _Ahead | None = None  # a read that was not used; joined before the next one starts
        self._pool: list[np.ndarray] = model._pools.setdefault(model._read_dtype(dtype), [])
        self._lock: threading.Lock = model._pool_lock
        step = _ALIGN // 4
        self._size = sum(-(-math.prod(s) // step) * step for n, s in expected_arrays(model.config).items()
                         if n.startswith("blocks.0.") and len(s) == 2)

    def __len__(self) -> int:
        return self._model.config.n_layers

    def __getitem__(self, k: Any) -> dict[str, np.ndarray]:  # type: ignore[override]
        if isinstance(k, slice):
            raise TypeError("streamed blocks are read one at a time")
        k = range(len(self))[k]
        if self._last is None or self._last[0] != k:
            self._last = None  # drop the previous block before reading the next
            self._last = (k, self._take(k))
            if self._ahead_on and len(self) > 1:
                if self._stale is not None:
                    self._stale.join()
                    self._stale = None
                # after the last block, the first: a sweep over the blocks is usually followed by another
                self._ahead = _Ahead(self._read, (k + 1) % len(self))
        return self._last[1]

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for k in range(len(self)):
            yield self[k]

    def release(self) -> None:
        """Drop the blocks held (the one in use, the one read ahead), so that their buffers can be reused."""
        for read in (self._ahead, self._stale):
            if read is not None:
                read.join()
        self._last = self._ahead = self._stale = None

    def _take(self, k: int) -> dict[str, np.ndarray]:
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return self._read(k)
        self._stale = ahead  # kept (and joined) until the next read-ahead, even if the wait is interrupted
        if ahead.k == k:
            return ahead.result()
        return self._read(k)  # random access: the other read ends on its own, its block is dropped

    def _read(self, k: int) -> dict[str, np.ndarray]:
        return self._model._read_block(k, self._dtype, _Pooled(self._model._st, self._buffer))

    def _buffer(self) -> np.ndarray:
        """A buffer of the pool that nothing else references, or a new one (kept if the pool has room)."""
        with self._lock:
            for i in range(len(self._pool)):
                if sys.getrefcount(self._pool[i]) <= _IDLE_REFS:
                    return self._pool[i]
            if len(self._pool) == _POOL:
                self._pool.pop(0)  # held by its users; they keep it alive
            self._pool.append(np.empty(self._size, self._model._read_dtype(self._dtype)))
            # touched in order: a first touch of the fresh pages in the kernel's transposed order costs far more
            self._pool[-1].fill(0)
            return self._pool[-1]


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
            # read dtype -> the buffers of StreamedBlocks (shared with the replace/astype copies)
            self._pools: dict[np.dtype, list[np.ndarray]] = {}
            self._pool_lock = threading.Lock()

        def _read_block(self, k: int, dtype: np.dtype, st: Any = None) -> dict[str, np.ndarray]:
            _, arrays = _families.read_family(self._hf, self._st if st is None else st, self._where,
                                              self._read_dtype(dtype), layers=(k,), glob=False)
            pre = f"blocks.{k}."
            expected = {n[len(pre):]: s for n, s in expected_arrays(self._config).items() if n.startswith(pre)}
            block = {n[len(pre):]: a for n, a in arrays.items()}
            if set(block) != set(expected) or any(block[n].shape != s for n, s in expected.items()):
                raise ValueError(f"{self._where}: block {k}'s arrays do not match the config")
            return _prepare(block, dtype, self._config.gamma_scale)

        def _read_dtype(self, dtype: np.dtype) -> np.dtype:
            """The dtype a block is read in for computing in ``dtype``: the compute dtype itself (one
            conversion, straight into the final layout) unless it is wider than the storage dtype, whose
            rounding of a wider file (F64 into float32) the loaded model has and must be kept."""
            return dtype if dtype.itemsize <= self._storage.itemsize else self._storage

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
            cfg = self._config.replace(**changes)
            if expected_arrays(cfg) != expected_arrays(self._config):
                raise ValueError("a streamed model can only change config fields that keep the same arrays")
            new = copy.copy(self)
            new._config, new._prepared = cfg, {}
            self._release()
            return new

        def astype(self, dtype: Any) -> Any:
            new = copy.copy(self)
            new._storage = np.dtype(dtype)
            new._weights = {n: a.astype(dtype) for n, a in self._weights.items()}
            new._prepared = {}
            self._release()
            return new

        def _release(self) -> None:
            """Drop the blocks this model holds, so that a copy sharing its buffer pool can reuse them."""
            for blocks, _ in self._prepared.values():
                blocks.release()

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
