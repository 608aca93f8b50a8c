"""The recovery experiment, token Jacobians, the rho >= 1 statement and `pyengine recovery`."""

import csv
import json
import math

import numpy as np
import pytest

import pyengine as pe
from pyengine.cli import main
from pyengine.experiments import recovery
from pyengine.experiments.recovery import byte_ids
from pyengine.analysis import token_jacobians


def _stack(seed=0, dtype=np.float64, **kw):
    base = dict(d_model=16, n_heads=4, n_layers=4, d_mlp=32, vocab_size=256, max_seq_len=64)
    base.update(kw)
    return pe.init_weights(pe.StackConfig(**base), seed=seed, dtype=dtype, gamma_jitter=0.3, bias_std=0.1)


def _dense_block_jacobian(st, k, h):
    T, d = h.shape
    E = np.eye(T * d).reshape(T * d, T, d)
    return st.block_jvp(k, h, E).reshape(T * d, T * d).T  # column j = J e_j


LAYOUTS = [dict(), dict(layout="parallel"), dict(placement="post"), dict(norm="rmsnorm", positions="rotary"),
           dict(causal=False), dict(activation="silu_gated", n_kv_heads=2)]


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_token_jacobians_are_the_diagonal_blocks_of_the_dense_jacobian(kw):
    st = _stack(**kw)
    ids = np.arange(5, 12)
    h = st.hidden_states(ids)
    J = _dense_block_jacobian(st, 1, h[1])
    d = 16
    A = token_jacobians(st, h[1], 1, [0, 3, -1], chunk=7)
    for r, t in enumerate([0, 3, 6]):
        np.testing.assert_allclose(A[r], J[t * d:(t + 1) * d, t * d:(t + 1) * d], rtol=0, atol=1e-13)
    if st.config.causal:  # block lower-triangular: the spectrum is the blocks' spectra
        assert np.abs(J[:d, d:]).max() == 0
        rho_full = np.abs(np.linalg.eigvals(J)).max()
        rho_blocks = max(np.abs(np.linalg.eigvals(a)).max() for a in token_jacobians(st, h[1], 1, "all"))
        assert rho_full == pytest.approx(rho_blocks, rel=1e-9)


@pytest.mark.parametrize("layout", ["sequential", "parallel"])
@pytest.mark.parametrize("seed", range(4))
def test_rho_is_at_least_one_for_pre_layernorm_residual_blocks(layout, seed):
    """A_L 1 = 1 exactly: every LayerNorm Jacobian annihilates the all-ones direction."""
    st = _stack(seed=seed, layout=layout, d_model=24, n_heads=3)
    ids = np.random.default_rng(seed).integers(0, 256, 9)
    h = st.hidden_states(ids)
    for k in range(st.config.n_layers):
        A = token_jacobians(st, h[k], k, "all")
        np.testing.assert_allclose(A @ np.ones(24), np.ones((9, 24)), rtol=0, atol=1e-12)
        rho = np.abs(np.linalg.eigvals(A)).max(axis=1)
        assert (rho >= 1 - 1e-10).all()


def test_rmsnorm_does_not_annihilate_ones():
    st = _stack(norm="rmsnorm")
    h = st.hidden_states(np.arange(6))
    A = token_jacobians(st, h[0], 0, "last")[0]
    assert np.abs(A @ np.ones(16) - 1).max() > 1e-3


def test_token_jacobians_bad_arguments():
    st = _stack()
    h = st.hidden_states(np.arange(6))
    with pytest.raises(ValueError, match="positions must lie in"):
        token_jacobians(st, h[0], 0, [6])
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 4\)"
                       r" \(a block index; negative counts from the end\); got 4"):
        token_jacobians(st, h[0], 4, [0])
    with pytest.raises(ValueError, match=r"h must have shape \(T, d_model\)"):
        token_jacobians(st, h[:2], 0, [0])
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        token_jacobians(st, h[0], 0, [0], chunk=0)


