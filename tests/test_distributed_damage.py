"""Damaged sweep stores: every damaged point file is named by ``load`` and recomputed by a
resumed sweep (bit-identical to an undamaged run); a damaged manifest or ``errors.json`` is
one ValueError naming the file, and one line from the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyengine.distributed import Store, load, scan

GRID = {"seeds": list(range(6)), "tokens": 8, "d": 8}
N = 6


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    out = tmp_path_factory.mktemp("pristine") / "s"
    res = scan("norms", GRID, out=out, chunk=1)
    assert res.complete
    return out, res.metrics["sigma"]


def _damage(path, kind, offset):
    with open(path, "rb") as fh:
        data = fh.read()
    if kind == "empty":
        data = b""
    elif kind == "truncated":
        data = data[:offset % len(data)]
    elif kind == "garbage":
        data = np.random.default_rng(offset).bytes(1 + offset % 2000)
    else:  # a valid archive with its other entries (the checksum) kept, but other metric arrays
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        sigma = arrays.pop("sigma")
        arrays.update({"other": sigma} if kind == "names" else {"sigma": sigma[: 1 + offset % (sigma.size - 1)]})
        with open(path, "wb") as fh:
            np.savez(fh, **arrays)
        return
    with open(path, "wb") as fh:
        fh.write(data)


KINDS = ("empty", "truncated", "garbage", "names", "shape")
damage = st.dictionaries(st.integers(0, N - 1), st.tuples(st.sampled_from(KINDS), st.integers(0, 10**6)),
                         min_size=1, max_size=N)


@settings(max_examples=25, deadline=None)
@given(damage)
def test_load_names_and_resume_recomputes_exactly_the_damaged_points(pristine, damage):
    src, sigma = pristine
    out = src.parent / "work"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    store = Store(out)
    for i, (kind, offset) in damage.items():
        _damage(store.point_path(i), kind, offset)
    with pytest.raises(ValueError, match="damaged") as info:
        load(out)
    assert store.point_path(min(damage)) in str(info.value)
    assert set(store.damaged(N)) == set(damage)
    res = scan("norms", GRID, out=out, chunk=1, resume=True)
    assert set(res.damaged) == set(damage)
    assert all(store.point_path(i) in m for i, m in res.damaged.items())
    assert res.computed == len(damage) and res.complete
    assert np.array_equal(res.metrics["sigma"], sigma)
    assert np.array_equal(load(out).metrics["sigma"], sigma)
    assert store.damaged(N) == {}


def test_points_are_written_atomically(tmp_path, monkeypatch):
    """A write that dies midway leaves no point file and no temporary behind."""
    store_dir = tmp_path / "s"
    scan("norms", {**GRID, "seeds": [0]}, out=store_dir)
    store = Store(store_dir)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(KeyboardInterrupt):
        store.write(5, {"sigma": np.zeros(3)})
    assert sorted(os.listdir(store_dir / "points")) == ["000000.npz"]


MANIFESTS = {
    "truncated": lambda text: text[: len(text) // 2],
    "a list": lambda text: json.dumps([1, 2]),
    "no points": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "points"}),
    "empty": lambda text: "",
}


@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_a_damaged_manifest_is_one_error_naming_it(tmp_path, pristine, kind):
    out = tmp_path / "s"
    shutil.copytree(pristine[0], out)
    path = out / "manifest.json"
    path.write_text(MANIFESTS[kind](path.read_text()))
    with pytest.raises(ValueError, match="damaged") as info:
        load(out)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="manifest.json is damaged"):
        scan("norms", GRID, out=out, chunk=1, resume=True)
    proc = _cli(tmp_path, "--resume")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"pyengine: error: {os.path.join('s', 'manifest.json')} is damaged"), line


def test_a_damaged_errors_file_is_named_by_load_and_rewritten_on_resume(tmp_path, pristine):
    out = tmp_path / "s"
    shutil.copytree(pristine[0], out)
    (out / "errors.json").write_text('{"errors": [{"ind')
    with pytest.raises(ValueError, match="errors.json is damaged"):
        load(out)
    res = scan("norms", GRID, out=out, chunk=1, resume=True)
    assert res.complete and res.computed == 0
    assert load(out).errors == []


def _cli(cwd, *extra):
    return subprocess.run([sys.executable, "-m", "pyengine", "scan", "norms", "--workers", "0", "--points", str(N),
                           "--tokens", "8", "--d", "8", "--chunk", "1", "--progress", "never", "--out", "s", *extra],
                          cwd=cwd, capture_output=True, text=True, timeout=240)


def test_cli_resume_recomputes_a_truncated_point(tmp_path):
    assert _cli(tmp_path).returncode == 0
    path = Store(tmp_path / "s").point_path(2)
    _damage(path, "truncated", 100)
    proc = _cli(tmp_path, "--resume")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"recomputed: point file {os.path.join('s', 'points', '000002.npz')} is damaged" in proc.stdout
    assert "1 computed now, 5 stored before" in proc.stdout
    assert os.path.exists(path + ".damaged")


@pytest.mark.parametrize("budget, needed", [(1, "needs about 2.0 KiB"), (1000, "memory_budget = 1000 bytes")])
def test_memory_budget_message_uses_a_readable_unit(budget, needed):
    with pytest.raises(ValueError, match="memory_budget") as info:
        scan("norms", GRID, memory_budget=budget)
    assert needed in str(info.value) and "0.0 MiB" not in str(info.value)
