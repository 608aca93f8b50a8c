"""The typed stub pyengine/_core.pyi against the built extension pyengine._core.

What mypy.stubtest does, for a pybind11 module: its functions have no signature that
``inspect`` can read, but pybind11 writes every overload's signature, with types, into
the docstring (``name(a: T, ...) -> R``, numbered for overloaded functions).
:func:`check_stub` compares those with the stub, read with ``ast``: the same public
names both ways; per function the same overloads in the same order, each with the same
parameter names, types (array dtypes included), defaults and return type; and every
kernel id of the registry that ``_core`` provides has exactly a float32 and a float64
overload whose parameter names are the reference's. Wrong stubs written to ``tmp_path``
show that the check can fail.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import NamedTuple

import pytest

from conftest import require
from pyengine import backends

STUB = pathlib.Path(backends.CORE_STUB)


class Overload(NamedTuple):
    """One signature: ((name, type, has default), ...) and the return type."""

    params: tuple[tuple[str, str, bool], ...]
    returns: str

    def __str__(self) -> str:
        params = ", ".join(f"{n}: {t}{' = ...' if d else ''}" for n, t, d in self.params)
        return f"({params}) -> {self.returns}"


# ---------------------------------------------------------------------------------------
# Types, in one vocabulary for both sides: "float32[]" (an array of that dtype), "float",
# "int", "bool", "None"; anything else is kept verbatim behind "?" and never matches.

_SCALARS = {"float": "float", "int": "int", "bool": "bool", "None": "None"}
_RUNTIME_SCALARS = {
    "typing.SupportsFloat | typing.SupportsIndex": "float",  # pybind11 3: a double argument
    "typing.SupportsInt | typing.SupportsIndex": "int",  # pybind11 3: an integer argument
    **_SCALARS,
}
_RUNTIME_ARRAY = re.compile(r"numpy\.(?:typing\.NDArray|ndarray)\[numpy\.(\w+)(?:, .*)?\]")
_STUB_ARRAY = re.compile(r"(?:numpy\.typing\.|npt\.)?NDArray\[(?:np|numpy)\.(\w+)\]")


def _runtime_type(text: str) -> str:
    if text.strip().endswith(" | None"):  # an optional argument (std::optional in the bindings)
        return _runtime_type(text.strip()[: -len(" | None")]) + " | None"
    m = _RUNTIME_ARRAY.fullmatch(text.strip())
    if m:
        return f"{m.group(1)}[]"
    return _RUNTIME_SCALARS.get(text.strip(), f"?{text.strip()}")


def _stub_type(node: ast.expr | None, aliases: dict[str, ast.expr]) -> str:
    if node is None:
        return "?missing"
    if isinstance(node, ast.Name) and node.id in aliases:
        node = aliases[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr) and ast.unparse(node.right) == "None":
        return _stub_type(node.left, aliases) + " | None"  # an optional argument
    text = ast.unparse(node)
    m = _STUB_ARRAY.fullmatch(text)
    if m:
        return f"{m.group(1)}[]"
    return _SCALARS.get(text, f"?{text}")


# ---------------------------------------------------------------------------------------
# The two sides


def _split_params(text: str) -> list[str]:
    """Split "a: T[x, y], b: U" at the top-level commas."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    tail = text[start:].strip()
    return [p.strip() for p in out] + ([tail] if tail else [])


def runtime_overloads(fn) -> list[Overload]:
    """The overloads of a pybind11 function, from the signatures in its docstring."""
    sig = re.compile(rf"^(?:\d+\. )?{re.escape(fn.__name__)}\((.*)\) -> (.+)$", re.M)
    out = []
    for m in sig.finditer(fn.__doc__ or ""):
        params = []
        for p in _split_params(m.group(1)):
            name, _, rest = p.partition(": ")
            typ, eq, _default = rest.partition(" = ")
            params.append((name, _runtime_type(typ), bool(eq)))
        out.append(Overload(tuple(params), _runtime_type(m.group(2))))
    return out


