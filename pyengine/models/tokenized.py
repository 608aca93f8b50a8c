"""Tokens as text for pretrained models: :class:`TokenizedText` (ids, token strings, character
offsets, the token span of a substring) and the tokenizer methods of
:class:`~pyengine.models.pretrained.PretrainedModel` (:class:`Tokenizing`, a base class of it).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import numpy as np

from . import _hf

__all__ = ["TokenizedText", "Tokenizing", "tokenizer_json"]


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizedText:
    """Text and its tokens: ``ids`` int64 (T,), ``tokens`` (their strings), ``offsets``
    int64 (T, 2) character [start, end) of each token in ``text`` (special tokens: (0, 0))."""

    text: str
    ids: np.ndarray
    tokens: list[str]
    offsets: np.ndarray
    special: np.ndarray  # bool (T,): a special token ([CLS], [SEP], BOS, EOS)

    def __len__(self) -> int:
        return int(self.ids.size)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.ids if dtype is None else self.ids.astype(dtype)

    def span(self, substring: str, occurrence: int = 0) -> slice:
        """Token indices (a slice) covering the ``occurrence``-th ``substring`` of the text.

        Every token that overlaps the substring's characters is in the span. ValueError
        if the substring is not in the text (or only inside special tokens).
        """
        if not isinstance(substring, str) or not substring:
            raise TypeError(f"substring must be a non-empty str; got {substring!r}")
        at = -1
        for _ in range(int(occurrence) + 1):
            at = self.text.find(substring, at + 1)
            if at < 0:
                raise ValueError(f"substring {substring!r} (occurrence {occurrence}) is not in the text")
        end = at + len(substring)
        s, e = self.offsets[:, 0], self.offsets[:, 1]
        hit = np.flatnonzero(~self.special & (s < end) & (e > at))
        if hit.size == 0:
            raise ValueError(f"substring {substring!r} covers no token")
        return slice(int(hit[0]), int(hit[-1]) + 1)


class Tokenizing:
    """The tokenizer methods of a pretrained model (it sets ``tokenizer``, ``architecture``,
    ``name``, ``add_bos``/``add_eos``, ``bos_token_id``/``eos_token_id`` and ``config``)."""

    def _encode_one(self, text: str) -> TokenizedText:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str or a list of str; got {type(text).__name__}")
        enc = self.tokenizer.encode(text, add_special_tokens=self.architecture == "bert")
        ids, toks, offs = list(enc.ids), list(enc.tokens), [tuple(o) for o in enc.offsets]
        spec = [bool(m) for m in enc.special_tokens_mask]
        if self.architecture != "bert":
            for flag, tid, front in ((self.add_bos, self.bos_token_id, True), (self.add_eos, self.eos_token_id, False)):
                if flag:
                    tok = self.tokenizer.id_to_token(tid) or ""
                    for lst, v in ((ids, tid), (toks, tok), (offs, (0, 0)), (spec, True)):
                        lst.insert(0, v) if front else lst.append(v)
        return TokenizedText(text, np.array(ids, dtype=np.int64), toks,
                             np.array(offs, dtype=np.int64).reshape(-1, 2), np.array(spec, dtype=bool))

    def tokenize(self, text: str | list[str], return_offsets: bool = False) -> Any:
        """Token ids of raw text (no chat template), int64 (T,); a list of strings gives a list.

        BERT: ``[CLS] ... [SEP]`` as the model was trained (lower-cased WordPiece).
        Llama: BOS/EOS only if the model's metadata asks for it (SmolLM2: neither).
        Nothing is padded or truncated: sequences longer than ``config.max_seq_len``
        (BERT: 512) are rejected by :meth:`hidden_states`. Batches of different lengths:
        :meth:`tokenize_batch` (ids and attention_mask).

        ``return_offsets=True``: a :class:`TokenizedText` (ids, token strings, character
        offsets; ``.span(substring)`` gives a substring's tokens) instead of the ids.
        """
        self._need_tokenizer()
        if isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
            return [self.tokenize(t, return_offsets) for t in text]
        out = self._encode_one(text)
        return out if return_offsets else out.ids

    def tokenize_batch(self, texts: list[str], padding: str = "right") -> tuple[np.ndarray, np.ndarray]:
        """Ids (B, T) and attention_mask (B, T) of texts of different lengths, padded left or right."""
        if padding not in ("left", "right"):
            raise ValueError(f"padding must be 'left' or 'right'; got {padding!r}")
        seqs = self.tokenize(list(texts))
        if not seqs:
            raise ValueError("texts must hold at least one text")
        T = max(len(s) for s in seqs)
        pad = self.eos_token_id if self.eos_token_id is not None else 0
        ids, mask = np.full((len(seqs), T), pad, np.int64), np.zeros((len(seqs), T), np.int64)
        for i, s in enumerate(seqs):
            sl = slice(T - len(s), T) if padding == "left" else slice(0, len(s))
            ids[i, sl], mask[i, sl] = s, 1
        return ids, mask

    def token_span(self, text: str, substring: str, occurrence: int = 0) -> slice:
        """Token indices (a slice into ``tokenize(text)``) covering ``substring`` of ``text``."""
        return self.tokenize(text, return_offsets=True).span(substring, occurrence)

    def warn_if_special(self, ids: Any, position: int = -1) -> bool:
        """Warn (UserWarning) if the read-out token ``ids[position]`` is special ([SEP], BOS, ...)."""
        self._need_tokenizer()
        arr = np.asarray(ids).reshape(-1)
        tok = self.tokenizer.id_to_token(int(arr[position]))
        special = tok is not None and tok in {t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                                              if t.special}
        if special:
            warnings.warn(f"the read-out token at position {position} is the special token {tok!r}; "
                          "read out at a real token (e.g. position -2 for BERT's [SEP])", UserWarning, stacklevel=2)
        return special

    def detokenize(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of token ids (T,) (special tokens kept unless ``skip_special_tokens``)."""
        self._need_tokenizer()
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu" or arr.ndim != 1:
            raise ValueError(f"ids must be a 1-d integer array; got dtype {arr.dtype}, shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
            raise ValueError(f"ids must lie in [0, vocab_size = {self.config.vocab_size})")
        return self.tokenizer.decode([int(i) for i in arr], skip_special_tokens=skip_special_tokens)

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer (none was found next to its weights)")


def tokenizer_json(folder: str) -> Any:
    """The ``tokenizer.json`` of a model folder (padding and truncation off), or None."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    tokenizers = _hf.need("tokenizers")
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as exc:  # the Rust parser's errors are plain Exceptions
        raise ValueError(f"tokenizer file {path!r} is not readable ({exc})") from None
    tok.no_padding()  # the MiniLM file pads every text to 128 tokens
    tok.no_truncation()  # and truncates to 128; too-long input is refused by hidden_states instead
    return tok
