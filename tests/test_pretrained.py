"""pyengine.load_pretrained: real models against independent NumPy implementations, and tiny
files of each format against them (the files: pretrained_files.py; bad files and missing
packages: test_pretrained_errors.py).

The independent implementations below (naive_bert, naive_llama) are written from the
Hugging Face definitions and read the files with safetensors / json directly; they
share no code with pyengine's model or loaders. Tests that need a model package
skip when it is absent, unless PYENGINE_REQUIRE_MODELS=1 (CI), where they fail.
"""

from __future__ import annotations

import importlib.metadata
import json
import math

import numpy as np
import pytest

import pyengine as pe
from pretrained_files import (MINILM_DIR, MINILM_DIST, SMOL_DIST, TINY_BERT, TINY_LLAMA, TINY_VOCAB_SIZE, need_dist,
                              need_libs, tiny_bert_tensors, tiny_llama_tensors, write_bert, write_llama_gguf)

FD_STEP, FD_RTOL = 1e-6, 1e-7


@pytest.fixture(scope="module")
def libs():
    need_libs()


@pytest.fixture(scope="module")
def minilm():
    need_dist(MINILM_DIST)
    return pe.load_pretrained("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def smollm():
    need_dist(SMOL_DIST)
    return pe.load_pretrained("SmolLM2-135M-Instruct")


# --------------------------------------------------------------------------- naive references


def layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b


def naive_bert(W, hf, ids, round_types=False):
    """HF BertModel hidden states (n_layers + 1, T, d), float64, token type 0, no padding.

    ``round_types``: position + type-0 embedding rounded to float32, as a float32
    model that folds one into the other stores it.
    """
    from scipy.special import erf

    e = "embeddings."
    pos = W[e + "position_embeddings.weight"].astype(np.float64) + W[e + "token_type_embeddings.weight"][0]
    if round_types:
        pos = pos.astype(np.float32)
    W = {k: np.asarray(v, np.float64) for k, v in W.items() if v.dtype.kind == "f"}
    d, H, eps = hf["hidden_size"], hf["num_attention_heads"], hf["layer_norm_eps"]
    dh, T = d // H, len(ids)
    x = W[e + "word_embeddings.weight"][ids] + pos[:T]
    x = layer_norm(x, W[e + "LayerNorm.weight"], W[e + "LayerNorm.bias"], eps)
    out = [x]
    for k in range(hf["num_hidden_layers"]):
        p = f"encoder.layer.{k}."

        def lin(name, a, p=p):
            return a @ W[p + name + ".weight"].T + W[p + name + ".bias"]

        q, kk, v = (lin(f"attention.self.{n}", x) for n in ("query", "key", "value"))
        ctx = np.zeros((T, d))
        for h in range(H):
            sl = slice(h * dh, (h + 1) * dh)
            s = q[:, sl] @ kk[:, sl].T / math.sqrt(dh)
            pr = np.exp(s - s.max(-1, keepdims=True))
            ctx[:, sl] = (pr / pr.sum(-1, keepdims=True)) @ v[:, sl]
        x = layer_norm(x + lin("attention.output.dense", ctx), W[p + "attention.output.LayerNorm.weight"],
                       W[p + "attention.output.LayerNorm.bias"], eps)
        u = lin("intermediate.dense", x)
        x = layer_norm(x + lin("output.dense", 0.5 * u * (1 + erf(u / math.sqrt(2)))),
                       W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"], eps)
        out.append(x)
    return np.stack(out)


def naive_llama(W, hf, ids):
    """HF LlamaModel hidden states (n_layers + 1, T, d) and logits (T, V), float64."""
    W = {k: np.asarray(v, np.float64) for k, v in W.items()}
    d, H, Hkv, eps = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["rms_norm_eps"]
    dh, T = hf.get("head_dim") or d // H, len(ids)
    ang = np.arange(T)[:, None] * hf["rope_theta"] ** (-np.arange(0, dh, 2) / dh)[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # HF apply_rotary_pos_emb: x cos + rotate_half(x) sin
        return x * cos + np.concatenate([-x[:, dh // 2:], x[:, : dh // 2]], -1) * sin

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    x = W["model.embed_tokens.weight"][ids]
    out = [x]
    for k in range(hf["num_hidden_layers"]):
        p = f"model.layers.{k}."
        a = rms(x, W[p + "input_layernorm.weight"])
        q, kk, v = (a @ W[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        heads = []
        for h in range(H):
            j = h // (H // Hkv)
            s = rope(q[:, h * dh:(h + 1) * dh]) @ rope(kk[:, j * dh:(j + 1) * dh]).T / math.sqrt(dh)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            heads.append((pr / pr.sum(-1, keepdims=True)) @ v[:, j * dh:(j + 1) * dh])
        x = x + np.concatenate(heads, 1) @ W[p + "self_attn.o_proj.weight"].T
        a = rms(x, W[p + "post_attention_layernorm.weight"])
        g, up = a @ W[p + "mlp.gate_proj.weight"].T, a @ W[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * up) @ W[p + "mlp.down_proj.weight"].T
        out.append(x)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return np.stack(out), rms(x, W["model.norm.weight"]) @ head.T


def sentence_embedding(h):
    """sentence-transformers' mean pooling (mask all ones) and L2 normalization, of (T, d)."""
    e = np.asarray(h, np.float64).mean(0)
    return e / np.linalg.norm(e)


# --------------------------------------------------------------------------- MiniLM


SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today."]


def test_minilm_matches_independent_bert(minilm):
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    folder = importlib.metadata.distribution(MINILM_DIST).locate_file(MINILM_DIR)
    hf = json.loads((folder / "config.json").read_text())
    W = load_file(str(folder / "model.safetensors"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    for s in SENTENCES[:2]:
        ids = np.array(tok.encode(s).ids)
        assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
        np.testing.assert_array_equal(minilm.tokenize(s), ids)
        ref = naive_bert(W, hf, ids)
        h32, h64 = minilm.hidden_states(ids), minilm.hidden_states(ids, dtype=np.float64)
        assert h32.dtype == np.float32 and h64.dtype == np.float64 and h32.shape == (7, len(ids), 384)
        e_ref = sentence_embedding(ref[-1])
        assert np.abs(sentence_embedding(h32[-1]) - e_ref).max() <= 1e-5
        # float64 is float64 arithmetic on the stored weights from the first sum
        assert np.abs(sentence_embedding(h64[-1]) - e_ref).max() <= 1e-13
        assert np.abs(h64 - ref).max() <= 1e-12 * np.abs(ref).max()


def test_minilm_similarities(minilm):
    E = np.array([sentence_embedding(minilm.hidden_states(minilm.tokenize(s))[-1]) for s in SENTENCES])
    cos = E @ E.T
    assert cos[0, 1] > 0.7 and abs(cos[0, 2]) < 0.2 and abs(cos[1, 2]) < 0.2
    # The similarity matrix that the sentence-transformers README prints for this model.
    readme = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    E = np.array([sentence_embedding(minilm.hidden_states(minilm.tokenize(s))[-1]) for s in readme])
    np.testing.assert_allclose((E @ E.T)[np.triu_indices(3, 1)], [0.6660, 0.1046, 0.1411], atol=6e-4)


def test_minilm_batched_and_tokenizer(minilm):
    a, b = minilm.tokenize(["A man is eating food.", "A woman is playing violin."])
    assert a.dtype == np.int64 and a.shape == b.shape == (8,)
    hs = minilm.hidden_states(np.stack([a, b]))
    assert hs.shape == (7, 2, 8, 384) and hs.dtype == np.float32
    np.testing.assert_allclose(hs[:, 1], minilm.hidden_states(b), rtol=0, atol=1e-5)
    assert minilm.detokenize(a) == "[CLS] a man is eating food. [SEP]"
    assert minilm.detokenize(a, skip_special_tokens=True) == "a man is eating food."
    assert len(minilm.tokenize("word " * 300)) == 302  # no truncation to 128, no padding
    assert minilm.config.embed_norm and not minilm.config.causal and minilm.config.lm_head == "none"
    with pytest.raises(ValueError, match="language-model head"):
        minilm.logits(a)
    with pytest.raises(ValueError, match="max_seq_len"):
        minilm.hidden_states(minilm.tokenize("word " * 600))


def test_minilm_block_jvp_matches_finite_differences(minilm):
    m64 = minilm.astype(np.float64)
    assert isinstance(m64, pe.PretrainedModel) and m64.tokenizer is minilm.tokenizer
    h = m64.hidden_states(minilm.tokenize("A man is eating food."))[2]
    dh = np.random.default_rng(0).standard_normal((2,) + h.shape)
    jvp = m64.block_jvp(2, h, dh)
    for i in range(2):
        fd = (m64.block_forward(2, h + FD_STEP * dh[i]) - m64.block_forward(2, h - FD_STEP * dh[i])) / (2 * FD_STEP)
        assert np.linalg.norm(jvp[i] - fd) <= FD_RTOL * np.linalg.norm(fd)


# --------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm_predicts_paris(smollm):
    ids = smollm.tokenize("The capital of France is")
    assert ids.dtype == np.int64 and smollm.bos_token_id not in ids.tolist()  # add_bos_token is False
    logits = smollm.logits(ids)
    assert logits.shape == (len(ids), 49152) and logits.dtype == np.float32
    top = np.argsort(logits[-1])[::-1]
    assert smollm.detokenize(top[:1]) == " Paris"
    assert logits[-1, top[0]] - logits[-1, top[1]] > 1.0
    # float64, batched and the logit lens agree
    l64 = smollm.logits(ids, dtype=np.float64)
    assert l64.dtype == np.float64 and np.abs(l64 - logits).max() <= 1e-3 * np.abs(l64).max()
    hs = smollm.hidden_states(np.stack([ids, ids]))
    assert hs.shape == (31, 2, len(ids), 576)
    np.testing.assert_allclose(smollm.logits(hs[-1]), np.stack([logits, logits]), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_smollm_tokenizer_round_trip(smollm):
    c = smollm.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_mlp) == (30, 576, 9, 3, 1536)
    assert c.rope_base == 100000.0 and c.lm_head == "tied" and c.norm == "rmsnorm" and c.placement == "pre"
    for text in ["The capital of France is", "  Indentation,\n\ttabs; digits 12345 and ünïcödé — ok?",
                 "<|im_start|>user\nHi<|im_end|>"]:
        assert smollm.detokenize(smollm.tokenize(text)) == text
    assert smollm.tokenize("<|im_start|>")[0] == 1  # special tokens match whole
    assert len(smollm.tokenize("2024")) == 4  # digits one by one (SmolLM2's pre-tokenizer)
    assert [len(t) for t in smollm.tokenize(["a b", "c"])] == [2, 1]


@pytest.mark.slow
def test_smollm_block_jvp_matches_finite_differences(smollm):
    ids = smollm.tokenize("The capital of France is")
    h = smollm.hidden_states(ids, dtype=np.float64)[7]
    dh = np.random.default_rng(1).standard_normal((2,) + h.shape) * np.abs(h).mean()
    jvp = smollm.block_jvp(7, h, dh)
    for i in range(2):
        fd = (smollm.block_forward(7, h + FD_STEP * dh[i]) - smollm.block_forward(7, h - FD_STEP * dh[i]))
        fd /= 2 * FD_STEP
        assert np.linalg.norm(jvp[i] - fd) <= FD_RTOL * np.linalg.norm(fd)


# --------------------------------------------------------------------------- tiny files: mapping


def test_tiny_bert_folder_matches_naive(libs, tmp_path):
    folder = write_bert(tmp_path / "bert")
    m = pe.load_pretrained(folder)
    assert m.architecture == "bert" and m.tokenizer is None and m.name == "bert"
    ids = np.array([2, 7, 29, 0, 5])
    ref = naive_bert(tiny_bert_tensors(), TINY_BERT, ids)  # exact float64 from the first sum
    np.testing.assert_allclose(m.hidden_states(ids, dtype=np.float64), ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="no tokenizer"):
        m.tokenize("hello")


@pytest.mark.parametrize("head_dim", [None, 6], ids=["default", "head_dim=6"])  # 6: H dh = 24 != d = 16
def test_tiny_llama_gguf_and_hf_folder_match_naive(libs, tmp_path, head_dim):
    from safetensors.numpy import save_file

    config = TINY_LLAMA if head_dim is None else TINY_LLAMA | {"head_dim": head_dim}
    W = tiny_llama_tensors(config=config)
    ids = np.array([0, 5, 200, 17, 259, 3, 99])
    ref, ref_logits = naive_llama(W, config, ids)
    g = pe.load_pretrained(write_llama_gguf(tmp_path / "tiny.gguf", W, config=config))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": TINY_VOCAB_SIZE}))
    save_file(W, str(folder / "model.safetensors"))
    f = pe.load_pretrained(folder)
    for m in (g, f):
        assert m.architecture == "llama" and m.config.lm_head == "tied" and m.config.n_kv_heads == 2
        assert m.config.head_dim == (head_dim or 4)
        np.testing.assert_allclose(m.hidden_states(ids, dtype=np.float64), ref, rtol=0, atol=1e-11 * np.abs(ref).max())
        np.testing.assert_allclose(m.logits(ids, dtype=np.float64), ref_logits, rtol=0,
                                   atol=1e-11 * np.abs(ref_logits).max())
        np.testing.assert_allclose(m.hidden_states(ids), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    # the GGUF's own tokenizer: byte-level BPE with the merges, digits split, special tokens whole
    assert g.tokenize(" the").tolist() == [259]
    text = "the 12 theme <|endoftext|>!"
    assert g.detokenize(g.tokenize(text)) == text and 0 in g.tokenize(text).tolist()
