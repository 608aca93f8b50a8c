"""The registry: completeness, availability reasons, signature checks, lazy loading."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REQUIRED
from pyengine import backends


def test_every_kernel_has_a_reference():
    for kernel in backends.KERNELS:
        assert backends.resolve(kernel, "numpy").__module__.startswith("pyengine.kernels._reference.")


def test_every_available_backend_has_every_kernel():
    for name, info in backends.available_backends().items():
        if info.available:
            missing = [k for k in backends.KERNELS if (k, name) not in backends._TABLE]
            assert not missing, f"backend {name} lacks {missing}"
        else:
            assert info.reason, f"backend {name} failed to load without a reason"
            assert name not in REQUIRED, f"required backend {name} is unavailable: {info.reason}"


def test_auto_prefers_the_fastest_available():
    avail = [n for n, i in backends.available_backends().items() if i.available]
    assert backends.auto_backend("layer_norm") == avail[0]


def test_registration_rejects_a_wrong_signature():
    with pytest.raises(TypeError, match="has parameters"):
        backends.register("layer_norm", "numba")(lambda x, gamma, eps, out: 0)


def test_registration_rejects_unknown_ids():
    with pytest.raises(KeyError, match="unknown kernel id"):
        backends.register("layer_nrom", "numba")(lambda: 0)
    with pytest.raises(KeyError, match="unknown backend"):
        backends.register("layer_norm", "cuda")(lambda: 0)


def test_import_is_lazy():
    """`import pyengine` loads neither Numba nor the compiled extension."""
    code = "import sys, pyengine; print('numba' in sys.modules, 'pyengine._core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
