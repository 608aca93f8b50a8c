"""How an output was made: the ``provenance`` block of every JSON file pyengine writes.

:func:`provenance` gathers, as plain JSON values: the package version and, when pyengine
runs from a git checkout, its commit; the command line; the seeds; the model's name, its
architecture (a pretrained model's family) and the SHA-256 of each of its weight files; the
dtype; the backend asked for and which backends load; the BLAS behind the products (as
``pyengine backends`` reports it); the thread counts; the time (UTC) and the machine.
Gathering it never raises for lack of git, of ``/proc/cpuinfo`` or of the compiled
extension: such a field is ``None`` or says why.

Foundation module: it imports only other root modules, and those lazily.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ._version import __version__

__all__ = ["KEYS", "file_hashes", "file_sha256", "git_commit", "machine", "provenance", "weight_files"]

#: The keys of every provenance block, in order (``extra`` is added only when given).
KEYS = ("version", "git_commit", "argv", "seeds", "model", "architecture", "weights_sha256", "dtype", "backend",
        "blas", "threads", "time_utc", "machine")

#: Bytes read at a time when hashing a weight file.
CHUNK = 1 << 20

#: File endings of weight files in a model folder (:func:`weight_files`).
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin", ".pt", ".pth")

#: Seconds ``git rev-parse`` may take before the commit is reported as unknown.
GIT_TIMEOUT = 2.0

_HASHES: dict[tuple[str, int, int], str] = {}  # (real path, size, mtime_ns) -> hex digest


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of the file at ``path``, read in 1 MiB chunks.

    Cached in this process by (real path, size, modification time): a file hashed once is
    not read again unless it changed. Raises OSError if the file cannot be read.
    """
    real = os.path.realpath(os.fspath(path))
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(real, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def weight_files(source: str | os.PathLike[str] | None) -> list[str]:
    """The weight files of a model ``source``: the file itself, or a folder's files ending in
    one of :data:`WEIGHT_SUFFIXES` (sorted); ``[]`` for ``None`` or a path that does not exist."""
    if source is None:
        return []
    path = os.fspath(source)
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return [os.path.join(path, f) for f in sorted(os.listdir(path))
                if f.endswith(WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(path, f))]
    return []


@functools.lru_cache(maxsize=None)
def git_commit(folder: str | None = None) -> str | None:
    """The commit checked out in the git work tree ``folder`` (default: the folder that holds
    the ``pyengine`` package), or None when it is no git checkout, git is missing, or git
    does not answer within :data:`GIT_TIMEOUT` seconds. Never raises."""
    if folder is None:
        folder = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(folder, ".git")):  # an installed package: no checkout
        return None
    try:
        out = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=GIT_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) in (40, 64) else None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


@functools.lru_cache(maxsize=None)
def _machine() -> tuple[tuple[str, Any], ...]:
    import numpy as np

    return (("platform", platform.platform()), ("processor", _cpu_model()), ("cpus", os.cpu_count()),
            ("python", platform.python_version()), ("numpy", np.__version__))


def machine() -> dict[str, Any]:
    """Platform, CPU model (``/proc/cpuinfo`` where it exists), CPU count, Python and NumPy versions."""
    return dict(_machine())


def _blas_libraries() -> list[dict[str, Any]]:
    """threadpoolctl's view of the BLAS libraries loaded: API, version, threads, file name."""
    try:
        import threadpoolctl

        infos = threadpoolctl.threadpool_info()
    except Exception as exc:  # threadpoolctl inspects loaded libraries; never lose an output to it
        return [{"error": f"{type(exc).__name__}: {exc}"}]
    return [{"internal_api": i.get("internal_api"), "version": i.get("version"),
             "threading_layer": i.get("threading_layer"), "num_threads": i.get("num_threads"),
             "library": os.path.basename(i.get("filepath") or "")}
            for i in infos if i.get("user_api") == "blas"]


