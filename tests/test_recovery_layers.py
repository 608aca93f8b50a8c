"""recovery's spectra on a chosen subset of blocks, and the CLI's --spectra-layers and --weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pyengine as pe
from pyengine.cli import main
from pyengine.experiments import recovery


def _stack(**kw):
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=5, d_mlp=32, vocab_size=256, max_seq_len=64, **kw)
    return pe.init_weights(cfg, seed=1, dtype=np.float64, gamma_jitter=0.3, bias_std=0.1)


def test_spectra_on_a_subset_are_the_full_run_rows_and_the_verdict_averages_them():
    st = _stack()
    kw = dict(text="a subset of blocks", layer=1, scales=[1.0], n_directions=2, eps_values=[1e-5],
              gamma_values=[1.0])
    full = recovery(st, **kw)
    part = recovery(st, spectra_layers=[2, -1], **kw)  # hidden states 2 and 4: rows 1 and 3 of blocks 1..4
    assert part.rho.shape == full.rho.shape == (4, 1)
    formed = np.array([False, True, False, True])
    np.testing.assert_array_equal(part.rho[formed], full.rho[formed])
    np.testing.assert_array_equal(part.sigma[formed], full.sigma[formed])
    assert np.isnan(part.rho[~formed]).all() and np.isnan(part.ones_residual[~formed]).all()
    assert (part.spectra_how["rho_method"][~formed] == "skipped").all()
    pred = -np.log(full.rho[formed].max(axis=1)).mean()
    assert f"whose spectra were formed (2 of 4) = {pred:+.3f}" in part.verdicts[0]
    assert "formed" not in full.verdicts[0]
    rows = part.layer_table()
    assert np.isnan(rows[0]["rho"]) and rows[1]["rho"] == full.layer_table()[1]["rho"]
    json.dumps(part.to_dict(), allow_nan=True)
    assert recovery(st, spectra_layers="last", **kw).rho[:-1].size == 3


@pytest.mark.parametrize("bad, match", [([0], r"spectra_layers must name blocks from the injection on .*got 0"),
                                        ([7], r"spectra_layers must lie in \[-5, 5\)"),
                                        ("first", "spectra_layers must be 'all', 'last'")])
def test_spectra_layers_bad_values_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        recovery(_stack(), text="x y", layer=1, spectra_layers=bad)


def test_cli_spectra_layers_and_weights(tmp_path, capsys, monkeypatch):
    import pyengine.cli.recovery as cli

    path = tmp_path / "m.npz"
    _stack().save(path)
    out = tmp_path / "o"
    assert main(["recovery", "--model", str(path), "--text", "four words of text", "--layer", "1", "--scales", "1",
                 "--directions", "1", "--spectra-layers", "3", "--no-plots", "--progress", "never",
                 "--out", str(out)]) == 0
    doc = json.loads((out / "recovery.json").read_text())
    assert [r[0] is None for r in doc["spectral"]["rho"]] == [True, True, False, True]
    assert main(["recovery", "--model", str(path), "--spectra-layers", "0", "--layer", "1", "--out",
                 str(tmp_path / "o2")]) == 2
    assert "spectra_layers must name blocks from the injection on" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr("pyengine.models.pretrained.load_pretrained", lambda name, weights: seen.append(weights))
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    cli.load_model(str(folder), weights="auto")
    monkeypatch.setattr(cli, "STREAM_BYTES", -1)
    cli.load_model(str(folder), weights="auto")
    cli.load_model(str(folder), weights="load")
    assert seen == ["load", "mmap", "load"]
