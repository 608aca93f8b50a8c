"""The `pyengine spectral` command: synthetic tokens, activation files and their errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyengine.cli import main
from test_spectral import dense_sigma, realistic


def test_cli_spectral_synthetic(tmp_path, capsys):
    js, cs = tmp_path / "out.json", tmp_path / "out.csv"
    rc = main(["spectral", "--tokens", "300", "--d", "32", "--json", str(js), "--csv", str(cs), "--bins", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "min" in out and "median" in out and "sigma_max < 1:" in out and "histogram (5 bins)" in out
    doc = json.loads(js.read_text())
    assert doc["tokens"] == 300 and len(doc["sigma"]) == 300 and sum(doc["histogram"]["counts"]) == 300
    rows = cs.read_text().splitlines()
    assert rows[0] == "token,sigma,lower,upper,residual,iterations,converged" and len(rows) == 301


def test_cli_spectral_file_input_and_methods(tmp_path, capsys):
    x, gamma = realistic(40, 16, seed=24, dtype=np.float32)
    np.savez(tmp_path / "acts.npz", resid=x, other=np.zeros(3))
    np.save(tmp_path / "gamma.npy", gamma)
    rc = main(["spectral", "--input", str(tmp_path / "acts.npz"), "--key", "resid", "--gamma",
               str(tmp_path / "gamma.npy"), "--method", "lanczos", "--norm", "rmsnorm", "--tol", "1e-6",
               "--json", str(tmp_path / "o.json")])
    assert rc == 0
    doc = json.loads((tmp_path / "o.json").read_text())
    want = dense_sigma("rms_norm", x, gamma)
    np.testing.assert_allclose(doc["sigma"], want, rtol=1e-5)
    assert "converged (residual <= 1e-06): 40 of 40" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make", "args", "msg"),
    [
        (lambda p: p.write_text("not numpy"), [], "cannot read activations file"),
        (lambda p: np.save(p, np.arange(6).reshape(2, 3)), [], "must be float32 or float64; got int64"),
        (lambda p: np.save(p, np.ones(5)), [], r"must have shape \(N, d\)"),
        (None, [], "activations file not found"),
        (lambda p: np.save(p, np.ones((3, 4))), ["--gamma", "MISSING.npy"], "gamma file not found"),
    ],
    ids=["garbage", "int", "1d", "missing", "missing-gamma"],
)
def test_cli_spectral_bad_files(tmp_path, capsys, make, args, msg):
    path = tmp_path / "acts.npy"
    if make is not None:
        make(path)
    rc = main(["spectral", "--input", str(path), *[str(tmp_path / a) if a.endswith(".npy") else a for a in args]])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("pyengine: error:") and msg.split("\\")[0][:12] in err
    assert "Traceback" not in err