def test_recovery_report_on_a_small_stack():
    st = _stack(n_layers=6, dtype=np.float32)
    rep = recovery(st, text="hello residual stream", layer=1, scales=[1e-3, 0.1, 10.0], n_directions=2,
                   eps_values=[1e-5, 1e-1], gamma_values=[0.5, 1.0])
    ex = rep.exact
    assert ex.K == 2 and ex.S == 4 and 6.0 in ex.scales  # the protocol scale is added
    assert rep.rho.shape == (5, 1) and rep.sigma.shape == (5, 1)
    assert (rep.rho >= 1 - 1e-9).all() and (rep.ones_residual < 1e-10).all()
    assert (rep.sigma >= rep.rho - 1e-9).all()  # sigma_max bounds rho
    assert len(rep.verdicts) == 5
    assert rep.verdicts[0].startswith("(1) spectra") and "rho(A_k) >= 1" in rep.verdicts[0]
    assert rep.verdicts[1].startswith("(2) residual") and rep.verdicts[2].startswith("(3) eps")
    # Tiny scales are linear: the regime starts at the smallest scale.
    assert rep.linear_gap[0] < 0.01 and rep.linear_regime[0] == pytest.approx(1e-3)
    table = rep.layer_table()
    assert [row["layer"] for row in table] == list(range(1, 7))
    assert table[0]["projection"] == pytest.approx(6.0, rel=1e-6)  # the injected state: proj = scale
    assert math.isnan(table[-1]["rho"])
    json.dumps(rep.to_dict(), default=float)


def test_recovery_on_rmsnorm_states_the_bound_as_measured():
    st = _stack(norm="rmsnorm", n_layers=3)
    rep = recovery(st, ids=np.arange(10, 20), layer=0, scales=[0.1], n_directions=1, eps_values=[1e-6],
                   gamma_values=[1.0])
    assert "no structural eigenvalue 1" in rep.verdicts[0]


