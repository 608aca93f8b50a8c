"""The descent part of the stability report: each update rule against a direct NumPy step, the
steepest-descent runs against the original loop, σ_max against numpy.linalg.norm(., 2), and every
branch of the verdict and of the printed finding on constructed data."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pyengine.experiments.stability_descent import (BOUND, Descent, descent_demo, descent_finding, format_descent,
                                                    plot_descent, sigma_verdict, training_step)
from pyengine.linalg.steepest import steepest_descent


def _pair(seed=0, shape=(6, 9)):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape)


def test_normalized_step_has_norm_eta():
    w, g = _pair()
    for eta in (0.01, 0.5, 3.0):
        new = training_step(w, g, "normalized", eta)
        np.testing.assert_allclose(new, w - eta * g / np.sqrt(np.sum(g * g)), rtol=1e-14, atol=1e-15)
        assert np.linalg.norm(new - w) == pytest.approx(eta, rel=1e-12)
    np.testing.assert_array_equal(training_step(w, np.zeros_like(g), "normalized", 0.3), w)  # no direction: no step


def test_clipping_caps_the_step_at_eta_c_and_leaves_small_gradients_alone():
    w, g = _pair(1)
    gn = np.sqrt(np.sum(g * g))
    eta = 0.2
    big = training_step(w, g, "clipped", eta, clip=0.5 * gn)  # active: the step is eta c exactly
    np.testing.assert_allclose(big, w - eta * g * (0.5 * gn / gn), rtol=1e-14)
    assert np.linalg.norm(big - w) == pytest.approx(eta * 0.5 * gn, rel=1e-12)
    small = training_step(w, g, "clipped", eta, clip=2 * gn)  # inactive: plain GD
    np.testing.assert_array_equal(small, w - eta * g)
    np.testing.assert_array_equal(small, training_step(w, g, "plain", eta))


def test_decoupled_decay_shrinks_w_by_one_minus_eta_lambda_before_the_gradient_step():
    w, g = _pair(2)
    eta, lam = 0.3, 0.1
    np.testing.assert_allclose(training_step(w, g, "weight_decay", eta, weight_decay=lam),
                               (1 - eta * lam) * w - eta * g, rtol=1e-14)
    np.testing.assert_allclose(training_step(w, np.zeros_like(g), "weight_decay", eta, weight_decay=lam),
                               0.97 * w, rtol=1e-15)  # no gradient: the shrink alone
    np.testing.assert_array_equal(training_step(w, g, "weight_decay", eta, weight_decay=0.0), w - eta * g)


def test_rules_do_not_modify_inputs_and_reject_bad_arguments():
    w, g = _pair(3)
    w0, g0 = w.copy(), g.copy()
    for m in ("plain", "normalized", "clipped", "weight_decay"):
        training_step(w, g, m, 0.1)
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(g, g0)
    with pytest.raises(ValueError, match="method"):
        training_step(w, g, "adam", 0.1)
    with pytest.raises(ValueError, match="lr"):
        training_step(w, g, "plain", -0.1)
    with pytest.raises(ValueError, match="clip"):
        training_step(w, g, "clipped", 0.1, clip=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        training_step(w, g, "weight_decay", 0.1, weight_decay=-1.0)
    with pytest.raises(ValueError, match="train_lrs"):
        descent_demo(5, 4, 6, train_lrs=())
    with pytest.raises(ValueError, match="lrs"):
        descent_demo(5, 4, 6, lrs=(0.1, -1.0))
    with pytest.raises(ValueError, match="steps"):
        descent_demo(0)


def _task(steps, d_out, d_in, seed):
    rng = np.random.default_rng(seed)
    w_star = rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)
    q, _ = np.linalg.qr(rng.standard_normal((d_in, d_in)))
    c_half = (q * np.logspace(-1, 0, d_in)) @ q.T
    return w_star, c_half, 0.5 * np.sum((w_star @ c_half) ** 2)


def test_steepest_methods_are_the_original_loop_bit_for_bit():
    """gd, sign and spectral: the loop the report ran before the training-time rules joined it."""
    steps, d_out, d_in, lrs = 30, 8, 12, (0.01, 0.1, 0.3)
    d = descent_demo(steps, d_out, d_in, seed=4, lrs=lrs)
    w_star, c_half, scale = _task(steps, d_out, d_in, 4)
    for name, which in (("gd", "l2"), ("sign", "linf"), ("spectral", "spectral")):
        best = None
        for lr in lrs:
            w = np.zeros_like(w_star)
            curve = []
            for k in range(steps):
                r = (w - w_star) @ c_half
                curve.append(0.5 * np.sum(r * r) / scale)
                t = steepest_descent(r @ c_half.T, which, 1.0)
                t *= np.sqrt(min(d_out, d_in)) / max(np.linalg.norm(t), 1e-300)
                w = w + lr * (1 - k / steps) * t
            if best is None or curve[-1] < best[-1]:
                best = curve
        np.testing.assert_array_equal(d.losses[name], np.array(best))
        assert d.grids[name] == lrs


@pytest.mark.parametrize("method", ["plain", "normalized", "clipped", "weight_decay"])
def test_training_runs_and_sigma_series_against_a_direct_computation(method):
    steps, d_out, d_in, lrs = 25, 6, 10, (0.1, 1.0, 3.0)
    d = descent_demo(steps, d_out, d_in, seed=1, lrs=(0.1,), train_lrs=lrs, clip=0.5, weight_decay=0.2)
    w_star, c_half, scale = _task(steps, d_out, d_in, 1)
    finals, peaks = {}, {}
    for lr in lrs:
        w, loss, sig = np.zeros_like(w_star), [], []
        for k in range(steps):
            r = (w - w_star) @ c_half
            loss.append(0.5 * np.sum(r * r) / scale)
            sig.append(np.linalg.norm(w, 2))
            g, eta = r @ c_half.T, lr * (1 - k / steps)
            gn = np.sqrt(np.sum(g * g))
            if method == "plain":
                w = w - eta * g
            elif method == "normalized":
                w = w - eta * g / gn
            elif method == "clipped":
                w = w - eta * min(1.0, 0.5 / gn) * g
            else:
                w = w - eta * 0.2 * w - eta * g
            if lr == d.lr[method]:
                kept = (loss, sig)
        finals[lr], peaks[lr] = loss[-1], max(sig)
    assert d.lr[method] == min(lrs, key=lambda lr: finals[lr])
    np.testing.assert_allclose(d.losses[method], kept[0], rtol=1e-9)
    np.testing.assert_allclose(d.sigma[method], kept[1], rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(d.rms_to_rms(method), np.sqrt(d_in / d_out) * np.array(kept[1]), rtol=1e-9)
    for lr in lrs:
        assert d.peaks[method][lr] == pytest.approx(peaks[lr], rel=1e-9)
    assert d.target == pytest.approx(np.linalg.norm(w_star, 2), rel=1e-15)
    assert d.sigma[method][0] == 0.0  # W_0 = 0


def test_sigma_verdict_branches():
    assert sigma_verdict({0.1: 1.0, 1.0: 2.0}, 1.0) == ("bounded", None)  # at the bound: still bounded
    assert sigma_verdict({3.0: 50.0, 1.0: 2.5, 0.1: 1.0}, 1.0) == ("unbounded", 1.0)  # the first lr past it
    assert sigma_verdict({0.1: 1.0, 1.0: 5.0, 3.0: math.inf}, 1.0) == ("diverged", 3.0)
    assert sigma_verdict({0.1: math.nan}, 1.0) == ("diverged", 0.1)
    assert sigma_verdict({0.1: 3.0}, 1.0, bound=4.0) == ("bounded", None)


def _constructed(peaks, sigma_end, losses, sigma_peak=None):
    """A Descent with the given per-method grid peaks, last sigma_max, last loss (target 1, 4 steps)."""
    ms = list(peaks)
    sig = {m: np.array([0.0, 0.5, sigma_peak.get(m, sigma_end[m]) if sigma_peak else sigma_end[m], sigma_end[m]])
           for m in ms}
    loss = {m: np.array([1.0, 0.5, 0.2, losses[m]]) for m in ms}
    return Descent(loss, sig, peaks, {m: 0.1 for m in ms}, {m: tuple(peaks[m]) for m in ms}, 1.0, 4, 8, 0)


def test_finding_all_bounded():
    d = _constructed({"a": {0.1: 1.0}, "b": {0.1: 1.9}}, {"a": 1.0, "b": 0.95}, {"a": 1e-3, "b": 1e-5})
    lines = descent_finding(d)
    assert lines[0].startswith("sigma_max bounded") and lines[0].endswith("a, b")
    assert lines[1] == "no method's sigma_max leaves the bound on its grid"
    assert lines[2].startswith("lowest final loss: b 1e-05 (lr 0.1); a 0.001")
    assert len(lines) == 3


def test_finding_unbounded_diverged_excursion_and_shrunk():
    d = _constructed({"a": {0.1: 1.0, 1.0: 3.0}, "b": {0.1: 1.0, 1.0: math.inf}, "c": {0.1: 1.5}},
                     {"a": 1.0, "b": 0.99, "c": 0.5}, {"a": 1e-4, "b": 1e-3, "c": 0.07}, sigma_peak={"a": 2.5})
    lines = descent_finding(d)
    assert lines[0].endswith(": c")
    assert "a unbounded from lr 1 (peak 3 sigma_max(W*))" in lines[1] and "b diverged from lr 1" in lines[1]
    assert "past the bound" in lines[2] and "a (lr 0.1, peak 2.5)" in lines[2] and "b (" not in lines[2]
    assert lines[3].startswith("end below sigma_max(W*) by more than 10%") and "c (0.5, loss 0.07)" in lines[3]
    assert lines[4].startswith("lowest final loss: a")


def test_finding_no_bounded_method_and_no_finite_loss():
    d = _constructed({"a": {0.1: 9.0}}, {"a": 1.0}, {"a": math.nan})
    lines = descent_finding(d)
    assert lines[0].startswith("sigma_max not bounded: a unbounded from lr 0.1")
    assert lines[-1] == "no method ends with a finite loss"
    doc = d.to_dict()
    json.dumps(doc, allow_nan=False)  # strict JSON: NaN written as null
    assert doc["descent"]["a"][-1] is None


def test_default_finding_and_json_keys():
    d = descent_demo()
    doc = d.to_dict()
    assert set(doc) == {"descent", "descent_sigma", "descent_methods", "descent_finding"}
    assert list(doc["descent"]) == ["gd", "sign", "spectral", "plain", "normalized", "clipped", "weight_decay"]
    s = doc["descent_sigma"]["clipped"]
    assert s["steps"] == list(range(100)) and set(s["weights"]["W"]) == {"sigma_max", "rms_to_rms"}
    np.testing.assert_allclose(s["weights"]["W"]["rms_to_rms"], np.sqrt(2) * np.array(s["weights"]["W"]["sigma_max"]))
    h = doc["descent_methods"]
    assert h["clipped"]["clip"] == 1.0 and h["weight_decay"]["decay"] == "decoupled"
    assert h["weight_decay"]["weight_decay"] == 0.1 and h["normalized"]["lr_grid"][-1] == 3.0
    f = doc["descent_finding"]
    assert f["lines"] == descent_finding(d) and f["protocol"].startswith("protocol: population loss")
    assert f["bound"] == BOUND and f["methods"]["clipped"]["verdict"] in ("bounded", "unbounded", "diverged")
    text = "\n".join(format_descent(d))
    assert "Finding:" in text and "weight_decay" in text and d.protocol() in text


@pytest.mark.parametrize("fmt", ["svg", "pdf"])
def test_descent_figures_in_each_format(tmp_path, fmt):
    from pyengine._figures import style

    wide = _constructed({"a": {0.1: 1e4}}, {"a": 1.0}, {"a": 1e-3}, sigma_peak={"a": 1e4})
    with style():
        paths = plot_descent(wide, str(tmp_path), fmt)
    assert [p.rsplit("/", 1)[-1] for p in paths] == [f"descent.{fmt}", f"descent_sigma.{fmt}"]
    assert all((tmp_path / f"{n}.{fmt}").stat().st_size > 0 for n in ("descent", "descent_sigma"))


def test_sigma_axis_is_log_only_when_it_spans_decades(tmp_path, monkeypatch):
    from pyengine.experiments import stability_descent as sd

    scales = []
    monkeypatch.setattr("pyengine._figures.save", lambda fig, path, fmt: scales.append(fig.axes[0].get_yscale())
                        or path)
    narrow = _constructed({"a": {0.1: 1.5}}, {"a": 1.0}, {"a": 1e-3}, sigma_peak={"a": 1.5})
    wide = _constructed({"a": {0.1: 1e4}}, {"a": 1.0}, {"a": 1e-3}, sigma_peak={"a": 1e4})
    sd.plot_descent(narrow, str(tmp_path))
    sd.plot_descent(wide, str(tmp_path))
    assert scales == ["log", "linear", "log", "log"]  # (loss, sigma) per call


def test_cli_writes_the_sigma_figure_and_keys(tmp_path, capsys):
    from pyengine.cli import main

    assert main(["stability", "--depth", "2", "--width", "16", "--tokens", "4", "--schemes", "kaiming_normal",
                 "--no-stacks", "--model", "none", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Training-time stability" in out and "Finding:" in out and "lowest final loss" in out
    assert (tmp_path / "descent_sigma.png").exists() and (tmp_path / "descent.png").exists()
    doc = json.loads((tmp_path / "stability.json").read_text())
    assert {"descent_sigma", "descent_methods", "descent_finding", "provenance"} <= set(doc)
    stage = json.loads((tmp_path / "stages" / "02-descent-demo.json").read_text())
    assert stage["descent_finding"]["lines"] == doc["descent_finding"]["lines"]
