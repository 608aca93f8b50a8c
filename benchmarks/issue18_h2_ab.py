"""A/B of the C++ norm kernels of two commits, interleaved in one process (issue 18, h2).

    python benchmarks/issue18_h2_ab.py [OLD_REF [NEW_REF]]     (defaults: main, HEAD)

Builds, for each ref, a small extension with only the LayerNorm/RMSNorm bindings from
``git archive REF csrc`` (g++ -O3 -march=native -fopenmp, as CMakeLists.txt), loads both
under different module names and times the raw kernels call by call, alternating, so
that load on the machine hits both alike. Prints medians and the ratio old/new (> 1:
NEW is faster). Run from the repository root with the project's venv active.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

SRC = 'PYBIND11_MODULE({name}, m) {{ pyengine::bind::register_layernorm(m); m.def("set_threads", &pyengine::set_num_threads); }}\n'


def build(ref: str, name: str, root: Path):
    d = root / name
    d.mkdir()
    subprocess.run(f"git archive {ref} csrc | tar -x -C {d}", shell=True, check=True)
    (d / "mod.cpp").write_text('#include "bind_layernorm.hpp"\n' + SRC.format(name=name))
    inc = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], capture_output=True, text=True,
                         check=True).stdout.split()
    so = d / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-std=gnu++17", "-shared", "-fPIC", *inc,
                    f"-I{d / 'csrc'}", str(d / "mod.cpp"), "-o", str(so)], check=True)
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    old_ref, new_ref = (sys.argv[1:] + ["main", "HEAD"])[:2] if len(sys.argv) > 1 else ("main", "HEAD")
    root = Path(tempfile.mkdtemp(prefix="h2ab"))
    old, new = build(old_ref, "_core_a", root), build(new_ref, "_core_b", root)
    rng = np.random.default_rng(0)

    def ab(label, mk, reps):
        fo, fn = mk(old), mk(new)
        fo(), fn()
        to, tn = [], []
        for _ in range(reps):
            t = time.perf_counter(); fo(); to.append(time.perf_counter() - t)  # noqa: E702
            t = time.perf_counter(); fn(); tn.append(time.perf_counter() - t)  # noqa: E702
        mo, mn = statistics.median(to), statistics.median(tn)
        print(f"{label:34s} {old_ref} {mo * 1e6:9.1f} us  {new_ref} {mn * 1e6:9.1f} us  "
              f"old/new {mo / mn:.2f} (minima {min(to) / min(tn):.2f})", flush=True)

    for nt in (1, 2):
        old.set_threads(nt), new.set_threads(nt)
        for n, d in ((2048, 768), (512, 4096)):
            x = (1 + rng.standard_normal((n, d))).astype(np.float32)
            v = rng.standard_normal((n, d)).astype(np.float32)
            g = rng.uniform(0.5, 1.5, d).astype(np.float32)
            b = rng.standard_normal(d).astype(np.float32)
            o = np.empty_like(x)
            ab(f"layer_norm ({n},{d}) alloc t{nt}", lambda m: lambda: m.layer_norm(x, g, b, 1e-5, np.empty_like(x)), 400)
            ab(f"layer_norm_jvp ({n},{d}) t{nt}", lambda m: lambda: m.layer_norm_jvp(x, v, g, 1e-5, False, o), 300)
            ab(f"layer_norm_vjp ({n},{d}) t{nt}", lambda m: lambda: m.layer_norm_vjp(x, v, g, 1e-5, False, o), 300)
            ab(f"rms_norm ({n},{d}) t{nt}", lambda m: lambda: m.rms_norm(x, g, 1e-5, o), 300)
            ab(f"rms_norm_jvp ({n},{d}) t{nt}", lambda m: lambda: m.rms_norm_jvp(x, v, g, 1e-5, False, o), 300)
    x1 = rng.standard_normal((1, 768)).astype(np.float32)
    g1, b1, o1 = np.ones(768, np.float32), np.zeros(768, np.float32), np.empty_like(x1)
    ab("layer_norm (1,768) x200", lambda m: lambda: [m.layer_norm(x1, g1, b1, 1e-5, o1) for _ in range(200)], 200)


if __name__ == "__main__":
    main()
