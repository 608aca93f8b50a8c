"""Sites in the scans: recovery at a site (Python and --site), the norm-input
spectra of a model's sites (Python and ``pyengine scan spectral --sites``)."""

import json
import subprocess
import sys

import numpy as np
import pytest

import pyengine as pe
from pyengine.analysis import norm_site_inputs, site_spectra
from pyengine.experiments import recovery


@pytest.fixture(scope="module")
def small():
    cfg = pe.StackConfig(d_model=32, n_heads=2, n_layers=4, d_mlp=64, norm="layernorm", placement="pre",
                         vocab_size=256, max_seq_len=128, positions="learned")
    return pe.init_weights(cfg, scheme="gpt2", seed=0, gamma_jitter=0.2)


@pytest.fixture(scope="module")
def small_npz(small, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model") / "small.npz")
    small.save(path)
    return path


KW = dict(text="a short sentence here", scales=[1.0], protocol_scale=1.0, n_directions=2, gamma_values=[1.0],
          eps_values=[1e-5], dtype=np.float64)


def test_recovery_at_a_site_is_propagate_at_that_site(small):
    rep = recovery(small, layer="blocks.1.resid_mid", **KW)
    assert rep.site == "blocks.1.resid_mid" and rep.layer == 1
    table = rep.layer_table()
    assert [r["layer"] for r in table] == [1.5, 2, 3, 4]
    assert np.isnan(table[0]["adjacent_cosine"]) and np.isfinite(table[1]["adjacent_cosine"])
    v = np.random.default_rng(0).standard_normal((2, 32))
    ids = rep.ids
    p = pe.propagate(small, ids, v, [1.0], "blocks.1.resid_mid", dtype=np.float64)
    np.testing.assert_allclose(rep.exact.projection, p.projection, atol=1e-12)
    assert rep.rho.shape[0] == 3  # block spectra from the site's block on
    d = rep.to_dict()
    assert d["site"] == "blocks.1.resid_mid" and d["table"][0]["layer"] == 1.5
    # resid_pre k is hidden state k
    a = recovery(small, layer="blocks.1.resid_pre", **KW)
    b = recovery(small, layer=1, **KW)
    np.testing.assert_array_equal(a.exact.projection, b.exact.projection)
    assert [r["layer"] for r in a.layer_table()] == [1, 2, 3, 4]
    # an MLP-hidden site: directions of width d_mlp
    m = recovery(small, layer="blocks.2.mlp.hidden", **KW)
    assert m.exact.directions.shape == (2, 64)
    with pytest.raises(ValueError, match="resid_mid"):
        recovery(small, layer="blocks.1.attn.pattern", **KW)


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "pyengine", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_recovery_cli_site(tmp_path, small_npz):
    done = _run(tmp_path, "recovery", "--model", small_npz, "--site", "blocks.1.resid_mid", "--scales", "1",
                "--scale", "1", "--directions", "2", "--no-plots", "--progress", "never", "--out", "o")
    assert done.returncode == 0, done.stderr
    assert "site blocks.1.resid_mid" in done.stdout
    rep = json.loads((tmp_path / "o" / "recovery.json").read_text())
    assert rep["site"] == "blocks.1.resid_mid" and rep["layer"] == 1 and rep["table"][0]["layer"] == 1.5
    both = _run(tmp_path, "recovery", "--model", small_npz, "--site", "blocks.1.resid_mid", "--layer", "1")
    assert both.returncode == 2 and "--site and --layer" in both.stderr and "Traceback" not in both.stderr
    bad = _run(tmp_path, "recovery", "--model", small_npz, "--site", "blocks.1.attn.scores")
    assert bad.returncode == 2 and "resid_mid" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_site_spectra_equal_the_norm_inputs_of_the_forward(small):
    ids = np.arange(5, 17)
    names, X, gamma = norm_site_inputs(small, ids, "blocks.*.norm*.input")
    assert names == [f"blocks.{k}.norm{j}.input" for k in range(4) for j in (1, 2)]
    _, cache = small.run_with_cache(ids, names)
    for i, n in enumerate(names):
        np.testing.assert_array_equal(X[i], cache[n])
    w = small.weights
    np.testing.assert_array_equal(gamma[1], w["blocks.0.norm2.gamma"])
    r = site_spectra(small, ids, ["blocks.2.norm1.input", "final_norm.input"])
    assert r.sites == ["blocks.2.norm1.input", "final_norm.input"] and r.sigma.shape == (2, 12)
    want = pe.layer_norm_spectral_norm(cache["blocks.2.norm1.input"], w["blocks.2.norm1.gamma"],
                                       small.config.eps).sigma
    np.testing.assert_allclose(r.sigma[0], want, rtol=1e-6)
    with pytest.raises(ValueError, match="matches no norm-input site"):
        site_spectra(small, ids, "blocks.*.resid_mid")


def test_scan_spectral_sites(tmp_path):
    done = _run(tmp_path, "scan", "spectral", "--model", "tiny", "--sites", "blocks.*.norm2.input",
                "--tokens", "64", "--seq-len", "32", "--workers", "0", "--progress", "never", "--out", "st")
    assert done.returncode == 0, done.stderr
    res = pe.distributed.load(str(tmp_path / "st"))
    assert res.params["sites"] == [f"blocks.{k}.norm2" for k in range(4)]
    assert res.metrics["sigma"].shape == (4, 64) and np.isfinite(res.metrics["sigma"]).all()
    assert "blocks.3.norm2" in done.stdout
    bad = _run(tmp_path, "scan", "spectral", "--model", "tiny", "--sites", "blocks.*.nothing", "--tokens",
               "64", "--workers", "0", "--out", "st2")
    assert bad.returncode == 2 and "matches no norm-input site" in bad.stderr
