"""A/B worker: ``python worker.py`` runs one build's kernels on request (JSON lines on stdin/stdout).

It is started *as a script by path* with the interpreter of the build under test, so
``pyengine`` (the registry and the kernels) is whichever build that interpreter has
installed, while the case builders and the timing code are this file's siblings, loaded
as a private package: both builds run exactly the same harness on the same arguments.
The test-only slowdown switch (``PYENGINE_BENCH_SLOWDOWN``) is read here, from this
process's environment; the driver passes it to the new build's worker only.

Requests: ``{"op": "hello"}``, ``{"op": "setup", kernel, backend, dtype, size}``,
``{"op": "calibrate"}``, ``{"op": "sample", loops, n}``, ``{"op": "quit"}``; each answer
is one JSON line, ``{"error": message}`` on failure.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import types

_HERE = pathlib.Path(__file__).resolve().parent
_PKG = "_pyengine_bench_harness"


def _harness():
    """This folder's cases / measure / stats modules, as package ``_PKG``."""
    if _PKG not in sys.modules:
        pkg = types.ModuleType(_PKG)
        pkg.__path__ = [str(_HERE)]
        sys.modules[_PKG] = pkg
    mods = {}
    for name in ("stats", "measure", "cases"):
        full = f"{_PKG}.{name}"
        if full not in sys.modules:
            spec = importlib.util.spec_from_file_location(full, _HERE / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[full] = mod
            spec.loader.exec_module(mod)
        mods[name] = sys.modules[full]
    return mods["cases"], mods["measure"]


def serve(stdin=sys.stdin, stdout=sys.stdout) -> None:
    cases_mod, m = _harness()
    from pyengine import backends

    m.steady_allocator()
    slow = m.slowdown()
    cases = cases_mod.all_cases()
    call = None
    for line in stdin:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "quit":
                break
            if op == "hello":
                avail = [n for n, i in backends.available_backends().items() if i.available]
                out = {"cases": {k: list(c.backends) for k, c in cases.items()}, "available": avail,
                       "pyengine": str(pathlib.Path(backends.__file__).parent)}
            elif op == "setup":
                case = cases[req["kernel"]]
                call, _, _ = case.setup(req["backend"], req["dtype"], tuple(req["size"]))
                call = m.slowed(call, slow.get((req["kernel"], req["backend"]), 1.0))
                call()  # warm-up: JIT compilation, page faults
                out = {"ok": True, "per_call": case.per_call}
            elif op == "calibrate":
                out = {"loops": m.calibrate(call), "multiple": getattr(call, "multiple", 1)}
            elif op == "sample":
                out = {"samples": m.sample(call, int(req["loops"]), int(req["n"]))}
            else:
                out = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # reported to the driver, which names the build and the kernel
            out = {"error": f"{type(exc).__name__}: {exc}"}
        stdout.write(json.dumps(out) + "\n")
        stdout.flush()


if __name__ == "__main__":
    serve()
