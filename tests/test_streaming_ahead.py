"""Read-ahead of streamed blocks: the next block read on a background thread while one runs, in any
access order; its errors (a damaged tensor, an interrupt) raised in the caller; its buffers reused
only when no array of theirs is still referenced; no thread outlives its read."""

from __future__ import annotations

import gc
import json
import os
import threading
import weakref

import numpy as np
import pytest

from pyengine.models.pretrained import load_pretrained
from test_streaming import write_bf16_llama

L = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_bf16_llama(str(tmp_path_factory.mktemp("ahead") / "m"), d=32, H=4, Hkv=2, L=L, n=48, V=50)


@pytest.fixture(scope="module")
def full(folder):
    return load_pretrained(folder)


def ahead_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pyengine-read-ahead")]


def finish_reads():
    for t in ahead_threads():
        t.join(timeout=60)
    assert not ahead_threads()


def recorded(model):
    """The block reads of ``model`` in order, with the thread that made each one."""
    reads, read = [], model._read_block

    def record(k, dtype, st=None):
        reads.append((k, threading.current_thread() is threading.main_thread()))
        return read(k, dtype, st)

    model._read_block = record
    return reads


def same(a, b):
    return set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_random_access_order_and_values(folder, full, dtype):
    lazy = load_pretrained(folder, weights="mmap")
    reads = recorded(lazy)
    order = [2, 3, 0, 1, 1, 3, 2, 0, 1, 2, 3]
    for k in order:
        assert same(lazy.block_weights(k, dtype), full.block_weights(k, dtype)), k
        finish_reads()  # the record in a fixed order (a read-ahead would run on while the caller reads)
    # each miss reads the block in the caller, each read starts the next block's (after the last, the
    # first) on a thread; a block that was read ahead is not read again
    expect, ahead = [], None
    for i, k in enumerate(order):
        if i and k == order[i - 1]:
            continue
        if k != ahead:
            expect.append((k, True))
        ahead = (k + 1) % L
        expect.append((ahead, False))
    assert reads == expect


def test_sweeps_equal_loaded_and_reuse_two_buffers(folder, full):
    lazy = load_pretrained(folder, weights="mmap")
    ids = np.array([1, 7, 3, 22, 9, 40, 2, 5])
    for _ in range(3):
        assert np.array_equal(lazy.hidden_states(ids), full.hidden_states(ids))
    blocks = lazy._params(np.dtype(np.float32))[0]
    assert len(blocks._pool) == 2
    first = [id(b) for b in blocks._pool]
    assert np.array_equal(lazy.hidden_states(ids), full.hidden_states(ids))
    assert [id(b) for b in blocks._pool] == first  # reused, not reallocated


def test_held_block_never_overwritten(folder, full):
    lazy = load_pretrained(folder, weights="mmap")
    kept = lazy.block_weights(1)
    view = lazy.block_weights(2)["mlp.w_in"][:, 3:]  # a view alone keeps its buffer too
    for k in [0, 1, 2, 3, 0, 3, 2, 1, 0]:
        lazy.block_weights(k)
    finish_reads()
    assert same(kept, full.block_weights(1))
    assert np.array_equal(view, full.block_weights(2)["mlp.w_in"][:, 3:])


def damage(folder, k):
    """NaN written into the middle of block k's gate_proj."""
    name = f"model.layers.{k}.mlp.gate_proj.weight"
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        fname = json.load(f)["weight_map"][name]
    path = os.path.join(folder, fname)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        a, b = json.loads(f.read(n))[name]["data_offsets"]
        f.seek(8 + n + (a + b) // 2 // 2 * 2)
        f.write(np.uint16(0x7FC0).tobytes())


def test_reader_error_raised_in_caller(tmp_path, full):
    folder = write_bf16_llama(str(tmp_path / "m"), d=32, H=4, Hkv=2, L=L, n=48, V=50)
    damage(folder, 2)
    lazy = load_pretrained(folder, weights="mmap")  # the check reads names only
    reads = recorded(lazy)
    ids = np.array([1, 7, 3])
    lazy.block_weights(1)  # block 2 is read ahead, and fails on its thread
    finish_reads()
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.2\.mlp\.gate_proj\.weight' contains NaN"):
        lazy.block_weights(2)
    assert reads == [(1, True), (2, False)]
    with pytest.raises(ValueError, match="contains NaN"):  # asked again: read again, in the caller
        lazy.block_weights(2)
    assert reads[-1] == (2, True)
    with pytest.raises(ValueError, match="contains NaN"):  # in a sweep, read ahead again
        lazy.hidden_states(ids)
    finish_reads()
    assert reads[3:] == [(0, True), (1, False), (2, False)]  # block 0: the read ahead after 3 was dropped
    assert same(lazy.block_weights(3), full.block_weights(3))  # the model keeps working
    assert same(lazy.block_weights(0), full.block_weights(0))
    finish_reads()


def test_interrupt_in_reader_reaches_caller(folder, full):
    lazy = load_pretrained(folder, weights="mmap")
    read = lazy._read_block
    calls = []

    def interrupted(k, dtype, st=None):
        calls.append(k)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return read(k, dtype, st)

    lazy._read_block = interrupted
    lazy.block_weights(0)
    with pytest.raises(KeyboardInterrupt):
        lazy.block_weights(1)
    assert same(lazy.block_weights(1), full.block_weights(1))
    assert same(lazy.block_weights(2), full.block_weights(2))
    finish_reads()


def test_threads_end_and_model_is_freed(folder):
    lazy = load_pretrained(folder, weights="mmap")
    lazy.hidden_states(np.array([1, 2, 3]))
    lazy.block_weights(0)  # leaves block 1 being read
    finish_reads()
    gone = []
    weakref.finalize(lazy, gone.append, True)
    del lazy
    gc.collect()
    assert gone == [True]


def test_replace_copies_share_the_two_buffers(folder, full):
    """A replace copy (an ablation: another eps) takes over the original's two buffers instead of
    making two more: the original releases the blocks it holds, and both stay exact."""
    lazy = load_pretrained(folder, weights="mmap")
    h = full.embed(np.arange(6) % full.config.vocab_size).astype(np.float32)
    want = full.block_forward(1, h)
    np.testing.assert_array_equal(lazy.block_forward(1, h), want)
    finish_reads()
    pool = lazy._params(np.dtype(np.float32))[0]._pool
    before = [id(b) for b in pool]
    copy = lazy.replace(eps=1e-3)
    np.testing.assert_array_equal(copy.block_forward(1, h), full.replace(eps=1e-3).block_forward(1, h))
    np.testing.assert_array_equal(copy.block_forward(2, h), full.replace(eps=1e-3).block_forward(2, h))
    finish_reads()
    assert copy._params(np.dtype(np.float32))[0]._pool is pool and [id(b) for b in pool] == before
    np.testing.assert_array_equal(lazy.block_forward(1, h), want)  # the original reads its block again
