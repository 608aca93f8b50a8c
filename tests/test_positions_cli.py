"""``pyengine positions``: the default synthetic pair end to end, its files, and a real model (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "pyengine", "positions", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


def test_cli_default_synthetic_pair(tmp_path):
    r = _run(tmp_path, "--contexts", "24", "--length", "8", "--ablation-contexts", "6", "--out", "o")
    assert r.returncode == 0, r.stderr
    assert "synthetic pre-LN" in r.stdout and "synthetic post-LN" in r.stdout and "Spearman" in r.stdout
    doc = json.loads((tmp_path / "o" / "positions.json").read_text())
    pre, post = doc["models"]
    assert pre["placement"] == "pre" and post["placement"] == "post"
    assert np.allclose(post["placement_profile"]["norm"][1:], 1.0, atol=1e-3)
    assert pre["placement_profile"]["norm"][-1] > 2 * pre["placement_profile"]["norm"][1]
    for f in ("positions.csv", "positions_depth.png", "positions_angles.png", "placement.png"):
        assert (tmp_path / "o" / f).stat().st_size > 0
    assert r.stdout.count("protocol: uniform random ids (seed 0): 24 contexts x 8 tokens") == 2
    assert "WARNING" not in r.stdout and "no position dominates" in r.stdout and "position-only run" in r.stdout
    assert pre["dominant_position"] == [None] * 13 and pre["variants"]["without_first"]["exclude_first"] == 1
    assert pre["variants"]["all"]["rel_norm"] == pre["decomposition"]["rel_norm"]
    assert pre["attention_distance"]["contexts"] == 24 and pre["position_only"]["k"] == 4


def test_cli_exclude_first(tmp_path):
    r = _run(tmp_path, "--contexts", "8", "--length", "6", "--ablation-contexts", "2", "--exclude-first", "2",
             "--out", "o")
    assert r.returncode == 0, r.stderr
    pre = json.loads((tmp_path / "o" / "positions.json").read_text())["models"][0]
    assert pre["variants"]["without_first"]["exclude_first"] == 2 and "share t>=2" in r.stdout


def test_cli_bad_arguments(tmp_path):
    r = _run(tmp_path, "--layers", "0,x")
    assert r.returncode == 2 and "--layers" in r.stderr and "Traceback" not in r.stderr
    r = _run(tmp_path, "--corpus", str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "missing.txt" in r.stderr
    r = _run(tmp_path, "--layers", "0,99", "--contexts", "8")
    assert r.returncode == 2 and "layers" in r.stderr
    r = _run(tmp_path, "--exclude-first", "7", "--length", "8")
    assert r.returncode == 2 and "--exclude-first" in r.stderr and "Traceback" not in r.stderr
    r = _run(tmp_path, "--exclude-first", "-1")
    assert r.returncode == 2 and "--exclude-first" in r.stderr


@pytest.mark.slow
def test_cli_own_corpus_and_layers(tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(f"sentence number {i} has a few more words in it" for i in range(20)))
    r = _run(tmp_path, "--corpus", "c.txt", "--layers", "0,6,12", "--contexts", "16", "--length", "6",
             "--ablation-contexts", "4", "--out", "o")
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "o" / "positions.json").read_text())
    assert doc["models"][0]["layers"] == [0, 6, 12]
    assert len(doc["models"][0]["probe"]["r2"]) == 3


@pytest.mark.slow
def test_cli_minilm(tmp_path):
    pytest.importorskip("tokenizers")
    r = _run(tmp_path, "--model", "all-MiniLM-L6-v2", "--out", "o")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "o" / "positions.json").read_text())["models"][0]
    assert m["placement"] == "post" and m["contexts"] > 100
    assert m["probe"]["r2"][0] > 0.9 and max(m["probe"]["r2_shuffled"]) < 0.05  # learned absolute positions
