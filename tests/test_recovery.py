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


def test_verdict_logic():
    """Each verdict's head follows its numbers: consistent/contradicted, inconclusive fits."""
    import dataclasses

    from pyengine.experiments.recovery import _verdicts

    st = _stack(n_layers=6)
    rep = recovery(st, ids=np.arange(20, 32), layer=0, scales=[0.1], n_directions=2, eps_values=[1e-5, 1e-3],
                   gamma_values=[0.5, 1.0])

    def fit(rate, half=0.01, n=6):
        return pe.DecayFit(rate, (rate - half, rate + half), 0.99, math.inf, 0.0, n)

    pred = float(-np.log(rep.rho.max(axis=1)).mean())
    heads = {}
    for name, changes in {
        "match": dict(fit_exact=fit(pred)),
        "miss": dict(fit_exact=fit(pred + 1.0)),
        "wide": dict(fit_exact=fit(pred, half=0.5)),
        "short": dict(fit_exact=fit(pred, n=2)),
        "res_sep": dict(fit_exact=fit(0.0), no_residual=fit(0.5)),
        "res_same": dict(fit_exact=fit(0.0), no_residual=fit(0.005)),
        "eps": dict(eps_sweep=[(1.0, fit(0.0)), (2.0, fit(0.3))], gamma_sweep=[(1.0, fit(0.0)), (2.0, fit(0.01))]),
        "nan": dict(no_residual=pe.DecayFit(math.nan, (math.nan, math.nan), math.nan, math.nan, math.nan, 1)),
    }.items():
        heads[name] = _verdicts(dataclasses.replace(rep, **changes))
    assert "CONSISTENT" in heads["match"][0] and "INCONCLUSIVE" not in heads["match"][0]
    assert "CONTRADICTED" in heads["miss"][0]
    assert heads["wide"][0].startswith("(1) spectra: INCONCLUSIVE (the rate's 95 % interval is +-0.50 wide)")
    assert heads["short"][0].startswith("(1) spectra: INCONCLUSIVE")
    assert "CHANGES THE RATE" in heads["res_sep"][1] and "NO MEASURABLE EFFECT" in heads["res_same"][1]
    assert "CHANGES THE RATE" in heads["eps"][2] and "NO MEASURABLE EFFECT" in heads["eps"][3]
    assert heads["nan"][1].startswith("(2) residual: INCONCLUSIVE")
    assert "gain along v" in heads["match"][0] and "sigma_max" in heads["match"][0]


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


def test_cli_missing_model_library_is_one_line(monkeypatch, capsys):
    import pyengine.cli.recovery as cli

    def missing(name, seed=0):
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
    """progress rises from 0 to 1 through the six stages; on_stage gets each one's record as it
    finishes; the propagations equal pyengine.propagate with the unit directions recovery made."""
    st = _stack(dtype=np.float32)
    calls, records = [], []
    D = np.random.default_rng(5).standard_normal((2, 16)) * [[1e-3], [40.0]]
    r = recovery(st, ids=np.arange(3, 15), layer=1, directions=D, scales=(0.5, 2.0), eps_values=[1e-5],
                 gamma_values=[1.0], progress=lambda f, s: calls.append((f, s)),
                 on_stage=lambda s, rec: records.append((s, rec)))
    names = ["exact propagation", "linearized propagation", "block Jacobian spectra", "ablation: no residual",
             "sweep: norm eps", "sweep: gamma scale"]
    assert [s for s, _ in records] == names and list(r.seconds) == names + ["total"]
    assert [s for s in dict.fromkeys(s for _, s in calls)] == names + ["done"]
    fracs = [f for f, _ in calls]
    assert fracs[0] == 0.0 and fracs[-1] == 1.0 and all(a <= b for a, b in zip(fracs, fracs[1:]))
    last = {s: f for f, s in calls}  # the work of a stage with progress ends at its share
    assert last["exact propagation"] == pytest.approx(0.35) and last["block Jacobian spectra"] == pytest.approx(0.7)
    assert all(rec["stage"] == s and rec["seconds"] >= 0 for s, rec in records)
    assert records[0][1]["propagation"]["cosine"] == r.exact.to_dict()["cosine"]
    assert records[2][1]["blocks"] == [2, 3, 4] and records[4][1]["sweep"][0]["eps"] == 1e-5
    unit = D / np.linalg.norm(D, axis=1)[:, None]  # to rounding: recovery's own unit rows
    again = pe.propagate(st, np.arange(3, 15), pe._validate.unit_rows("d", D, 16), r.exact.scales, 1,
                         dtype=np.float32)
    np.testing.assert_array_equal(again.directions, r.exact.directions)
    np.testing.assert_array_equal(again.projection, r.exact.projection)
    np.testing.assert_allclose(r.exact.directions, unit, rtol=1e-15)
