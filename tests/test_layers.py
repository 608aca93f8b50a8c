"""The layering of the package, read from its source with ``ast`` (nothing is imported).

Rules (README, Layout): the root modules (and private root packages such as
``_validate/``) are the foundation every layer may use; each
folder is a layer and imports only the foundation and the layers below it
(kernels < linalg, models < analysis < experiments < distributed < cli: the sweep layer
sits above the experiments whose jobs it runs); siblings of one rank do not import each
other; no library module imports the CLI, not even for annotations or by name
(``importlib.import_module``); there are no import cycles, imports under
``if TYPE_CHECKING:`` included (only the rank and private-name rules skip them); and no module
imports a private name (``_x``) or a private module from another layer.
``pyengine/__init__.py`` and ``__main__.py`` sit above every layer: they gather the public names.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pyengine"

#: Folder -> rank. Root modules are rank 0 (foundation); the package's __init__ and
#: __main__ are above everything.
RANKS = {"kernels": 1, "linalg": 2, "models": 2, "analysis": 3, "experiments": 4, "distributed": 4.5, "cli": 5}
TOP = 99


def _modules(root: pathlib.Path, pkg: str) -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([pkg, *parts])] = path
    return out


def _layer(mod: str, pkg: str) -> tuple[str, float]:
    """(layer name, rank) of a module: its first folder below the package, or the root."""
    parts = mod.split(".")[1:]
    if not parts or parts == ["__main__"]:
        return "<top>", TOP
    if parts[0] in RANKS:
        return parts[0], RANKS[parts[0]]
    if len(parts) == 1 or parts[0].startswith("_"):  # a root module, or a private root package
        return "<foundation>", 0
    raise AssertionError(f"{mod}: folder {parts[0]!r} is not a known layer; add it to RANKS and the README")


def _in_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(mod: str, path: pathlib.Path, known: set[str], pkg: str):
    """Yield (lineno, target module, imported name or None, type only?) for every import of the package."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            # importlib.import_module("pkg.x") / __import__("pkg.x"): an import by name
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            name = node.args[0].value
            if func in ("import_module", "__import__") and isinstance(name, str) and (
                    name == pkg or name.startswith(pkg + ".")):
                yield node.lineno, name, None, False
            continue
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        typing_only = _in_type_checking(node, parents)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == pkg or alias.name.startswith(pkg + "."):
                    yield node.lineno, alias.name, None, typing_only
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == pkg or target.startswith(pkg + ".")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:  # `from . import module`
                    yield node.lineno, sub, None, typing_only
                else:
                    yield node.lineno, target, alias.name, typing_only


#: (module, imported module) pairs exempt from the rank and private-name rules, each with its
#: reason. The A/B bench loads its own measure.py against an older build of the package, whose
#: registry has no public way to reach the "cpp" backend's module.
EXEMPT = {("pyengine._bench.measure", "pyengine.kernels._cpp"):
          "an older build under A/B has no backends.backend_module"}


def check_layers(root: pathlib.Path = PACKAGE, pkg: str = "pyengine") -> list[str]:
    """Every violation of the layering rules in the tree at ``root``, one line each."""
    mods = _modules(root, pkg)
    known = set(mods) | {f"{pkg}._core"}
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        name, rank = _layer(mod, pkg)
        for line, target, imported, typing_only in _imports(mod, path, known, pkg):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target not in known:
                problems.append(f"{where}: imports {target}, which does not exist")
                continue
            tname, trank = _layer(target, pkg)
            if target in mods and target != mod:
                graph[mod].add(target)
            if tname == "cli" and name not in ("cli", "<top>"):
                problems.append(f"{where}: {name} imports {target}: no library module imports the CLI")
            if tname == name or typing_only or (mod, target) in EXEMPT:  # annotations may name any layer;
                continue                                                      # cycles still count
            if trank > rank or (trank == rank and tname != name):
                problems.append(f"{where}: {name} (rank {rank}) imports {target} from {tname} (rank {trank})")
            private_module = any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[1:])
            private_name = imported is not None and imported.startswith("_") and not imported.startswith("__")
            if (private_module and target != f"{pkg}._core" and tname != "<foundation>") or private_name:
                what = f"{target}.{imported}" if private_name else target
                problems.append(f"{where}: {name} uses {what}, a private name of {tname}")
    problems = list(dict.fromkeys(problems))
    # Cycles (depth-first search; report each cycle once, by its smallest rotation).
    seen_cycles: set[tuple[str, ...]] = set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cyc = stack[stack.index(t):]
                i = cyc.index(min(cyc))
                key = tuple(cyc[i:] + cyc[:i])
                if key not in seen_cycles:
                    seen_cycles.add(key)
                    problems.append("import cycle: " + " -> ".join(key + (key[0],)))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return problems


#: The one module that imports the compiled extension; every other module reaches it through
#: the registry and this module's public functions.
CORE_OWNER = "kernels._cpp"


