"""The API reference (docs/api/*.rst) lists every public name of pyengine and its subpackages.

The reST sources are parsed directly (no Sphinx needed): every entry of an ``autosummary``
directive with a ``:toctree:`` option (the entries that get a page of their own), qualified
by the module set before it (``module``, ``currentmodule`` or ``automodule``), counts as
documented; a table without ``:toctree:`` only links to pages made elsewhere. A name re-exported from another module counts when
the same function or class is documented under either name.
"""

from __future__ import annotations

import __future__
import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

API_DIR = Path(__file__).resolve().parents[1] / "docs" / "api"

#: The modules whose public names the reference must cover.
MODULES = (
    "pyengine",
    "pyengine.analysis",
    "pyengine.experiments",
    "pyengine.models",
    "pyengine.linalg",
    "pyengine.distributed",
    "pyengine.kernels",
    "pyengine.backends",
    "pyengine.bench",
    "pyengine.corpus",
    "pyengine.provenance",
    "pyengine.analysis.linear_model",
    "pyengine.analysis.positions_model",
    "pyengine.experiments.stability_descent",
    "pyengine.models.tl_names",
    "pyengine.models.activation_cache",
)

_MODULE_DIRECTIVE = re.compile(r"^\.\. (?:module|currentmodule|automodule)::\s*(\S+)\s*$")
_AUTOSUMMARY = re.compile(r"^(\s*)\.\. autosummary::\s*$")


def public_names(module: types.ModuleType) -> list[str]:
    """``__all__``, or else the names the module binds that are not private, modules or futures."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [name for name, value in vars(module).items()
            if not name.startswith("_")
            and not isinstance(value, (types.ModuleType, __future__._Feature))]


def autosummary_entries(text: str) -> set[str]:
    """Fully qualified names of the entries of one reST source's ``:toctree:`` autosummaries."""
    current = ""
    found: set[str] = set()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if m := _MODULE_DIRECTIVE.match(line):
            current = "" if m.group(1) == "None" else m.group(1)
            continue
        if not (m := _AUTOSUMMARY.match(line)):
            continue
        indent = len(m.group(1))
        entries, has_page = set(), False
        while i < len(lines):
            entry = lines[i]
            stripped = entry.strip()
            if stripped and len(entry) - len(entry.lstrip()) <= indent:
                break  # the directive's content ends at the first line not indented under it
            i += 1
            if stripped.startswith(":toctree:"):
                has_page = True
            if not stripped or stripped.startswith(":"):
                continue  # blank line or directive option
            name = stripped.split()[0].lstrip("~")
            entries.add(name if not current or name.startswith("pyengine.") else f"{current}.{name}")
        if has_page:
            found |= entries
    return found


def documented_names(api_dir: Path = API_DIR) -> set[str]:
    """Every autosummary entry of the hand-written sources (not the generated stubs)."""
    sources = [p for p in api_dir.rglob("*.rst") if "generated" not in p.relative_to(api_dir).parts]
    assert sources, f"no reST sources under {api_dir}"
    names: set[str] = set()
    for path in sources:
        names |= autosummary_entries(path.read_text(encoding="utf-8"))
    return names


def _resolve(qualname: str):
    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def missing_names(module_name: str, documented: set[str]) -> list[str]:
    """Public names of ``module_name`` that no autosummary entry documents."""
    module = importlib.import_module(module_name)
    same_object = {id(obj) for obj in map(_resolve, documented)
                   if inspect.isclass(obj) or inspect.isroutine(obj)}
    missing = []
    for name in public_names(module):
        if f"{module_name}.{name}" in documented:
            continue
        obj = getattr(module, name)
        if (inspect.isclass(obj) or inspect.isroutine(obj)) and id(obj) in same_object:
            continue  # a re-export, documented under the name of the module it comes from
        missing.append(name)
    return missing


@pytest.mark.parametrize("module_name", MODULES)
def test_api_reference_lists_every_public_name(module_name):
    missing = missing_names(module_name, documented_names())
    assert not missing, f"docs/api does not list these public names of {module_name}: {missing}"


def test_autosummary_parser_reads_modules_options_and_block_ends():
    # tokenized_corpus is only in a table of links (no :toctree:): it has no page, so it is not read.
    text = """
Title
=====

.. module:: pyengine

.. autosummary::
   :toctree: generated/

   layer_norm
   ~pyengine.linalg.spectral_norm

Not an entry.

.. currentmodule:: pyengine.corpus

.. autosummary::
   :toctree: generated/

   load_corpus

.. autosummary::

   tokenized_corpus
"""
    assert autosummary_entries(text) == {
        "pyengine.layer_norm", "pyengine.linalg.spectral_norm", "pyengine.corpus.load_corpus"}


def test_missing_names_reports_an_undocumented_name():
    documented = {"pyengine.corpus.load_corpus", "pyengine.corpus.CORPUS_LICENSE"}
    assert missing_names("pyengine.corpus", documented) == ["tokenized_corpus"]
    # A re-export counts through its object: pyengine.kernels.layer_norm is pyengine.layer_norm.
    assert "layer_norm" not in missing_names("pyengine.kernels", {"pyengine.layer_norm"})
    assert "layer_norm_jvp" in missing_names("pyengine.kernels", {"pyengine.layer_norm"})
