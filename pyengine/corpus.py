"""The built-in corpus: a few hundred short English sentences for measurements over contexts.

``pyengine/data/corpus.txt`` holds 310 sentences written for pyengine and dedicated to
the public domain (CC0 1.0; the license is stated in the file's header). It ships as
package data, so it is there in wheels and editable installs alike, and nothing is
downloaded. One sentence per line; lines starting with ``#`` and blank lines are skipped.

:func:`load_corpus` reads it (or the user's own text file, same format);
:func:`tokenized_corpus` tokenizes the sentences with any model that has a
``tokenize(list[str]) -> list[ndarray]`` method (:class:`pyengine.PretrainedModel`) and
cuts them to one common length, so the contexts stack into one ``(C, T)`` batch.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

import numpy as np

from . import _validate as _v

__all__ = ["CORPUS_LICENSE", "load_corpus", "tokenized_corpus"]

#: The built-in corpus's license, as its file's header states it.
CORPUS_LICENSE = "CC0 1.0 (public domain dedication); sentences written for pyengine"


def _parse(text: str) -> list[str]:
    return [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]


def load_corpus(path: str | os.PathLike[str] | None = None) -> list[str]:
    """The sentences of the built-in corpus (``path=None``) or of a UTF-8 text file.

    One sentence per line; blank lines and lines starting with ``#`` are skipped.
    FileNotFoundError if ``path`` does not exist; ValueError if it is not UTF-8 or holds no sentence.
    """
    if path is None:
        text = resources.files("pyengine").joinpath("data", "corpus.txt").read_text(encoding="utf-8")
        where = "the built-in corpus"
    else:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a file path or None; got {type(path).__name__}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"path: no such corpus file {os.fspath(path)!r}")
        where = f"corpus file {os.fspath(path)!r}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"path: {where} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    out = _parse(text)
    if not out:
        raise ValueError(f"path: {where} holds no sentence (one per line; '#' lines are comments)")
    return out


def tokenized_corpus(
    model: Any, length: int, sentences: list[str] | None = None, *, max_contexts: int | None = None,
) -> np.ndarray:
    """Token ids (C, length), int64: every sentence with at least ``length`` tokens, cut to ``length``.

    Parameters
    ----------
    model : object with ``tokenize(list[str]) -> list of int arrays``
        E.g. a :class:`pyengine.PretrainedModel` (BERT ids start with ``[CLS]``).
    length : int >= 1
        The common length T. Shorter sentences are dropped (nothing is padded:
        the stack has no padding mask), longer ones cut after ``length`` tokens.
    sentences : list of str, optional
        Default: :func:`load_corpus` ().
    max_contexts : int, optional
        Keep at most this many contexts (the first ones, in corpus order).

    Raises
    ------
    ValueError
        If no sentence has ``length`` tokens (the message gives the longest).
    """
    length = _v.count("length", length)
    max_contexts = _v.count("max_contexts", max_contexts, allow_none=True)
    if not callable(getattr(model, "tokenize", None)):
        raise TypeError(f"model must have a tokenize method (a PretrainedModel); got {type(model).__name__}")
    if sentences is None:
        sentences = load_corpus()
    elif not isinstance(sentences, (list, tuple)) or not all(isinstance(s, str) for s in sentences) or not sentences:
        raise TypeError("sentences must be a non-empty list of str")
    ids = model.tokenize(list(sentences))
    kept = [np.asarray(t, dtype=np.int64)[:length] for t in ids if len(t) >= length]
    if not kept:
        longest = max(len(t) for t in ids)
        raise ValueError(f"length = {length}: no sentence has that many tokens (the longest has {longest})")
    if max_contexts is not None:
        kept = kept[:max_contexts]
    return np.stack(kept)
