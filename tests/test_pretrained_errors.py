"""pyengine.load_pretrained on bad input: damaged or lying safetensors and GGUF files (tiny
files written by pretrained_files.py's writers), unknown names, missing packages and libraries,
bad paths, and an import of pyengine that loads no model library."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest

import pyengine as pe
from pyengine.models import pretrained
from pretrained_files import (INSTALL, MINILM_DIST, SMOL_DIST, need_libs, rewrite_header, tiny_bert_tensors,
                              tiny_llama_tensors, write_bert, write_llama_gguf)


@pytest.fixture(scope="module")
def libs():
    need_libs()


# --------------------------------------------------------------------------- bad files


def _drop(name):
    return lambda W: W.pop(name)


def _nan(name):
    def f(W):
        W[name] = W[name].copy()
        W[name].flat[4] = np.nan
    return f


def _transpose(name):
    def f(W):
        W[name] = np.ascontiguousarray(W[name].T)
    return f


@pytest.mark.parametrize("edit, match", [
    (_drop("encoder.layer.1.output.dense.bias"), "lacks tensor 'encoder.layer.1.output.dense.bias'"),
    (_nan("encoder.layer.0.attention.self.key.weight"), "'encoder.layer.0.attention.self.key.weight' contains NaN"),
    (_transpose("encoder.layer.0.intermediate.dense.weight"), "'encoder.layer.0.intermediate.dense.weight' must have"),
], ids=["missing-tensor", "nan", "wrong-shape"])
def test_bad_safetensors_tensors(libs, tmp_path, edit, match):
    W = tiny_bert_tensors()
    edit(W)
    folder = write_bert(tmp_path / "bert", W)
    with pytest.raises(ValueError, match=f"model.safetensors.*{match}"):
        pe.load_pretrained(folder)


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def _lying_length(path):
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])


def _lying_offsets(path):
    def change(h):
        a, b = h["embeddings.LayerNorm.bias"]["data_offsets"]
        h["embeddings.LayerNorm.bias"]["data_offsets"] = [a + 10**6, b + 10**6]
    rewrite_header(path, change)


def _lying_shape(path):
    rewrite_header(path, lambda h: h["encoder.layer.0.output.dense.weight"].update(shape=[8, 13]))


def _garbage_header(path):
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + b"\xff" * 16 + raw[24:])


@pytest.mark.parametrize("damage, match", [
    (_truncate, "truncated or corrupt"),
    (_lying_length, "header length"),
    (_lying_offsets, "tensor 'embeddings.LayerNorm.bias' claims bytes"),
    (_lying_shape, "tensor 'encoder.layer.0.output.dense.weight' .* needs 416 bytes"),
    (_garbage_header, "header is not JSON"),
], ids=["truncated", "lying-length", "lying-offsets", "lying-shape", "garbage-header"])
def test_damaged_safetensors_file(libs, tmp_path, damage, match):
    folder = write_bert(tmp_path / "bert")
    damage(folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"model.safetensors.*{match}"):
        pe.load_pretrained(folder)


def test_safetensors_reader_errors_are_wrapped(libs, tmp_path):
    """A file damaged after its header was checked: safetensors' own error becomes a ValueError."""
    from pyengine.models import _hf

    folder = write_bert(tmp_path / "bert")
    st = _hf.Safetensors(str(folder / "model.safetensors"))
    _truncate(folder / "model.safetensors")
    with pytest.raises(ValueError, match="tensor 'embeddings.LayerNorm.weight' cannot be read"):
        st.get("embeddings.LayerNorm.weight", (8,))


@pytest.mark.parametrize("cut", [0.5, 0.999, 0.02], ids=["half", "last-bytes", "in-metadata"])
def test_truncated_gguf(libs, tmp_path, cut):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama_tensors())
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * cut)])
    with pytest.raises(ValueError, match="tiny.gguf"):
        pe.load_pretrained(path)


def test_bad_gguf_tensors(libs, tmp_path):
    path = write_llama_gguf(tmp_path / "nan.gguf", tiny_llama_tensors(), nan_in="blk.1.attn_k.weight")
    with pytest.raises(ValueError, match="nan.gguf.*'blk.1.attn_k.weight' contains NaN"):
        pe.load_pretrained(path)
    path = write_llama_gguf(tmp_path / "bias.gguf", tiny_llama_tensors(),
                            extra={"blk.0.attn_q.bias": np.zeros(16, np.float32)})
    with pytest.raises(ValueError, match="bias.gguf.*'blk.0.attn_q.bias'.* not part of a supported"):
        pe.load_pretrained(path)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(ValueError, match="junk.gguf"):
        pe.load_pretrained(tmp_path / "junk.gguf")


# --------------------------------------------------------------------------- names, packages, imports


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="'gpt2' is neither a known model .*'all-MiniLM-L6-v2', 'SmolLM2-135M"):
        pe.load_pretrained("gpt2")


def test_missing_package_says_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(pretrained, "_search_path", lambda: [str(tmp_path)])
    for name, dist in (("all-MiniLM-L6-v2", MINILM_DIST), ("SmolLM2-135M-Instruct", SMOL_DIST)):
        with pytest.raises(FileNotFoundError) as info:
            pe.load_pretrained(name)
        assert INSTALL in str(info.value) and dist in str(info.value)


def test_missing_library_says_the_install_command(libs, monkeypatch, tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama_tensors())
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match="'gguf'.*" + INSTALL.replace(".", r"\.").replace("[", r"\[")
                       .replace("]", r"\]")):
        pe.load_pretrained(path)


def test_bad_paths(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="must be a .gguf"):
        pe.load_pretrained(tmp_path / "w.bin")
    with pytest.raises(ValueError, match="no config.json"):
        pe.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported"):
        pe.load_pretrained(tmp_path)


def test_import_pyengine_loads_no_model_library():
    code = ("import sys, pyengine; pyengine.load_pretrained; "
            "print([m for m in ('safetensors', 'gguf', 'tokenizers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert pe.PretrainedModel is pretrained.PretrainedModel and issubclass(pe.PretrainedModel, pe.Stack)
