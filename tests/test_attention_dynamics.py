"""The attention-dynamics experiment: the chain and its Bayes floor, the training gradient
against central differences, the M-step, the report and the CLI (small T, few steps)."""

from __future__ import annotations

import importlib
import json
import math
import os

import numpy as np
import pytest

from pyengine import cli
from pyengine.experiments import attention_dynamics, format_attention_table, write_attention_report
from pyengine.experiments.attention_dynamics import (
    HELDOUT_OFFSET,
    M_STEP_RIDGE,
    VALIDATION_OFFSET,
    EvalSet,
    Evaluator,
    Model,
    bayes_entropy,
    init_params,
    m_step,
    make_data,
    markov_chain,
    stationary,
    value_hessian,
)


def test_chain_construction_and_effective_stay():
    P = markov_chain(8, 0.3)
    np.testing.assert_allclose(P.sum(axis=1), 1.0, rtol=0, atol=1e-15)
    # row 0 by hand: weights stay, 1/d off the diagonal; normalize, * (1 - stay), + stay on the diagonal
    d = np.array([0, 1, 2, 3, 4, 3, 2, 1], float)
    w = np.where(d == 0, 0.3, 1 / np.maximum(d, 1))
    row = w / w.sum() * 0.7 + 0.3 * (d == 0)
    np.testing.assert_allclose(P[0], row / row.sum(), rtol=1e-15)
    assert abs(P[0, 0] - 0.35) < 0.001  # the "about 0.35" of the protocol


def test_bayes_floor_is_the_direct_computation():
    P = markov_chain(8, 0.3)
    pi = stationary(P)
    np.testing.assert_allclose(pi @ P, pi, atol=1e-14)
    direct = -sum(pi[i] * sum(P[i, j] * math.log(P[i, j]) for j in range(8)) for i in range(8))
    assert abs(bayes_entropy(P) - direct) < 1e-13
    # and the empirical conditional entropy of a long path agrees
    rng = np.random.default_rng(0)
    _, y = make_data(P, 200_000, np.zeros((8, 2)), rng)
    counts = np.zeros((8, 8))
    np.add.at(counts, (y[:-1], y[1:]), 1)
    emp = counts / counts.sum(axis=1, keepdims=True)
    h = -(counts.sum(axis=1) / counts.sum() * (emp * np.log(emp)).sum(axis=1)).sum()
    assert abs(h - direct) < 0.01


def _model(T=24, seed=3):
    P = markov_chain(8, 0.3)
    mu = np.random.default_rng(0).standard_normal((8, 20))
    rng = np.random.default_rng(seed)
    X, y = make_data(P, T, mu, rng)
    W = init_params(rng, 8, "float64")
    W = {k: 3 * v for k, v in W.items()}  # away from the near-uniform start: larger gradients
    return Model(X, y, 8), W


@pytest.mark.parametrize("want_z", [False, True], ids=["values", "via_z"])
def test_training_gradient_is_the_central_difference(backend, want_z):
    model, W = _model()
    model = Model(model.X, model.y, 8, backend)
    _, grads, _ = model.step(W, want_z=want_z)
    h = 1e-6
    for name in W:
        fd = np.zeros_like(W[name])
        for idx in np.ndindex(*W[name].shape):
            plus = {k: v.copy() for k, v in W.items()}
            minus = {k: v.copy() for k, v in W.items()}
            plus[name][idx] += h
            minus[name][idx] -= h
            fd[idx] = (model.step(plus)[0]["loss"] - model.step(minus)[0]["loss"]) / (2 * h)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-6, atol=1e-9, err_msg=name)


def test_m_step_lowers_the_loss_with_routing_fixed():
    model, W = _model(T=64)
    for _ in range(3):
        metrics, _, Z = model.step(W, want_z=True)
        new_v, taken, before, after = m_step(model, W, 1e-3, Z)
        assert taken and after < before
        assert abs(before - metrics["loss"]) < 1e-12
        W = dict(W, W_V=new_v)
        assert abs(model.step(W)[0]["loss"] - after) < 1e-12  # the same loss, recomputed