def _backends(requested: str | None) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(backend block, the C++ products' BLAS, pyengine's thread count)."""
    from . import backends

    avail = backends.available_backends()
    block = {"requested": requested if requested is not None else "auto",
             "available": [n for n, i in avail.items() if i.available],
             "unavailable": {n: i.reason for n, i in avail.items() if not i.available}}
    if avail["cpp"].available:
        products = str(backends.backend_module("cpp").linear_blas_info())
    else:
        products = f"cpp backend unavailable ({avail['cpp'].reason})"
    return block, {"cpp_products": products}, int(backends.get_num_threads())


def _plain(x: Any) -> Any:
    """JSON values: tuples and sets as lists, NumPy scalars and arrays as Python values."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_plain(v) for v in x]
    if hasattr(x, "tolist"):  # NumPy arrays and scalars
        return _plain(x.tolist())
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    return x


def file_hashes(files: Iterable[str | os.PathLike[str]]) -> dict[str, str | None]:
    """{file name: SHA-256 hex digest, or None if the file cannot be read} (:func:`file_sha256`);
    the full path is the key where two files share a name."""
    paths = [os.fspath(f) for f in files]
    names = [os.path.basename(p) for p in paths]
    out: dict[str, str | None] = {}
    for p, name in zip(paths, names):
        key = name if names.count(name) == 1 else p
        try:
            out[key] = file_sha256(p)
        except OSError:
            out[key] = None
    return out


def provenance(*, seeds: Any = None, model: str | None = None, architecture: str | None = None,
               weight_files: Iterable[str | os.PathLike[str]] = (), dtype: Any = None, backend: str | None = None,
               extra: Mapping[str, Any] | None = None, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The provenance block of an output (JSON values only).

    Parameters
    ----------
    seeds : int or sequence of int, optional
        The seeds the output depends on (as given).
    model : str, optional
        The model's name ("synthetic ..." for a seeded synthetic model).
    architecture : str, optional
        The model's family, as its reader names it ("gpt2", "llama", "gemma2", "phi3", ...;
        comma-separated for several models); None for a synthetic or saved Stack.
    weight_files : iterable of path
        The files the model's weights were read from; each is hashed (SHA-256, cached).
    dtype : str or numpy dtype, optional
        The compute dtype.
    backend : str, optional
        The kernel backend asked for (default: ``"auto"``).
    extra : mapping, optional
        Further fields, stored under the key ``"extra"``.
    argv : sequence of str, optional
        The command line (default: ``sys.argv``).

    Returns
    -------
    dict
        The keys of :data:`KEYS` (and ``"extra"`` when given): ``version`` (str),
        ``git_commit`` (str or None), ``argv`` (list of str), ``seeds``, ``model``, ``architecture``,
        ``weights_sha256`` ({file name: hex digest or None if unreadable}), ``dtype``,
        ``backend`` ({"requested", "available", "unavailable"}), ``blas`` ({"cpp_products":
        the C++ products' BLAS in words, "libraries": every BLAS library loaded, as
        threadpoolctl sees it}), ``threads`` ({"pyengine": int, "blas": {library: int}}),
        ``time_utc`` (ISO 8601) and ``machine``.
    """
    import numpy as np

    block, blas, threads = _backends(backend)
    libs = _blas_libraries()
    blas["libraries"] = libs
    out = {
        "version": __version__,
        "git_commit": git_commit(),
        "argv": list(sys.argv if argv is None else argv),
        "seeds": _plain(seeds),
        "model": model,
        "architecture": architecture,
        "weights_sha256": file_hashes(weight_files),
        "dtype": None if dtype is None else np.dtype(dtype).name,
        "backend": block,
        "blas": blas,
        "threads": {"pyengine": threads,
                    "blas": {lib["library"]: lib["num_threads"] for lib in libs if "error" not in lib}},
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }
    if extra is not None:
        out["extra"] = _plain(dict(extra))
    return out
