"""The model commands on every family: ``pyengine recovery`` with ``--model`` a folder of each, and
a Gemma 2 and a Phi-3 (head_dim apart from d / H, sliding windows, per layer for Gemma 2) as a hub
id in a temporary cache; ``spectral`` and ``positions`` on those two folders. The reports hold
finite numbers and name the model and its family."""

from __future__ import annotations

import json
import math

import pytest
from test_load_sources import FAMILIES, _cache_model, _model, save_with_tokenizer

from pyengine import cli

TEXT = "the cat sat on the mat and the dog sat on the cat"
WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "and", "dog"]
ARCHITECTURE = {"llama3": "llama", "qwen2_sliding": "qwen2", "qwen3_hd8": "qwen3"}  # the model_type of a test family


def _vocab():
    """Word-level ids 3 ... 10: none of them the pad id 0, whose embedding row is zero."""
    return {w: 3 + i for i, w in enumerate(WORDS)}


def _finite(values):
    values = [v for v in values if v is not None]
    return bool(values) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


@pytest.mark.fidelity
@pytest.mark.parametrize("source, family", [("folder", f) for f in FAMILIES] + [("hub", "gemma2"), ("hub", "phi3")])
def test_recovery_runs_on_the_family(request, tmp_path, monkeypatch, family, source):
    pytest.importorskip("transformers")
    if source == "hub":
        cache = request.getfixturevalue("hub_cache")
        _cache_model(cache, f"tiny-org/tiny-{family}", _model(family), _vocab())
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        model, name = f"tiny-org/tiny-{family}", f"tiny-org/tiny-{family}"
    else:
        model, name = str(save_with_tokenizer(tmp_path / family, _model(family), _vocab())), family
    out = tmp_path / "o"
    assert cli.main(["recovery", "--model", model, "--text", TEXT, "--layer", "1", "--directions", "2",
                     "--no-plots", "--progress", "never", "--out", str(out)]) == 0
    rep = json.loads((out / "recovery.json").read_text())
    prov = rep["provenance"]
    assert prov["model"] == name and prov["architecture"] == ARCHITECTURE.get(family, family)
    assert list(prov["weights_sha256"]) == ["model.safetensors"]
    cfg = rep["config"]
    if family in ("gemma2", "phi3"):
        assert cfg["n_heads"] * cfg["head_dim"] != cfg["d_model"] and cfg["sliding_window"]
    assert len(rep["ids"]) == 13 and 0 not in rep["ids"]
    rows = rep["table"]
    assert [r["layer"] for r in rows] == list(range(1, cfg["n_layers"] + 1))
    for key in ("h_norm", "delta_norm", "projection", "projection_linear", "cosine", "norm_ratio", "gain_linear",
                "alpha", "beta", "rho", "sigma_max"):
        assert _finite([r[key] for r in rows]), key
    assert _finite(sum(rep["spectral"]["rho"], [])) and not rep["spectral"]["skipped"]
    assert _finite([rep["fit_exact"]["rate"], rep["fit_linear"]["rate"], rep["fit_exact"]["r2"]])


@pytest.mark.fidelity
@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_spectral_and_positions_run_on_the_family(tmp_path, family):
    pytest.importorskip("transformers")
    folder = save_with_tokenizer(tmp_path / family, _model(family), _vocab())
    assert cli.main(["spectral", "--model", str(folder), "--text", TEXT, "--progress", "never",
                     "--json", str(tmp_path / "s.json")]) == 0
    rep = json.loads((tmp_path / "s.json").read_text())
    assert rep["provenance"]["architecture"] == family and rep["norm"] == "rmsnorm"
    outputs = ("norm1_out", "norm2_out") if family == "gemma2" else ()  # Gemma 2's peri norms are scanned too
    L = 3 if family == "gemma2" else 2
    assert rep["sites"] == [f"blocks.{k}.{n}.input" for k in range(L) for n in sorted(("norm1", "norm2", *outputs))]
    assert len(rep["sigma"]) == 13 * len(rep["sites"]) and _finite(rep["sigma"]) and all(rep["converged"])
    assert cli.main(["positions", "--model", str(folder), "--length", "8", "--contexts", "8",
                     "--ablation-contexts", "2", "--out", str(tmp_path / "p")]) == 0
    doc = json.loads((tmp_path / "p" / "positions.json").read_text())
    assert doc["provenance"]["architecture"] == family
    (m,) = doc["models"]
    assert m["positions"] == "rotary" and m["layers"] == list(range(L + 1))
    assert m["placement"] == ("peri" if family == "gemma2" else "pre")
    prop = m["propagation"]
    assert _finite(sum(prop["projection"], [])) and _finite(sum(prop["projection_linearized"], []))
    assert _finite(m["probe"]["r2"])