def test_value_hessian_is_the_dense_kron_formula():
    """value_hessian (syrk and two contractions) against (1/T) sum_t kron(z z^T, Wo (diag p - p p^T) Wo^T)."""
    rng = np.random.default_rng(3)
    T, dz, dv, n = 50, 20, 15, 8
    Z, Wo = rng.standard_normal((T, dz)), rng.standard_normal((dv, n))
    p = np.exp(rng.standard_normal((T, n)))
    p /= p.sum(1, keepdims=True)
    dense = sum(np.kron(np.outer(z, z), Wo @ (np.diag(q) - np.outer(q, q)) @ Wo.T) for z, q in zip(Z, p)) / T
    H = value_hessian(Z, p, Wo)
    np.testing.assert_allclose(H, dense, rtol=1e-12, atol=1e-13 * np.abs(dense).max())
    np.testing.assert_array_equal(H, H.T)  # exactly symmetric


def test_m_step_gradient_matches_the_training_gradient():
    """The Newton step's gradient g is the training gradient of W_V (same model, same point)."""
    model, W = _model(T=32)
    _, grads, Z = model.step(W, want_z=True)
    assert Z.shape == (32, 20)
    # direct: dL/dW_V = Z^T (p - Y) W_O^T / T
    logits = Z @ W["W_V"] @ W["W_O"]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    direct = Z.T @ ((p - model.Y) @ W["W_O"].T) / model.T
    np.testing.assert_allclose(grads["W_V"], direct, rtol=1e-10, atol=1e-14)


@pytest.fixture(scope="module")
def small_report():
    return attention_dynamics(seeds=(1, 2), steps=12, T=80, dtype="float64")  # exact comparisons below


