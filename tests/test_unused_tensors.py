"""Checkpoints with tensors the config does not use are refused, in both loading modes.

A config with fewer layers than the files (a silently truncated model) and a tensor with no
place in the model (silently dropped) raise ValueError naming the tensor and the weights
file, for every decoder family with ``weights="load"`` and ``weights="mmap"`` (one check,
:func:`pyengine.models._families.check_tensors`), and for BERT (whose known extras, the
pooler and ``position_ids``, are accepted).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import pyengine as pe
from test_pretrained import TINY_BERT, need_libs, tiny_bert_tensors, write_bert

FAMILIES = ["gpt2", "gpt_neox", "llama", "qwen2", "gemma"]
#: config key of the layer count, and a real tensor name of a bias the family has no place for
LAYERS_KEY = {"gpt2": "n_layer"}
NO_PLACE = {"gpt2": "h.0.mlp.c_fc.scale", "gpt_neox": "gpt_neox.layers.0.mlp.dense_h_to_4h.scale",
            "llama": "model.layers.0.mlp.down_proj.bias", "qwen2": "model.layers.0.mlp.down_proj.bias",
            "gemma": "model.layers.0.self_attn.o_proj.bias"}


def _tiny(family):
    import transformers as tr

    common = dict(vocab_size=64, max_position_embeddings=32)
    if family == "gpt2":
        return tr.GPT2Config(n_embd=16, n_head=2, n_layer=2, n_positions=32, vocab_size=64), tr.GPT2LMHeadModel
    if family == "gpt_neox":
        return (tr.GPTNeoXConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                                 **common), tr.GPTNeoXForCausalLM)
    kw = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=24, **common)
    cls = {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM), "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM),
           "gemma": (tr.GemmaConfig, tr.GemmaForCausalLM)}[family]
    if family == "gemma":
        kw["head_dim"] = 4
    return cls[0](**kw), cls[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    need_libs()
    out = {}
    for family in FAMILIES:
        cfg, cls = _tiny(family)
        out[family] = tmp_path_factory.mktemp(family)
        cls._from_config(cfg).save_pretrained(out[family], safe_serialization=True)
    return out


def _edit(folder, add=None, config=None):
    from safetensors.numpy import load_file, save_file

    if add:
        path = folder / "model.safetensors"
        W = load_file(path)
        W.update({name: np.zeros(4, np.float32) for name in add})
        save_file(W, path, metadata={"format": "pt"})
    if config:
        hf = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**hf, **config}))


def _load(folder, mode):
    m = pe.load_pretrained(folder, weights=mode)
    return m.hidden_states(np.array([1, 2, 3]))


@pytest.mark.parametrize("mode", ["load", "mmap"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_checkpoints_are_read_whole(folders, tmp_path, family, mode):
    base = tmp_path / "ok"
    shutil.copytree(folders[family], base)
    assert _load(base, mode).shape[0] == 3  # the untouched checkpoint loads in both modes
    fewer = tmp_path / "fewer"
    shutil.copytree(folders[family], fewer)
    _edit(fewer, config={LAYERS_KEY.get(family, "num_hidden_layers"): 1})
    with pytest.raises(ValueError, match=r"tensor\(s\) \[.*\.1\..*model\.safetensors"):
        _load(fewer, mode)
    for name in (NO_PLACE[family], "unknown.tensor"):
        extra = tmp_path / name
        shutil.copytree(folders[family], extra)
        _edit(extra, add=[name])
        with pytest.raises(ValueError, match=rf"tensor\(s\) \['{name}'\] in weights file.*model\.safetensors"):
            _load(extra, mode)


@pytest.fixture(scope="module")
def libs():
    need_libs()


def test_bert_refuses_layers_beyond_the_config(libs, tmp_path):
    folder = write_bert(tmp_path / "bert", config={**TINY_BERT, "num_hidden_layers": 1})
    with pytest.raises(ValueError, match=r"'encoder\.layer\.1\..*model\.safetensors"):
        pe.load_pretrained(folder)


@pytest.mark.parametrize("name", ["encoder.layer.0.output.dense.scale", "cls.predictions.bias", "unknown"])
def test_bert_refuses_unknown_tensors(libs, tmp_path, name):
    W = tiny_bert_tensors()
    W[name] = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=rf"\['{name}'\] in weights file .*model\.safetensors"):
        pe.load_pretrained(write_bert(tmp_path / "bert", W))


@pytest.mark.parametrize("pre", ["", "bert."])
def test_bert_accepts_its_known_extras(libs, tmp_path, pre):
    W = tiny_bert_tensors()
    d = TINY_BERT["hidden_size"]
    W |= {"pooler.dense.weight": np.zeros((d, d), np.float32), "pooler.dense.bias": np.zeros(d, np.float32)}
    W = {pre + n: a for n, a in W.items()}
    ref = pe.load_pretrained(write_bert(tmp_path / "plain")).hidden_states(np.array([1, 2]))
    got = pe.load_pretrained(write_bert(tmp_path / "bert", W)).hidden_states(np.array([1, 2]))
    np.testing.assert_array_equal(got, ref)
