"""Sphinx configuration of pyengine's documentation site.

Build (warnings are errors; the gallery's examples run during the build):

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os

# The gallery's examples draw their figures off-screen (no display on a build machine).
os.environ.setdefault("MPLBACKEND", "Agg")

import pyengine  # noqa: E402

project = "pyengine"
author = "The pyengine developers"
copyright = "pyengine developers"
version = release = pyengine.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]
# No intersphinx: the build needs no network.

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
templates_path = ["_templates"]

# API reference: one generated page per public name (docs/api/generated/, git-ignored).
autosummary_generate = True
autosummary_imported_members = False
autodoc_typehints = "none"  # the numpydoc Parameters sections carry shapes and dtypes
autodoc_default_options = {"member-order": "bysource"}

# numpydoc: members are listed by the autosummary class template, not a second time.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",  # run every plot_*.py
    "abort_on_example_error": True,  # a failing example fails the build
    "only_warn_on_example_error": False,
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "image_scrapers": ("matplotlib",),
    "within_subsection_order": "FileNameSortKey",
}

html_theme = "pydata_sphinx_theme"
html_title = f"pyengine {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path: list[str] = []


def _attr_comment(modname: str, attr: str, depth: int = 0) -> list[str]:
    """The ``#:`` comment of a module-level name, following ``from .x import name`` re-exports."""
    import ast
    import importlib
    import importlib.util

    from sphinx.pycode import ModuleAnalyzer

    analyzer = ModuleAnalyzer.for_module(modname)
    found = analyzer.find_attr_docs().get(("", attr))
    if found or depth > 3:
        return list(found or [])
    for node in ast.walk(ast.parse(analyzer.code)):
        if isinstance(node, ast.ImportFrom) and any(a.name == attr and a.asname is None for a in node.names):
            package = importlib.import_module(modname).__package__
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            return _attr_comment(source, attr, depth + 1)
    return []


def _constant_docstring(app, what, name, obj, options, lines):
    """A re-exported constant gets the ``#:`` comment where it is defined, never its type's docstring."""
    if what != "data":
        return
    if " ".join(" ".join(lines).split()) != " ".join((type(obj).__doc__ or "").split()):
        return
    modname, _, attr = name.rpartition(".")
    lines[:] = _attr_comment(modname, attr)


def setup(app):
    # Before numpydoc's own handler (priority 500), which would reformat the type's docstring.
    app.connect("autodoc-process-docstring", _constant_docstring, priority=400)