def test_float32_default_agrees_with_float64():
    """The default dtype is float32: its losses match float64's at every step (measured: 3e-8 here,
    <= 3e-8 on the final losses at T = 2000 after 1000 steps; the experiment's claims need ~1e-4).
    T = 400, not less: with T = 80 < 300 parameters of W_V the Newton step overshoots (losses up to
    5) and amplifies rounding."""
    runs = [attention_dynamics(seeds=(1,), steps=12, T=400, dtype=d) for d in ("float32", "float64")]
    assert attention_dynamics.__kwdefaults__["dtype"] == "float32"
    for arm in runs[0].arms:
        np.testing.assert_allclose(runs[0].metrics[arm]["loss"], runs[1].metrics[arm]["loss"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(runs[0].curves[arm]["heldout_loss"], runs[1].curves[arm]["heldout_loss"], rtol=0,
                                   atol=1e-5)


def test_report_has_every_metric_and_the_paired_comparison(small_report, tmp_path):
    rep = small_report
    assert rep.arms == ("gd", "value_lr", "m_step") and rep.seeds == (1, 2)
    for arm in rep.arms:
        for m in ("loss", "accuracy", "pred_entropy", "attn_entropy", "adv_spread", "key_orth"):
            a = rep.metrics[arm][m]
            assert a.shape == (2, 13) and np.isfinite(a).all()
        assert rep.value_pca[arm].shape == (2, 2)
        assert rep.curves[arm]["heldout_loss"].shape == (2, 12) and rep.curves[arm]["heldout_each"].shape == (2, 12, 4)
        assert all(rep.changes[arm][k].shape == (2, 12) for k in ("routing_move", "value_move", "routing_change"))
    assert rep.schedule.tolist() == list(range(11)) + [12]
    # same initialization and data for every arm of a seed: the same step-0 metrics (m_step forms
    # O as Z W_V instead of attending over X W_V: equal up to rounding)
    np.testing.assert_array_equal(rep.metrics["gd"]["loss"][:, 0], rep.metrics["value_lr"]["loss"][:, 0])
    np.testing.assert_allclose(rep.metrics["gd"]["loss"][:, 0], rep.metrics["m_step"]["loss"][:, 0], rtol=1e-13)
    assert (rep.steps_to_gd_final("gd") <= 12).all()
    pair = rep.paired("m_step")
    assert pair["n"] == 2 and math.isfinite(pair["heldout"]["mean"])
    text = format_attention_table(rep)
    assert "Bayes floor" in text and "m_step" in text and text.splitlines()[-1].startswith("verdict: ")
    assert "300 parameters" in text and "T = 80 tokens" in text
    assert f"m_step ridge {M_STEP_RIDGE:g}: the default, chosen on the validation" in text
    paths = write_attention_report(rep, str(tmp_path), plots=True)
    assert {os.path.basename(p) for p in paths} == {"attention.json", "attention.csv", "attention_loss.png",
                                                    "attention_heatmaps.png", "attention_value_pca.png"}
    data = json.loads((tmp_path / "attention.json").read_text())
    assert abs(data["bayes_entropy"] - rep.bayes_entropy) < 1e-12
    for arm in rep.arms:
        assert data["final"][arm]["heldout_loss"] == rep.final(arm).tolist()
        assert data["final"][arm]["train_loss"] == rep.metrics[arm]["loss"][:, -1].tolist()
        assert data["curves"][arm]["steps"] == rep.schedule.tolist()
        assert data["curves"][arm]["heldout_loss"] == rep.curves[arm]["heldout_loss"].tolist()
        assert data["curves"][arm]["train_loss"] == rep.metrics[arm]["loss"][:, rep.schedule].tolist()
    assert data["verdict"] == text.splitlines()[-1]
    lines = (tmp_path / "attention.csv").read_text().splitlines()
    assert len(lines) == 1 + 3 * 2 * 13


def test_cli_runs_and_rejects_bad_arguments(tmp_path, capsys):
    rc = cli.main(["attention", "--steps", "3", "--seeds", "5", "--T", "40", "--out", str(tmp_path),
                   "--no-plots", "--progress", "never"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Bayes floor" in out and (tmp_path / "attention.json").exists()
    with pytest.raises(SystemExit) as exc:
        cli.main(["attention", "--arms", "value_lr"])  # gd is required
    assert exc.value.code == 2
    assert "including gd" in capsys.readouterr().err
    assert cli.main(["attention", "--steps", "1", "--T", "1", "--progress", "never", "--no-plots",
                     "--out", str(tmp_path)]) == 2
    assert "T >= 2" in capsys.readouterr().err


def test_interrupt_keeps_the_finished_seeds(monkeypatch):
    ad = importlib.import_module("pyengine.experiments.attention_dynamics")  # the module, not the function
    real_run_arm = ad.run_arm
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:  # Ctrl-C during the second seed's first arm
            raise KeyboardInterrupt
        return real_run_arm(*args, **kwargs)

    monkeypatch.setattr(ad, "run_arm", flaky)
    rep = ad.attention_dynamics(seeds=(1, 2), steps=3, T=30)
    assert rep.interrupted and rep.seeds == (1,)
    assert rep.metrics["gd"]["loss"].shape == (1, 4)


def test_worker_processes_give_the_serial_report_exactly():
    """Seeds in 2 spawned single-threaded workers: every metric, PCA, heat map and skip count bit-for-bit
    the serial run's, the seeds in their given order, progress reaching 1."""
    kw = dict(seeds=(9999, 42, 7), steps=12, T=120)  # 9 (seed, arm) tasks
    serial = attention_dynamics(**kw)
    ticks = []
    par = attention_dynamics(**kw, workers=2, progress=lambda frac, label: ticks.append(frac))
    assert par.seeds == serial.seeds == (9999, 42, 7) and not par.interrupted
    for arm in serial.arms:
        for m in serial.metrics[arm]:
            np.testing.assert_array_equal(par.metrics[arm][m], serial.metrics[arm][m])
        np.testing.assert_array_equal(par.value_pca[arm], serial.value_pca[arm])
        for d in (par.curves, par.changes):
            for k, v in d[arm].items():
                np.testing.assert_array_equal(v, (serial.curves if d is par.curves else serial.changes)[arm][k])
        for step, h in serial.heatmaps[arm].items():
            np.testing.assert_array_equal(par.heatmaps[arm][step], h)
    np.testing.assert_array_equal(par.m_step_skipped, serial.m_step_skipped)
    assert ticks and ticks[-1] == 1.0 and par.config["workers"] == 2
    with pytest.raises(ValueError, match="workers"):
        attention_dynamics(seeds=(1,), steps=1, T=10, workers=0)


def test_cli_workers_flag(tmp_path, capsys):
    assert cli.main(["attention", "--steps", "2", "--seeds", "5,6", "--T", "30", "--workers", "2",
                     "--out", str(tmp_path), "--no-plots", "--progress", "never"]) == 0
    assert "2 worker(s)" in capsys.readouterr().out


def test_evaluator_is_the_training_forward_on_each_sequence(backend):
    P, mu = markov_chain(8, 0.3), np.random.default_rng(0).standard_normal((8, 20))
    seqs = [make_data(P, 37, mu, np.random.default_rng(s)) for s in (1, 2, 3)]
    W = {k: 3 * v for k, v in init_params(np.random.default_rng(4), 8, "float64").items()}
    ev = Evaluator(np.stack([x for x, _ in seqs]), np.stack([y for _, y in seqs]), 8, backend)
    want = [Model(x, y, 8, backend).step(W)[0]["loss"] for x, y in seqs]
    np.testing.assert_allclose(ev.losses(W), want, rtol=1e-12)
    with pytest.raises(ValueError, match="X must be"):
        Evaluator(seqs[0][0], seqs[0][1], 8)


def test_heldout_and_validation_sequences_are_fresh_draws_of_the_same_chain():
    P, mu = markov_chain(8, 0.3), np.random.default_rng(0).standard_normal((8, 20))
    ev = EvalSet(7, P, 50, mu, 3, "float64", "auto")
    assert ev.X.shape == (4, 50, 20)
    for i, s in enumerate([7 + HELDOUT_OFFSET, 7 + HELDOUT_OFFSET + 1, 7 + HELDOUT_OFFSET + 2, 7 + VALIDATION_OFFSET]):
        X, y = make_data(P, 50, mu, np.random.default_rng(s))
        np.testing.assert_array_equal(ev.X[i], X)
        np.testing.assert_array_equal(ev.evaluator.y[i], y)
    train, _ = make_data(P, 50, mu, np.random.default_rng(7))
    assert not any(np.array_equal(train, x) for x in ev.X)


def test_heldout_losses_stay_above_the_floor_while_the_m_step_fits_the_sample():
    """Reduced configuration (T = 300 < W_V's 300 parameters, no ridge): the M-step drives the training
    loss below the Bayes floor, but no arm's held-out loss goes below the floor minus its sampling error
    (the standard error over the held-out sequences) at any evaluated step."""
    rep = attention_dynamics(seeds=(1, 2), steps=15, T=300, m_step_ridge=0.0, eval_every=5)
    floor = rep.bayes_entropy
    assert (rep.below_floor("m_step") < floor).all()  # the sample is fitted
    for arm in rep.arms:
        each = rep.curves[arm]["heldout_each"]
        se = each.std(axis=2, ddof=1) / math.sqrt(each.shape[2])
        assert (rep.curves[arm]["heldout_loss"] >= floor - se).all(), arm
    assert "FLAG m_step" in format_attention_table(rep)


def test_m_step_with_ridge_reaches_the_penalized_minimizer():
    """Iterated with routing and W_O fixed, the ridge M-step converges to the minimizer of mean CE +
    ridge / 2 |W_V|^2, found independently by L-BFGS on a torch-autograd objective."""
    import torch
    from scipy.optimize import minimize

    model, W = _model(T=64)
    ridge = 0.05
    Z = model.attend(W, V=model.X)[3].copy()
    for _ in range(30):
        new_v, taken, before, after = m_step(model, W, 1e-3, Z, ridge=ridge)
        assert after <= before
        W = dict(W, W_V=new_v)
    Zt, Wo, y = torch.from_numpy(Z), torch.from_numpy(W["W_O"]), torch.from_numpy(model.y)

    def f(v):
        wv = torch.tensor(v.reshape(20, 15), requires_grad=True)
        loss = torch.nn.functional.cross_entropy(Zt @ wv @ Wo, y) + 0.5 * ridge * (wv ** 2).sum()
        loss.backward()
        return loss.item(), wv.grad.numpy().ravel().copy()

    res = minimize(f, np.zeros(300), jac=True, method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 1e-15})
    assert abs(f(W["W_V"].ravel())[0] - res.fun) < 1e-10
    np.testing.assert_allclose(W["W_V"].ravel(), res.x, atol=1e-5)
    assert np.linalg.norm(f(W["W_V"].ravel())[1]) < 1e-9


def test_cli_toy_preset_and_ridge_flag(tmp_path, capsys):
    assert cli.main(["attention", "--preset", "toy", "--seeds", "5", "--T", "24", "--arms", "gd,m_step",
                     "--m-step-ridge", "0.1", "--out", str(tmp_path), "--no-plots", "--progress", "never"]) == 0
    assert "(toy)" in capsys.readouterr().out
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["config"]["steps"] == 100 and data["config"]["m_step_ridge"] == 0.1
    assert data["curves"]["gd"]["steps"] == list(range(101))
    with pytest.raises(SystemExit):
        cli.main(["attention", "--m-step-ridge", "-1"])
    assert "must be a number >= 0" in capsys.readouterr().err


def test_step_zero_analyses_are_the_direct_computations():
    """Key orthogonality, the value manifold and the first routing / value moves of the gd arm at step 0,
    recomputed from the seed's data and initial weights with plain NumPy loops and eigh."""
    rep = attention_dynamics(seeds=(3,), arms=("gd",), steps=2, T=60, n_heldout=2, dtype="float64")
    P, mu = markov_chain(8, 0.3), np.random.default_rng(0).standard_normal((8, 20))
    rng = np.random.default_rng(3)
    X, y = make_data(P, 60, mu, rng)
    W = init_params(rng, 8, "float64")
    K = mu @ W["W_K"]
    cos = [abs(K[a] @ K[b]) / np.linalg.norm(K[a]) / np.linalg.norm(K[b]) for a in range(8) for b in range(8) if a != b]
    assert abs(rep.metrics["gd"]["key_orth"][0, 0] - np.mean(cos)) < 1e-14
    Xh, _ = make_data(P, 60, mu, np.random.default_rng(3 + HELDOUT_OFFSET))
    V = Xh @ W["W_V"]
    lik = np.exp(-0.5 * ((Xh[:, None, :] - mu[None]) ** 2).sum(axis=2)) * stationary(P)
    post = lik / lik.sum(axis=1, keepdims=True)
    h = -(post * np.log(post)).sum(axis=1)
    evals, evecs = np.linalg.eigh(np.cov(V.T))
    score = (V - V.mean(axis=0)) @ evecs[:, -1]
    assert abs(rep.curves["gd"]["value_pc1"][0, 0] - evals[-1] / evals.sum()) < 1e-12
    assert abs(rep.curves["gd"]["value_rho"][0, 0] - abs(np.corrcoef(score, h)[0, 1])) < 1e-10
    _, g, _ = Model(X, y, 8).step(W)
    R0, R1 = W["W_Q"] @ W["W_K"].T, (W["W_Q"] - 0.01 * g["W_Q"]) @ (W["W_K"] - 0.01 * g["W_K"]).T
    assert abs(rep.changes["gd"]["routing_move"][0, 0] - np.linalg.norm(R1 - R0)) < 1e-14
    assert abs(rep.changes["gd"]["value_change"][0, 0] - 0.01 * np.linalg.norm(g["W_V"]) / np.linalg.norm(W["W_V"])) < 1e-14
