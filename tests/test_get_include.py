"""Downstream C++ can build on pyengine's headers (pyengine.get_include())."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

import pyengine as pe

PROGRAM = r"""
#include <cstdio>
#include <pyengine/layernorm.hpp>
int main() {
    const double x[6] = {1.0, 2.0, 4.0, -1.0, 0.5, 3.0};
    const double gamma[3] = {1.0, 2.0, 0.5}, beta[3] = {0.0, 0.1, -0.2};
    double out[6];
    long long bad = pyengine::layer_norm<double>(x, gamma, beta, 1e-5, 2, 3, out);
    for (double v : out) std::printf("%.17g\n", v);
    return bad == 0 ? 0 : 1;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) on PATH")
def test_headers_compile_and_agree_with_the_reference(tmp_path):
    src = tmp_path / "use_pyengine.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "use_pyengine"
    subprocess.run(
        ["g++", "-std=c++17", "-O2", "-fopenmp", "-I", pe.get_include(), str(src), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, env=dict(os.environ))
    got = np.array(out.stdout.split(), dtype=np.float64).reshape(2, 3)
    x = np.array([[1.0, 2.0, 4.0], [-1.0, 0.5, 3.0]])
    want = pe.layer_norm(x, [1.0, 2.0, 0.5], [0.0, 0.1, -0.2], backend="numpy")
    np.testing.assert_allclose(got, want, rtol=1e-14)
