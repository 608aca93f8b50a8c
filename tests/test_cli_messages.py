"""Bad arguments of the ``pyengine`` command: one line on stderr naming the argument (or the
file and field), exit status 2, no traceback, and, for the checks made before any work, a
quick exit that writes nothing. Also the same messages from the library (config fields of a
model folder, a weights file lacking a tensor, an intervention returning NaN)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyengine as pe
from pyengine.cli import main
from pyengine.models.interventions import Intervention

# --------------------------------------------------------------------------- tiny model folders


def _gpt2(d=8, n=16, V=300, P=16):
    r = np.random.default_rng(0)
    t = {"wte.weight": (V, d), "wpe.weight": (P, d), "ln_f.weight": (d,), "ln_f.bias": (d,),
         "h.0.ln_1.weight": (d,), "h.0.ln_1.bias": (d,), "h.0.ln_2.weight": (d,), "h.0.ln_2.bias": (d,),
         "h.0.attn.c_attn.weight": (d, 3 * d), "h.0.attn.c_attn.bias": (3 * d,),
         "h.0.attn.c_proj.weight": (d, d), "h.0.attn.c_proj.bias": (d,),
         "h.0.mlp.c_fc.weight": (d, n), "h.0.mlp.c_fc.bias": (n,),
         "h.0.mlp.c_proj.weight": (n, d), "h.0.mlp.c_proj.bias": (d,)}
    cfg = {"model_type": "gpt2", "n_embd": d, "n_head": 2, "n_layer": 1, "n_positions": P, "vocab_size": V,
           "n_inner": n}
    return cfg, {k: (0.1 * r.standard_normal(s)).astype(np.float32) for k, s in t.items()}


def _neox(d=8, n=16, V=300, P=16):
    r = np.random.default_rng(0)
    p = "gpt_neox."
    t = {p + "embed_in.weight": (V, d), p + "final_layer_norm.weight": (d,), p + "final_layer_norm.bias": (d,),
         "embed_out.weight": (V, d)}
    for name, shape in (("input_layernorm.weight", (d,)), ("input_layernorm.bias", (d,)),
                        ("post_attention_layernorm.weight", (d,)), ("post_attention_layernorm.bias", (d,)),
                        ("attention.query_key_value.weight", (3 * d, d)), ("attention.query_key_value.bias", (3 * d,)),
                        ("attention.dense.weight", (d, d)), ("attention.dense.bias", (d,)),
                        ("mlp.dense_h_to_4h.weight", (n, d)), ("mlp.dense_h_to_4h.bias", (n,)),
                        ("mlp.dense_4h_to_h.weight", (d, n)), ("mlp.dense_4h_to_h.bias", (d,))):
        t[p + "layers.0." + name] = shape
    cfg = {"model_type": "gpt_neox", "hidden_size": d, "num_attention_heads": 2, "num_hidden_layers": 1,
           "intermediate_size": n, "vocab_size": V, "max_position_embeddings": P, "rotary_pct": 0.5}
    return cfg, {k: (0.1 * r.standard_normal(s)).astype(np.float32) for k, s in t.items()}


def _folder(path, family, cfg_edit=None, drop=None):
    st = pytest.importorskip("safetensors.numpy")
    cfg, tensors = family()
    cfg.update(cfg_edit or {})
    if drop:
        tensors.pop(drop)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    st.save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("family", [_gpt2, _neox])
def test_the_tiny_folders_load(tmp_path, family):
    """The folders the cases below damage load when undamaged."""
    model = pe.load_pretrained(_folder(tmp_path / "m", family))
    assert model.config.d_model == 8


# --------------------------------------------------------------------------- the command

@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = pe.StackConfig(d_model=16, n_heads=2, n_layers=2, d_mlp=32, vocab_size=256, max_seq_len=64,
                         positions="learned")
    pe.init_weights(cfg, scheme="gpt2", seed=0).save("m.npz")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\nune phrase\n")
    _folder(tmp_path / "n_inner", _gpt2, {"n_inner": "16"})
    _folder(tmp_path / "pct_null", _neox, {"rotary_pct": None})
    _folder(tmp_path / "pct_abc", _neox, {"rotary_pct": "abc"})
    _folder(tmp_path / "no_fc_bias", _gpt2, drop="h.0.mlp.c_fc.bias")
    return tmp_path


# (argv, text the one line must contain, checked before any work: quick and writes nothing)
CASES = [
    (["spectral", "--model", "m.npz", "--json", "nowhere/x.json"], "--json nowhere/x.json", True),
    (["spectral", "--model", "m.npz", "--csv", "nowhere/x.csv"], "--csv nowhere/x.csv", True),
    (["spectral", "--text", "hello"], "--text", True),
    (["recovery", "--scales", "0"], "argument --scales", True),
    (["recovery", "--scales", "1,-2"], "argument --scales", True),
    (["recovery", "--model", "m.npz", "--spectral-tokens", "500", "--out", "o"], "--spectral-tokens", True),
    (["recovery", "--model", "m.npz", "--positions", "500", "--out", "o"], "--positions", True),
    (["bench", "--backends", "cuda"], "argument --backends", True),
    (["stability", "--width", "1", "--model", "none"], "argument --width", True),
    (["stability", "--schemes", "", "--model", "none"], "--schemes", True),
    (["stability", "--schemes", " , ", "--model", "none"], "--schemes", True),
    (["scan", "stability", "--width", "1"], "argument --width", True),
    (["scan", "stability", "--schemes", "", "--workers", "0"], "--schemes", True),
    (["scan", "recovery", "--scales", "0"], "argument --scales", True),
    (["positions", "--corpus", "latin1.txt", "--out", "o"], "'latin1.txt' is not UTF-8", True),
    (["spectral", "--model", "n_inner"], "'n_inner' must be an int; got '16'", True),
    (["spectral", "--model", "pct_null"], "'rotary_pct' must be a number; got None", True),
    (["spectral", "--model", "pct_abc"], "'rotary_pct' must be a number; got 'abc'", True),
    (["spectral", "--model", "no_fc_bias"], "model.safetensors' lacks tensor 'h.0.mlp.c_fc.bias'", True),
    (["spectral", "--model", "m.npz", "--jsn", "x.json"], "--jsn (did you mean --json?)", True),
    (["scan", "norms", "--pionts", "3"], "--pionts (did you mean --points?)", True),
    (["specrtal"], "did you mean 'spectral'?", True),
    (["attention", "--seeds=-1"], "argument --seeds", True),
    (["attention", "--lr", "inf"], "argument --lr", True),
    (["attention", "--out", "/proc/nope", "--seeds", "1", "--steps", "5"], "--out /proc/nope", True),
]


@pytest.mark.parametrize("argv, named, early", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_one_line_naming_the_argument(files, capsys, argv, named, early):
    before = sorted(os.listdir(files))
    t0 = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("pyengine") and "error: " in line, line
    assert named in line, line
    if early:
        assert sorted(os.listdir(files)) == before, "files were written before the argument was refused"
        assert took < 20, f"refused after {took:.1f} s"


def _refused(argv):
    buf = io.StringIO()
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(buf):
        main(argv)
    err = buf.getvalue()
    assert exc.value.code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    return line


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=4)
       .filter(lambda v: any(x <= 0 for x in v)), st.sampled_from([["recovery"], ["scan", "recovery"]]))
def test_any_non_positive_scale_is_refused_by_name(scales, command):
    line = _refused([*command, "--scales=" + ",".join(repr(v) for v in scales)])  # "=": a value may start with "-"
    assert "argument --scales: must be positive numbers" in line


@settings(max_examples=20, deadline=None)
@given(st.integers(-10**6, 1), st.sampled_from([["stability"], ["scan", "stability"]]))
def test_any_width_below_two_is_refused_by_name(width, command):
    assert "argument --width: must be an integer >= 2" in _refused([*command, f"--width={width}"])


@settings(max_examples=20, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=6))
def test_a_mistyped_option_is_named_with_a_suggestion(typo):
    wrong = "--json" + typo if not typo.startswith("-") else "--jsn" + typo
    line = _refused(["spectral", wrong, "x.json"])
    assert line.startswith("pyengine spectral: error: unrecognized arguments: " + wrong)


def test_the_missing_tensor_names_the_weights_file(tmp_path):
    path = _folder(tmp_path / "m", _gpt2, drop="h.0.attn.c_proj.weight")
    with pytest.raises(ValueError, match="lacks tensor 'h.0.attn.c_proj.weight'") as info:
        pe.load_pretrained(path)
    assert os.path.join(path, "model.safetensors") in str(info.value)


@pytest.mark.parametrize("value", [1.5, -0.5])
def test_rotary_fraction_out_of_range_names_the_field(tmp_path, value):
    path = _folder(tmp_path / "m", _neox, {"rotary_pct": value})
    with pytest.raises(ValueError, match=r"config.json.*'rotary_pct' must be a number in \[0, 1\]"):
        pe.load_pretrained(path)


def test_scan_spectral_says_when_it_repeats_the_corpus(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("one two three\nfour five\n")
    assert main(["scan", "spectral", "--model", "tiny", "--corpus", "c.txt", "--tokens", "100", "--seq-len", "50",
                 "--workers", "0", "--progress", "never", "--out", "s"]) == 0
    err = capsys.readouterr().err
    assert "the corpus has 24 tokens" in err and "--tokens 100 repeats it 4.2 times" in err


# --------------------------------------------------------------------------- interventions

@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_an_intervention_returning_nan_is_named_by_site(bad):
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=2, d_mlp=24, vocab_size=40)
    s = pe.init_weights(cfg, seed=3)
    ids = np.array([3, 1, 4, 1, 5])
    with pytest.raises(ValueError, match=r"intervention at 'blocks.1.mlp.hidden': the callable returned NaN"):
        s.run(ids, [Intervention("blocks.1.mlp.hidden", lambda y, site: y * bad)])
    in_place = Intervention("blocks.0.resid_mid", lambda y, site: y.__setitem__((0, 2, 3), bad))
    with pytest.raises(ValueError, match=r"intervention at 'blocks.0.resid_mid': the callable returned NaN"):
        s.run(ids, [in_place])
