"""The ``.npz`` weights file of :class:`pyengine.models.stack.Stack`: writing it atomically, reading it safely.

Layout (uncompressed ``np.savez``): one ``.npy`` member per weight array, named as
in the Stack, plus ``__config__`` (the :class:`~pyengine.models.stack.StackConfig` JSON as a
0-d unicode array) and ``__format__`` (0-d int, :data:`FORMAT_VERSION`).

Reading checks every member's ``.npy`` header (version, dtype, shape against the
config, size against the bytes actually present) before anything is allocated, so
a truncated, corrupt or hostile file raises ValueError instead of allocating what
its header claims. :meth:`Stack.save <pyengine.models.stack.Stack.save>` and
:meth:`Stack.load <pyengine.models.stack.Stack.load>` are thin wrappers over :func:`save`
and :func:`load`; the config parsing and the expected shapes are passed in, so this
module does not import :mod:`pyengine.models.stack`.
"""

from __future__ import annotations

import math
import os
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["FORMAT_VERSION", "load", "save"]

#: Version of the .npz layout written by :meth:`Stack.save`.
FORMAT_VERSION = 1
#: Largest config JSON member a weights file may hold (bytes); guards lying headers.
_MAX_CONFIG_BYTES = 1 << 20


def save(path: str | os.PathLike[str], config_json: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Write an uncompressed ``.npz`` (the arrays and the config JSON), atomically."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".pyengine-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, __config__=np.array(config_json),
                     __format__=np.array(FORMAT_VERSION), **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(
    path: str | os.PathLike[str],
    parse_config: Callable[[str], Any],
    shapes: Callable[[Any], Mapping[str, tuple[int, ...]]],
) -> tuple[Any, dict[str, np.ndarray]]:
    """(config, arrays) of a file written by :func:`save`; the arrays are not yet checked.

    ``parse_config`` turns the JSON into a config (TypeError/ValueError if invalid);
    ``shapes(config)`` gives name -> shape of the arrays it needs, against which each
    member's header is checked. A missing file raises FileNotFoundError; a truncated
    or malformed one ValueError naming the file. Members the config does not name
    are read with their own shapes (the caller reports them as unexpected).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights file {path!r} does not exist")
    try:
        with zipfile.ZipFile(path) as zf:
            members = {n[:-4]: zf.getinfo(n) for n in zf.namelist() if n.endswith(".npy")}
            for meta in ("__config__", "__format__"):
                if meta not in members:
                    raise ValueError(f"has no {meta} entry: not written by pyengine's Stack.save")
            fmt = _read_member(zf, members.pop("__format__"), None, small=True)
            if fmt.shape != () or fmt.dtype.kind not in "iu" or int(fmt) != FORMAT_VERSION:
                raise ValueError(f"has format {fmt!r}; this pyengine reads format {FORMAT_VERSION}")
            cfg_arr = _read_member(zf, members.pop("__config__"), None, small=True)
            if cfg_arr.shape != () or cfg_arr.dtype.kind != "U":
                raise ValueError("has a __config__ entry that is not a JSON string")
            try:
                config = parse_config(str(cfg_arr[()]))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"holds an invalid config: {exc}") from None
            expected = shapes(config)
            arrays = {
                name: _read_member(zf, info, expected.get(name)) for name, info in members.items()
            }
    except ValueError as exc:
        raise ValueError(f"weights file {path!r}: {exc}") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError) as exc:
        raise ValueError(f"weights file {path!r} is not a readable .npz ({type(exc).__name__}: {exc})") from None
    return config, arrays


def _read_member(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, shape: tuple[int, ...] | None, small: bool = False
) -> np.ndarray:
    """One .npy member, with its header checked against the expected shape and the bytes present."""
    name = info.filename[:-4]
    if small and info.file_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"entry {name!r} is implausibly large ({info.file_size} bytes)")
    with zf.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            hshape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            hshape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"entry {name!r} has unsupported .npy version {version}")
        if dtype.hasobject:
            raise ValueError(f"entry {name!r} holds Python objects")
        if shape is not None and hshape != shape:
            raise ValueError(f"array {name!r} must have shape {shape}; got {hshape}")
        nbytes = math.prod(hshape) * dtype.itemsize
        if nbytes > info.file_size:
            raise ValueError(
                f"array {name!r} claims {nbytes} bytes in a {info.file_size}-byte entry (truncated or corrupt)"
            )
        data = f.read(nbytes)
        if len(data) != nbytes:
            raise ValueError(f"array {name!r} is truncated ({len(data)} of {nbytes} bytes)")
        if f.read(1):
            raise ValueError(f"array {name!r} has bytes past its declared shape {hshape}")
    arr = np.frombuffer(data, dtype=dtype)
    return arr.reshape(hshape[::-1]).T if fortran else arr.reshape(hshape)
