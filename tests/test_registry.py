"""The registry: completeness, availability reasons, signature checks, lazy loading."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from conftest import REQUIRED, require
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


def test_cpp_parameter_names_come_from_the_stub(tmp_path):
    """pybind11 functions have no inspectable signature: the registry reads _core.pyi."""
    require("cpp")
    from pyengine import _core

    assert backends._param_names(_core.layer_norm_jvp) == ("x", "v", "gamma", "eps", "frozen", "out")
    text = pathlib.Path(backends.CORE_STUB).read_text(encoding="utf-8")
    both = tmp_path / "both.pyi"
    both.write_text(text.replace("(x: _F32, v: _F32", "(x: _F32, w: _F32").replace("(x: _F64, v: _F64", "(x: _F64, w: _F64"))
    assert backends._param_names(_core.layer_norm_jvp, both)[1] == "w"
    one = tmp_path / "one.pyi"
    one.write_text(text.replace("def layer_norm_jvp(x: _F32, v: _F32", "def layer_norm_jvp(x: _F32, w: _F32"))
    with pytest.raises(TypeError, match="differ in their parameter names"):
        backends._param_names(_core.layer_norm_jvp, one)
    empty = tmp_path / "empty.pyi"
    empty.write_text("")
    with pytest.raises(TypeError, match="not in its stub"):
        backends._param_names(_core.layer_norm_jvp, empty)


def test_registration_rejects_a_cpp_kernel_with_other_names():
    require("cpp")
    from pyengine import _core

    before = dict(backends._TABLE)
    with pytest.raises(TypeError, match="has parameters"):
        backends.register("layer_norm", "cpp")(_core.rms_norm)
    assert backends._TABLE == before


def test_an_unreadable_stub_is_an_import_error(tmp_path):
    """So that a wheel without its stub reports the cpp backend unavailable, with the reason."""
    with pytest.raises(ImportError, match="cannot be read"):
        backends.stub_signatures(tmp_path / "absent.pyi")


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


THREAD_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")


def _clean_env(**user: str) -> dict[str, str]:
    """This environment without the thread-pool variables, plus ``user``'s."""
    import os

    return {k: v for k, v in os.environ.items() if k not in THREAD_ENV} | user


def test_import_sets_no_environment_variable():
    """`import pyengine` in a bare environment (only the path to the package) leaves it unchanged."""
    root = str(pathlib.Path(backends.__file__).resolve().parents[1])
    code = "import os; before = dict(os.environ); import pyengine; print(dict(os.environ) == before)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": root})
    assert out.stdout.split() == ["True"]


@pytest.mark.parametrize(
    ("user", "want"),
    [
        ({}, "10000"),  # the command's default
        ({"OMP_WAIT_POLICY": "PASSIVE"}, None),  # a user's wait policy: no spin count added
        ({"GOMP_SPINCOUNT": "0"}, "0"),  # a user's setting wins
    ],
)
def test_the_command_sets_the_spin_count_before_libgomp_loads(user, want):
    """`pyengine ...` sets libgomp's spin count (tuned_environment) while neither the extension
    nor Numba, which load libgomp, is loaded; OPENBLAS_THREAD_TIMEOUT is left to the user."""
    code = ("import os, sys; from pyengine import cli; loaded = 'pyengine._core' in sys.modules or 'numba' in "
            "sys.modules; cli.main(['backends']); print(loaded, os.environ.get('GOMP_SPINCOUNT'), "
            "os.environ.get('OPENBLAS_THREAD_TIMEOUT'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=_clean_env(**user))
    assert out.stdout.splitlines()[-1].split() == ["False", str(want), "None"]


@pytest.mark.parametrize(
    ("user", "want"),
    [
        ({}, {"GOMP_SPINCOUNT": "10000", "OPENBLAS_THREAD_TIMEOUT": "20"}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OPENBLAS_THREAD_TIMEOUT": "20"}),
        ({"GOMP_SPINCOUNT": "0", "OPENBLAS_THREAD_TIMEOUT": "4"}, {}),
    ],
)
def test_tuned_environment_leaves_out_what_the_user_set(user, want):
    from pyengine.bench import tuned_environment

    assert tuned_environment(user) == want
