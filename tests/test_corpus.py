"""The built-in corpus (pyengine/data/corpus.txt) and its loaders."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine.corpus import CORPUS_LICENSE, load_corpus, tokenized_corpus


class _WordModel:
    """A stand-in tokenizer: one id per word (enough to test cutting and dropping)."""

    def tokenize(self, text):
        return [np.array([len(w) for w in s.split()], dtype=np.int64) for s in text]


def test_builtin_corpus_is_shipped_varied_and_licensed():
    s = load_corpus()
    assert len(s) >= 300
    assert len(set(s)) == len(s)
    assert all(not x.startswith("#") and x == x.strip() and x for x in s)
    assert len({x.split()[0] for x in s}) >= 30  # many different openings
    assert "CC0" in CORPUS_LICENSE


def test_user_corpus_file(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("# comment\n\nOne two three.\n  Four five six seven.  \n", encoding="utf-8")
    assert load_corpus(p) == ["One two three.", "Four five six seven."]
    (tmp_path / "e.txt").write_text("# nothing\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="path"):
        load_corpus(tmp_path / "e.txt")
    with pytest.raises(FileNotFoundError, match="path"):
        load_corpus(tmp_path / "missing.txt")
    with pytest.raises(TypeError, match="path"):
        load_corpus(3)


def test_tokenized_corpus_cuts_and_drops():
    sents = ["a bb ccc", "a bb ccc dddd eeeee", "x"]
    ids = tokenized_corpus(_WordModel(), 3, sents)
    np.testing.assert_array_equal(ids, [[1, 2, 3], [1, 2, 3]])
    assert ids.dtype == np.int64
    assert tokenized_corpus(_WordModel(), 3, sents, max_contexts=1).shape == (1, 3)
    with pytest.raises(ValueError, match="length = 9.*longest has 5"):
        tokenized_corpus(_WordModel(), 9, sents)
    with pytest.raises(ValueError, match="length"):
        tokenized_corpus(_WordModel(), 0, sents)
    with pytest.raises(TypeError, match="model"):
        tokenized_corpus(object(), 3, sents)
    full = tokenized_corpus(_WordModel(), 8)  # the built-in corpus by default
    assert full.shape[1] == 8 and full.shape[0] > 100
