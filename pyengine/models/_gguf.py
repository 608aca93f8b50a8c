"""GGUF files (llama.cpp): checked reading, dequantization, Q/K un-permutation, BPE tokenizer.

Used by :mod:`pyengine.models.pretrained`; needs the ``gguf`` and ``tokenizers`` packages
(imported lazily by the callers' first use). Every failure of a damaged file
becomes a ValueError that names the file (and the tensor or key).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import _validate as _v

#: llama.cpp's ``tokenizer.ggml.pre`` values whose pre-tokenizer is "every digit
#: alone, then the GPT-2 regex" (llama-vocab.cpp groups them; HF's tokenizer.json for
#: SmolLM2 is Sequence[Digits(individual_digits), ByteLevel]).
_PRE_DIGITS_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r")
#: Pre-tokenizers that are plain GPT-2 byte-level BPE.
_PRE_GPT2 = ("gpt2", "default")
#: ``tokenizer.ggml.token_type`` values of special tokens (CONTROL, USER_DEFINED): matched whole in text.
_SPECIAL_TYPES = (3, 4)


class GGUFFile:
    """Metadata and tensors of one GGUF file, read and checked up front.

    ``meta`` maps every key to its Python value (token lists included); ``tensors``
    maps names to ``(numpy_shape, ggml_type)``; :meth:`tensor` dequantizes one
    tensor to float32 (numpy shape = reversed GGML shape: (rows, columns)).
    """

    def __init__(self, path: str) -> None:
        import gguf

        self.path = path
        where = f"weights file {path!r}"
        size = os.path.getsize(path)
        try:
            reader = gguf.GGUFReader(path, "r")
        except Exception as exc:  # the reader's parse errors are of any type (IndexError, struct, reshape)
            raise ValueError(f"{where} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self._reader = reader
        self.meta: dict[str, Any] = {}
        for key, field in reader.fields.items():
            try:
                self.meta[key] = field.contents()
            except Exception as exc:
                raise ValueError(f"{where}: metadata key {key!r} is malformed ({type(exc).__name__}: {exc})") from None
        self.tensors: dict[str, tuple[tuple[int, ...], Any]] = {}
        self._raw: dict[str, Any] = {}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:  # the memory map would run past the end of the file
                raise ValueError(
                    f"{where}: tensor {t.name!r} claims bytes {int(t.data_offset)}..{end} of a {size}-byte file "
                    "(truncated or corrupt)"
                )
            if t.name in self.tensors:
                raise ValueError(f"{where}: tensor {t.name!r} appears twice")
            self.tensors[t.name] = (tuple(int(n) for n in reversed(t.shape.tolist())), t.tensor_type)
            self._raw[t.name] = t

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` as a new float32 array of (numpy) ``shape``, finite; ValueError otherwise."""
        from gguf.quants import dequantize

        where = f"weights file {self.path!r}"
        if name not in self.tensors:
            raise ValueError(f"{where} lacks tensor {name!r}")
        have, qtype = self.tensors[name]
        if have != tuple(shape):
            raise ValueError(f"{where}: tensor {name!r} must have shape {tuple(shape)}; got {have}")
        raw = self._raw[name]
        try:
            a = dequantize(raw.data, qtype)
        except Exception as exc:
            raise ValueError(
                f"{where}: tensor {name!r} of type {getattr(qtype, 'name', qtype)} cannot be dequantized "
                f"({type(exc).__name__}: {exc})"
            ) from None
        if a.shape != tuple(shape):
            raise ValueError(f"{where}: tensor {name!r} dequantizes to shape {a.shape}, not {tuple(shape)}")
        if np.may_share_memory(a, raw.data) or a.dtype != np.float32:  # float tensors come back as file views
            a = np.array(a, dtype=np.float32)
        _v.finite(f"{where}: tensor {name!r}", a)
        return a

    def close(self) -> None:
        """Drop the memory map (the dequantized arrays stay valid)."""
        self._reader = None
        self._raw = {}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Q/K row permutation: GGUF (out, in) rows -> HF rows.

    llama.cpp rotates adjacent pairs (2i, 2i+1) of each head; the converter
    reorders HF's half-split rows with
    ``w.reshape(n_head, 2, out // n_head // 2, in).swapaxes(1, 2).reshape(out, in)``.
    This is its inverse, so the half-split rotary of :mod:`pyengine.models._blocks` applies.
    """
    out, n_in = w.shape
    return np.ascontiguousarray(w.reshape(n_head, out // n_head // 2, 2, n_in).swapaxes(1, 2).reshape(out, n_in))


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permutation (HF rows -> GGUF rows); the inverse of :func:`unpermute_qk`."""
    out, n_in = w.shape
    return np.ascontiguousarray(w.reshape(n_head, 2, out // n_head // 2, n_in).swapaxes(1, 2).reshape(out, n_in))


def tokenizer_from_gguf(meta: dict[str, Any], where: str) -> tuple[Any, dict[str, Any]]:
    """A ``tokenizers.Tokenizer`` built from the ``tokenizer.ggml.*`` keys, and its BOS/EOS policy.

    Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported. Special
    tokens (control and user-defined types) are matched whole in text, as in the
    original tokenizer. No special token is added by the Tokenizer itself; the
    policy dict says whether the model expects BOS/EOS (``add_bos_token``,
    ``add_eos_token``; absent keys count as False, as llama.cpp does for BPE).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{where}: tokenizer.ggml.model = {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list) or not tokens:
        raise ValueError(f"{where}: tokenizer.ggml.tokens / tokenizer.ggml.merges are missing or not lists")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _PRE_DIGITS_GPT2:
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _PRE_GPT2:
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ValueError(f"{where}: tokenizer.ggml.pre = {pre!r} is not supported "
                         f"(known: {', '.join(_PRE_DIGITS_GPT2 + _PRE_GPT2)})")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.tokens has duplicate tokens")
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{where}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((parts[0], parts[1]))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as exc:
        raise ValueError(f"{where}: the BPE tokenizer cannot be built ({type(exc).__name__}: {exc})") from None
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    special = [tokens[i] for i, t in enumerate(types) if int(t) in _SPECIAL_TYPES]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        if meta.get("tokenizer.ggml." + flag) and not 0 <= int(meta.get("tokenizer.ggml." + key, -1)) < len(tokens):
            raise ValueError(f"{where}: tokenizer.ggml.{flag} is set but tokenizer.ggml.{key} is missing or invalid")
    policy = {
        "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    return tok, policy