def read_stub(path: pathlib.Path) -> tuple[set[str], dict[str, list[Overload]], list[str]]:
    """(public names, {function: overloads}, problems of form) of a stub file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases: dict[str, ast.expr] = {}
    names: set[str] = set()
    funcs: dict[str, list[Overload]] = {}
    decorated: dict[str, list[bool]] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            aliases[node.target.id] = node.value
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    aliases[target.id] = node.value
                    names.add(target.id)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
            a = node.args
            if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs:
                params = (("?unsupported", "?", False),)
            else:
                n_plain = len(a.args) - len(a.defaults)
                params = tuple(
                    (p.arg, _stub_type(p.annotation, aliases), i >= n_plain)
                    for i, p in enumerate(a.args)
                )
            funcs.setdefault(node.name, []).append(
                Overload(params, _stub_type(node.returns, aliases))
            )
            decorated.setdefault(node.name, []).append(
                any(ast.unparse(d) in ("overload", "typing.overload") for d in node.decorator_list)
            )
    problems = []
    for name, flags in decorated.items():
        if len(flags) > 1 and not all(flags):
            problems.append(f"{name}: {len(flags)} definitions, not all @overload")
        if len(flags) == 1 and flags[0]:
            problems.append(f"{name}: a single @overload")
    return {n for n in names if not n.startswith("_")}, funcs, problems


def check_stub(module, path: pathlib.Path) -> list[str]:
    """Every way in which the stub at ``path`` disagrees with ``module``; [] if none."""
    public, stub, problems = read_stub(path)
    runtime = {n for n in dir(module) if not n.startswith("_")}
    problems += [f"{n}: in {module.__name__}, not in the stub" for n in sorted(runtime - public)]
    problems += [f"{n}: in the stub, not in {module.__name__}" for n in sorted(public - runtime)]
    for name in sorted(runtime & set(stub)):
        got, want = stub[name], runtime_overloads(getattr(module, name))
        if not want:
            problems.append(f"{name}: no signature in its docstring")
        elif len(got) != len(want):
            problems.append(f"{name}: {len(got)} overloads in the stub, {len(want)} in the module")
        for k, (g, w) in enumerate(zip(got, want), 1):
            if g != w:
                problems.append(f"{name}: overload {k} is {g} in the stub, {w} in the module")
    for kernel in backends.KERNELS:
        if kernel not in stub or not hasattr(module, kernel):
            continue
        ref = backends._param_names(backends.resolve(kernel, "numpy"))
        overloads = stub[kernel]
        dtypes = [o.params[0][1] if o.params else "?" for o in overloads]
        if dtypes != ["float32[]", "float64[]"]:
            problems.append(f"{kernel}: overloads for {dtypes}, not float32 then float64")
        for o in overloads:
            if tuple(p[0] for p in o.params) != ref:
                problems.append(f"{kernel}: parameters {[p[0] for p in o.params]}, reference {ref}")
    return problems


# ---------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def core():
    require("cpp")
    from pyengine import _core

    return _core


def test_the_stub_matches_the_module(core):
    assert check_stub(core, STUB) == []


@pytest.mark.parametrize("kernel", backends.KERNELS)
def test_kernel_overloads_carry_the_reference_names(core, kernel):
    """float32 and float64 overloads, named as the reference, in the stub and in _core."""
    ref = backends._param_names(backends.resolve(kernel, "numpy"))
    runtime = runtime_overloads(getattr(core, kernel))
    _, stub, _ = read_stub(STUB)
    assert [o.params[0][1] for o in runtime] == ["float32[]", "float64[]"]
    assert [o.params[0][1] for o in stub[kernel]] == ["float32[]", "float64[]"]
    for o in (*runtime, *stub[kernel]):
        assert tuple(p[0] for p in o.params) == ref
    # ... and the registry's check reads the same names from the stub.
    assert backends._param_names(getattr(core, kernel)) == ref


def test_the_stub_is_next_to_the_registry():
    """Installed with the package (wheel.packages ships pyengine/, the .pyi included)."""
    assert STUB.is_file() and STUB.parent == pathlib.Path(backends.__file__).parent
    assert STUB.name == "_core.pyi"


def _ov(*lines: str) -> str:
    return "".join(f"@overload\n{line}\n" for line in lines)


#: Wrong stubs: (id, text of the stub, its replacement, the function the report must
#: name). An empty text appends the replacement.
WRONG = [
    ("renamed-parameter", "def layer_norm_jvp(x: _F32, v: _F32", "def layer_norm_jvp(x: _F32, w: _F32",
     "layer_norm_jvp"),
    ("swapped-parameters", "gamma: _F64, beta: _F64", "beta: _F64, gamma: _F64", "layer_norm"),
    ("missing-overload", _ov("def gelu(x: _F64, out: _F64) -> int: ..."), "", "gelu"),
    ("missing-function", _ov("def relu(x: _F32, out: _F32) -> int: ...", "def relu(x: _F64, out: _F64) -> int: ..."),
     "", "relu"),
    ("extra-function", "", "def attention(q: _F32, out: _F32) -> int: ...\n", "attention"),
    ("wrong-dtype", "def softmax(x: _F64, offset: int, out: _F64)", "def softmax(x: _F64, offset: int, out: _F32)",
     "softmax"),
    ("wrong-scalar", "def rms_norm(x: _F32, gamma: _F32, eps: float", "def rms_norm(x: _F32, gamma: _F32, eps: int",
     "rms_norm"),
    ("wrong-return", "def get_num_threads() -> int", "def get_num_threads() -> None", "get_num_threads"),
    ("int32-iterations", "iterations: _I64", "iterations: NDArray[np.int32]", "layer_norm_power_iteration"),
    ("swapped-overloads", _ov("def silu_gated(u: _F32, out: _F32) -> int: ...", "def silu_gated(u: _F64, out: _F64) -> int: ..."),
     _ov("def silu_gated(u: _F64, out: _F64) -> int: ...", "def silu_gated(u: _F32, out: _F32) -> int: ..."), "silu_gated"),
    ("default-added", "def softmax(x: _F32, offset: int, out: _F32)", "def softmax(x: _F32, offset: int, out: _F32 = ...)",
     "softmax"),
    ("missing-overload-decorator", "@overload\ndef relu_grad(x: _F32", "def relu_grad(x: _F32", "relu_grad"),
]  # fmt: skip


@pytest.mark.parametrize("old, new, name", [w[1:] for w in WRONG], ids=[w[0] for w in WRONG])
def test_a_wrong_stub_is_caught(core, tmp_path, old, new, name):
    text = STUB.read_text(encoding="utf-8")
    assert not old or old in text, "the mutation no longer applies to the stub; update it"
    wrong = text.replace(old, new, 1) if old else text + new
    path = tmp_path / "_core.pyi"
    path.write_text(wrong, encoding="utf-8")
    problems = check_stub(core, path)
    assert problems and any(p.startswith(f"{name}:") for p in problems), problems
