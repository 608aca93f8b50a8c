"""The tree holds the tool, not its history: no work-item words in code, tests or docs.

Every text file under ``pyengine/``, ``csrc/``, ``tests/`` and ``docs/`` (generated folders
skipped) and ``README.md`` is searched for an issue reference (the word issue followed by a number, with or
without ``#``, or a bare ``#`` and number), "session" in the sense of a round of work (pytest's ``scope="session"`` is
allowed) and "helper" naming a person or agent (``helper fg``, ``(helper g4``). This
file itself is not searched (it spells the words out); its own planted lines are built from
pieces all the same.
"""

from __future__ import annotations

import pathlib
import re

import pytest

THIS = pathlib.Path(__file__).resolve()
ROOT = THIS.parents[1]
FOLDERS = ("pyengine", "csrc", "tests", "docs")
FILES = ("README.md",)
#: Generated or ignored folders (relative to the repository root) and cache folders anywhere.
SKIP = {"docs/_build", "docs/api/generated", "docs/auto_examples"}
SKIP_NAMES = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
#: Short words that may follow "helper" in ordinary prose ("a helper of", "helper to").
_PROSE = "of|in|is|to|on|at|as|by|or|if|it|an|be|do|no|so|up|we|for|and|the|per|that|which|with"

_ISSUE = "iss" + "ues?"
_SESSION = "sess" + "ions?"
_HELPER = "hel" + "pers?"
#: Allowed idioms, removed from a line before it is searched: pytest's fixture scope.
ALLOWED = re.compile(r"""scope\s*=\s*(["'])""" + _SESSION[:-2] + r"\1")
PATTERNS = {
    "issue number": re.compile(rf"\b{_ISSUE}[\s_-]*#?\d+", re.IGNORECASE),
    "#N reference": re.compile(r"(?:^|(?<=[\s(\[,;]))" + "#" + r"\d{1,4}(?![\w.])"),
    "session": re.compile(rf"\b{_SESSION}\b", re.IGNORECASE),
    "helper as a name": re.compile(rf"\b{_HELPER}\s+(?!(?:{_PROSE})\b)[a-z]{{1,2}}\d*\b", re.IGNORECASE),
}


def _text_files() -> list[pathlib.Path]:
    out = [ROOT / f for f in FILES if (ROOT / f).is_file()]
    for folder in FOLDERS:
        base = ROOT / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if not path.is_file() or any(rel == s or rel.startswith(s + "/") for s in SKIP):
                continue
            if SKIP_NAMES.intersection(path.relative_to(ROOT).parts) or path == THIS:
                continue
            out.append(path)
    return out


def _read_text(path: pathlib.Path) -> str | None:
    """The file's text, or None for a binary file (NUL bytes or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def offending_lines(text: str) -> list[str]:
    """``"line N: <pattern name>: <line>"`` for every line of ``text`` that matches a pattern."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        line = ALLOWED.sub("", line)
        for name, pattern in PATTERNS.items():
            if pattern.search(line):
                found.append(f"line {n}: {name}: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("path", _text_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_work_item_words(path):
    text = _read_text(path)
    if text is None:
        return  # binary: nothing to read
    bad = offending_lines(text)
    assert not bad, f"{path.relative_to(ROOT)} refers to work items:\n" + "\n".join(bad)


@pytest.mark.parametrize("line", [
    "see " + "iss" + "ue 12 for the figures",
    "(Iss" + "ue #3)",
    "as in " + "#" + "12, the kernel",
    "measured in the fourth " + "sess" + "ion",
    "Sess" + "ions of work",
    "asked of hel" + "per fg",
    "(hel" + "per g4) found it",
])
def test_patterns_catch_planted_words(line):
    assert offending_lines(line), line


@pytest.mark.parametrize("line", [
    '@pytest.fixture(scope="' + "sess" + 'ion")',
    "@pytest.fixture(scope='" + "sess" + "ion')",
    "one small reduction hel" + "per per combination of sums",
    "the hel" + "pers of the kernels; a hel" + "per to build data",
    "x = a[1]  " + "#" + " 1-based",
    'colour = "' + "#" + '000000"',
    "C++ #" + "include <vector>",
    "the " + "iss" + "ue with tokens is that",
])
def test_patterns_leave_ordinary_text_alone(line):
    assert not offending_lines(line), line


def test_a_planted_word_fails_the_tree_check(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Kernels."""\n# faster since ' + "iss" + "ue 18\n", encoding="utf-8")
    assert offending_lines(_read_text(planted)) == ["line 2: issue number: # faster since " + "iss" + "ue 18"]