def test_recovery_without_spectra_says_so_and_keeps_the_linear_model(tmp_path):
    """spectra=False skips the stage (a record says so), verdict (1) reads NOT RESOLVED, and the
    linear model and the uniform split are in the report, its JSON and its figure."""
    from pyengine.analysis.linear_model import scaling_fit, uniform_split
    from pyengine.experiments import write_report

    st = _stack(n_layers=4)
    ids = np.arange(40, 50)
    records = []
    rep = recovery(st, ids=ids, layer=1, scales=[0.5], n_directions=2, eps_values=[1e-5], gamma_values=[1.0],
                   spectra=False, dtype=np.float64, on_stage=lambda s, rec: records.append((s, rec)))
    assert rep.spectra_skipped and rep.rho.shape == (0, 1)
    assert rep.verdicts[0].startswith("(1) spectra: NOT RESOLVED (spectra skipped)")
    assert dict(records)["block Jacobian spectra"]["skipped"] is True
    want = scaling_fit(st, ids, 1, -1, n_probes=64, dtype=np.float64)  # d = 16 <= 64 probes: exact
    np.testing.assert_allclose(rep.scaling.alpha, want.alpha, rtol=1e-12)
    deltas = pe.propagate(st, ids, rep.exact.directions, rep.exact.scales, 1, return_deltas="last").deltas
    u, r = (x.mean(axis=(1, 2)) for x in uniform_split(deltas[:, rep.scale_index::rep.exact.S]))
    np.testing.assert_allclose(rep.uniform["exact"][0], u, rtol=1e-10)
    np.testing.assert_allclose(rep.uniform["exact"][1], r, rtol=1e-10)
    assert rep.scaling.ones_drift.max() < 1e-12  # pre-LN: J_k 1 = 1, a uniform delta passes every branch unseen
    write_report(rep, str(tmp_path))
    doc = json.loads((tmp_path / "recovery.json").read_text())
    assert doc["spectral"]["skipped"] is True and doc["spectral"]["reason"].startswith("spectra skipped")
    sf = doc["scaling_fit"]
    assert sf["layers"] == [1, 2, 3, 4] and sf["n_probes"] == 0
    assert len(sf["alpha"]) == len(sf["beta"]) == len(sf["unexplained"]) == 4
    us = doc["uniform_split"]
    assert len(us["uniform"]) == len(us["nonuniform"]) == len(us["uniform_linear"]) == 4
    assert doc["protocol"].startswith("protocol: ") and doc["table"][1]["alpha"] == pytest.approx(want.alpha[1])
    assert (tmp_path / "recovery_linear_model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = pe.experiments.format_table(rep)
    assert "block Jacobian spectra: skipped" in text and "linear model: J_k = d h_k / d h_1" in text
    assert text.splitlines()[-1] == rep.protocol


def test_cli_recovery_no_spectra(tmp_path, capsys):
    path = tmp_path / "stack.npz"
    _stack(n_layers=3, dtype=np.float32, d_model=32, n_heads=4).save(path)
    out = tmp_path / "out"
    assert main(["recovery", "--model", str(path), "--text", "short", "--scales", "1", "--directions", "1",
                 "--no-spectra", "--probes", "8", "--no-plots", "--out", str(out), "--progress", "never"]) == 0
    text = capsys.readouterr().out
    assert "(1) spectra: NOT RESOLVED (spectra skipped)" in text and "8 Rademacher probes" in text
    doc = json.loads((out / "recovery.json").read_text())
    assert doc["spectral"]["skipped"] is True and doc["scaling_fit"]["n_probes"] == 8
    assert all(v > 0 for v in doc["scaling_fit"]["alpha_se"][1:])
    stage = json.loads((out / "stages" / "04-block-jacobian-spectra.json").read_text())
    assert stage["skipped"] is True


def test_linear_gap_uses_the_whole_delta():
    """Exact and linearized deltas compared as vectors, not only along v."""
    from pyengine.experiments.recovery import _linear_gap, _regime

    st = _stack(n_layers=3)
    v = np.random.default_rng(0).standard_normal(16)
    kw = dict(return_deltas="all")
    ex = pe.propagate(st, np.arange(30, 40), v, [1e-4, 1e2], 0, **kw)
    li = pe.propagate(st, np.arange(30, 40), v, [1e-4, 1e2], 0, linearized=True, **kw)
    gap = _linear_gap(ex, li)
    d_ex, d_li = ex.deltas[1:, 1], li.deltas[1:, 1]
    want = max(np.linalg.norm(d_ex[k] - d_li[k]) / np.linalg.norm(d_li[k]) for k in range(3))
    assert gap[1] == pytest.approx(want, rel=1e-12) and gap[0] < 1e-3
    assert _regime(np.array([1e-4, 1e2]), np.array([0.01, 0.5])) == (1e-4, 1e-4)
    assert _regime(np.array([3.0, 1.0, 2.0, 4.0]), np.array([0.01, 0.5, 0.05, 0.2])) == (2.0, 3.0)
    assert _regime(np.array([1.0, 2.0]), np.array([np.nan, 0.5])) is None


def test_recovery_bad_arguments():
    with pytest.raises(ValueError, match="read = 'downstream' selects no token"):
        recovery(_stack(), ids=np.arange(5), read="downstream")
    with pytest.raises(ValueError, match="no tokenizer"):
        recovery(_stack(vocab_size=100), text="x")
    with pytest.raises(ValueError, match="n_directions must be a positive integer"):
        recovery(_stack(), ids=np.arange(5), n_directions=0)
    with pytest.raises(ValueError, match="read must be"):
        recovery(_stack(), ids=np.arange(5), read="first")
    with pytest.raises(ValueError, match="text must not be empty"):
        byte_ids("")
    with pytest.raises(TypeError, match="model must be"):
        recovery("gpt2", ids=np.arange(3))


def test_cli_recovery_writes_json_csv_png(tmp_path, capsys):
    path = tmp_path / "stack.npz"
    _stack(n_layers=3, dtype=np.float32).save(path)
    out = tmp_path / "out"
    rc = main(["recovery", "--model", str(path), "--text", "a short one", "--layer", "1", "--scales", "0.01,1",
               "--directions", "2", "--positions", "2:", "--out", str(out), "--progress", "never"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "(1) spectra" in text and "decay of |projection|" in text
    doc = json.loads((out / "recovery.json").read_text())
    assert doc["layer"] == 1 and len(doc["table"]) == 3 and len(doc["verdicts"]) == 5
    rows = list(csv.DictReader((out / "layers.csv").read_text().splitlines()))
    assert [int(r["layer"]) for r in rows] == [1, 2, 3]
    metrics = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert len(metrics) == 2 * 3 * (2 * 3) * 11  # runs x layers x (K x S) x T
    assert (out / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "recovery_linear_model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "linear model: J_k" in text and text.rstrip().splitlines()[-2].startswith("protocol: ")
    assert doc["scaling_fit"]["layers"] == [1, 2, 3] and not doc["spectral"]["skipped"]


def test_cli_missing_model_library_is_one_line(monkeypatch, capsys):
    import pyengine.cli.recovery as cli

    def missing(name, seed=0, weights="load"):
        raise ImportError("the model readers are not installed: pip install \".[models]\"")

    monkeypatch.setattr(cli, "load_model", missing)
    assert main(["recovery", "--model", "SmolLM2-135M-Instruct"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyengine: error:") and "models" in err and err.count("\n") == 1


def test_cli_recovery_errors_are_one_line(tmp_path, capsys):
    assert main(["recovery", "--model", str(tmp_path / "missing.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = tmp_path / "stack.npz"
    _stack(n_layers=2, dtype=np.float32).save(path)
    assert main(["recovery", "--model", str(path), "--layer", "5", "--out", str(tmp_path / "o")]) == 2
    assert "layer must be" in capsys.readouterr().err


@pytest.mark.slow
def test_default_model_and_byte_tokens():
    m = pe.experiments.default_model()
    c = m.config
    assert (c.d_model, c.n_heads, c.n_layers, c.d_mlp, c.placement, c.norm) == (768, 12, 12, 3072, "pre", "layernorm")
    assert m.dtype == np.float32
    assert np.array_equal(byte_ids("Ab"), [65, 98])
    assert np.array_equal(m.weights["blocks.0.attn.w_o"], pe.experiments.default_model().weights["blocks.0.attn.w_o"])


def test_stages_report_progress_and_records_in_order():
    """progress goes from 0 to 1 through the seven stages; on_stage gets each one's record as it
    finishes; the propagations equal pyengine.propagate with the unit directions recovery made."""
    st = _stack(dtype=np.float32)
    calls, records = [], []
    D = np.random.default_rng(5).standard_normal((2, 16)) * [[1e-3], [40.0]]
    r = recovery(st, ids=np.arange(3, 15), layer=1, directions=D, scales=(0.5, 2.0), eps_values=[1e-5],
                 gamma_values=[1.0], progress=lambda f, s: calls.append((f, s)),
                 on_stage=lambda s, rec: records.append((s, rec)))
    names = ["exact propagation", "linearized propagation", "linear model", "block Jacobian spectra",
             "ablation: no residual", "sweep: norm eps", "sweep: gamma scale"]
    assert [s for s, _ in records] == names and list(r.seconds) == names + ["total"]
    assert [s for s in dict.fromkeys(s for _, s in calls)] == names + ["done"]
    fracs = [f for f, _ in calls]
    assert fracs[0] == 0.0 and fracs[-1] == 1.0 and all(0.0 <= f <= 1.0 for f in fracs)
    assert all(f > 0 for f, s in calls[1:])  # estimated from the first block measured on
    assert all(rec["stage"] == s and rec["seconds"] >= 0 for s, rec in records)
    assert records[0][1]["propagation"]["cosine"] == r.exact.to_dict()["cosine"]
    assert records[3][1]["blocks"] == [2, 3, 4] and records[5][1]["sweep"][0]["eps"] == 1e-5
    assert records[2][1]["scaling_fit"]["layers"] == [1, 2, 3, 4]
    unit = D / np.linalg.norm(D, axis=1)[:, None]  # to rounding: recovery's own unit rows
    again = pe.propagate(st, np.arange(3, 15), pe._validate.unit_rows("d", D, 16), r.exact.scales, 1,
                         dtype=np.float32)
    np.testing.assert_array_equal(again.directions, r.exact.directions)
    np.testing.assert_array_equal(again.projection, r.exact.projection)
    np.testing.assert_allclose(r.exact.directions, unit, rtol=1e-15)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_linear_model_line_claims_J1_equal_1_only_for_pre_ln_stacks(norm):
    """The report states the structural J_k 1 = 1 for a pre-LN residual stack only; an RMSNorm
    stack gets the measured drift without the claim (its Jacobian does not annihilate 1)."""
    st = _stack(n_layers=3, norm=norm)
    rep = recovery(st, ids=np.arange(40, 48), layer=1, scales=[0.5], n_directions=2, eps_values=[1e-5],
                   gamma_values=[1.0], spectra=False, dtype=np.float64)
    text = pe.experiments.format_table(rep)
    claims = "every LayerNorm Jacobian annihilates 1" in text
    assert claims == (norm == "layernorm")
    assert ("does not annihilate 1 by construction" in text) == (norm == "rmsnorm")
    if norm == "rmsnorm":
        assert rep.scaling.ones_drift.max() > 1e-3  # the drift the report prints is real