def check_core_imports(root: pathlib.Path = PACKAGE, pkg: str = "pyengine") -> list[str]:
    """Every import of ``<pkg>._core`` outside ``<pkg>.kernels._cpp``, one line each."""
    mods = _modules(root, pkg)
    known = set(mods) | {f"{pkg}._core"}
    return [f"{path.relative_to(root.parent)}:{line}: imports {pkg}._core (only {pkg}.{CORE_OWNER} may)"
            for mod, path in mods.items() if mod != f"{pkg}.{CORE_OWNER}"
            for line, target, _, _ in _imports(mod, path, known, pkg) if target == f"{pkg}._core"]


def test_only_the_cpp_backend_imports_the_extension():
    problems = check_core_imports()
    assert not problems, "imports of the extension:\n" + "\n".join(problems)


@pytest.mark.parametrize("text", ["from .. import _core\n", "def f():\n    from pkg import _core as core\n",
                                  "import pkg._core\n"])
def test_the_extension_checker_finds_an_import(tmp_path, text):
    files = dict(BASE, **{"kernels/_cpp.py": "from .. import _core\n", "kernels/k.py": text})
    assert check_core_imports(_tree(tmp_path, files), "pkg") == [f"pkg/kernels/k.py:{text.count(chr(10))}: "
                                                               "imports pkg._core (only pkg.kernels._cpp may)"]


def test_package_is_layered():
    problems = check_layers()
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_every_folder_is_a_layer():
    """Every public folder is a layer; a private root folder (``_validate/``) belongs to the foundation."""
    folders = {p.name for p in PACKAGE.iterdir()
               if p.is_dir() and (p / "__init__.py").exists() and not p.name.startswith("_")}
    assert folders <= set(RANKS), f"folders that are no layer: {sorted(folders - set(RANKS))}"


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


BASE = {
    "__init__.py": "from .kernels import k\n",
    "backends.py": "",
    "kernels/__init__.py": "",
    "kernels/k.py": "from .. import backends\n",
    "linalg/__init__.py": "",
    "models/__init__.py": "",
    "cli/__init__.py": "from ..kernels import k\n",
}


def test_checker_accepts_a_clean_tree(tmp_path):
    assert check_layers(_tree(tmp_path, BASE), "pkg") == []


@pytest.mark.parametrize(
    "rel, text, expect",
    [
        ("kernels/bad.py", "from ..cli import main\n", "kernels (rank 1) imports pkg.cli from cli (rank 5)"),
        ("kernels/bad.py", "import pkg.linalg\n", "imports pkg.linalg from linalg"),
        ("linalg/bad.py", "def f():\n    from ..models import x\n", "linalg (rank 2) imports pkg.models from models (rank 2)"),
        ("linalg/bad.py", "from ..kernels.k import _secret\n", "uses pkg.kernels.k._secret, a private name of kernels"),
        ("linalg/bad.py", "from ..kernels import _private_mod\n", "a private name of kernels"),
        ("kernels/a.py", "from . import b\n", "import cycle: pkg.kernels.a -> pkg.kernels.b -> pkg.kernels.a"),
        ("kernels/c.py", "from .nothere import x\n", "imports pkg.kernels.nothere, which does not exist"),
    ],
)
def test_checker_finds_each_kind_of_violation(tmp_path, rel, text, expect):
    files = dict(BASE)
    files[rel] = text
    if rel == "kernels/a.py":
        files["kernels/b.py"] = "from . import a\n"
    if rel == "kernels/bad.py" and "_private_mod" in text:
        files["kernels/_private_mod.py"] = ""
    problems = check_layers(_tree(tmp_path, files), "pkg")
    assert any(expect in p for p in problems), problems


def test_checker_accepts_dunder_names(tmp_path):
    """``from .._version import __version__``: a dunder name is public, a private foundation module may be used."""
    files = {**BASE, "_version.py": "__version__ = '1'\n", "cli/v.py": "from .._version import __version__\n"}
    assert check_layers(_tree(tmp_path, files), "pkg") == []


def test_type_checking_imports_may_name_a_higher_layer(tmp_path):
    files = dict(BASE)
    files["kernels/ok.py"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..linalg import x\n"
    files["linalg/x.py"] = ""
    assert check_layers(_tree(tmp_path, files), "pkg") == []


@pytest.mark.parametrize(
    "text",
    ["from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cli import main\n",
     "import importlib\ndef f():\n    return importlib.import_module('pkg.cli')\n",
     "def f():\n    import pkg.cli\n"],
    ids=["type-only", "by-name", "lazy"],
)
def test_checker_finds_a_library_module_that_imports_the_cli(tmp_path, text):
    files = dict(BASE)
    files["linalg/bad.py"] = text
    problems = check_layers(_tree(tmp_path, files), "pkg")
    assert any("linalg imports pkg.cli: no library module imports the CLI" in p for p in problems), problems


def test_checker_finds_a_cycle_through_type_checking_imports(tmp_path):
    files = dict(BASE)
    files["kernels/a.py"] = "from . import b\n"
    files["kernels/b.py"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
    problems = check_layers(_tree(tmp_path, files), "pkg")
    assert "import cycle: pkg.kernels.a -> pkg.kernels.b -> pkg.kernels.a" in problems, problems
