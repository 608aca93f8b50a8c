"""The on-disk store of a sweep: one ``.npz`` per grid point plus a JSON manifest.

Layout of ``out/``::

    manifest.json        job name, its parameters, the grid points, a fingerprint of both,
                         the ``provenance`` block of the run that created the store and
                         those of the runs that resumed it (``resumed``)
    points/000042.npz    the metric arrays of grid point 42 (written by whoever computed it) and
                         ``__sha256__``, a checksum of their names, dtypes, shapes and bytes
    errors.json          grid points whose computation raised (``errors``: index, point,
                         message) and the ``provenance`` block of the run that wrote it

Why one ``.npz`` per point and not Zarr: a point's result is small and written once,
so each worker writes its own file into a temporary name and renames it
(``os.replace`` is atomic on POSIX), which needs no locks, no coordination between
workers and no extra dependency. "Done" is the presence of the file: a sweep killed
at any moment leaves only whole files (a half-written temporary is ignored and
overwritten), so :meth:`Store.done` is exact and a resumed sweep recomputes nothing
already stored. The manifest's fingerprint stops a resume from mixing two different
sweeps in one folder; the provenance blocks do not enter it.

Damage. A point file that does not read back whole (empty, truncated, garbage, other
arrays than were written: its checksum does not match) is damaged: :meth:`Store.read`
raises a ValueError naming the file, :meth:`Store.damaged` lists such files, and a
resumed sweep moves them aside (``000042.npz.damaged``) and recomputes those points.
A manifest or ``errors.json`` that is not the JSON object described above is a
ValueError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

import numpy as np

from ..provenance import provenance as gather

__all__ = ["CHECKSUM", "DamagedFile", "Store", "fingerprint"]

MANIFEST = "manifest.json"
ERRORS = "errors.json"
POINTS = "points"
#: The entry of a point file that holds the checksum of its other arrays.
CHECKSUM = "__sha256__"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return {"__array__": hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest(),
                "shape": list(obj.shape), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def fingerprint(job: str, params: dict[str, Any], points: list[dict[str, Any]], content: Any = None) -> str:
    """A hash of the job, its parameters, its grid points and their input arrays (by content)."""
    doc = json.dumps(_jsonable({"job": job, "params": params, "points": points, "content": content}),
                     sort_keys=True, default=repr)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _checksum(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """sha256 of the arrays' names, dtypes, shapes and bytes, as a (32,) uint8 array."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), np.uint8).copy()


class DamagedFile(ValueError):
    """A file of a store that does not read back as written (its message names the file)."""


class Store:
    """The folder ``path`` of one sweep (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.provenance: dict[str, Any] | None = None  # this run's block, set by create()

    # -- layout
    def point_path(self, index: int) -> str:
        return os.path.join(self.path, POINTS, f"{index:06d}.npz")

    def exists(self) -> bool:
        return os.path.isfile(os.path.join(self.path, MANIFEST))

    # -- manifest
    def create(self, job: str, params: dict[str, Any], points: list[dict[str, Any]], *, resume: bool,
               content: Any = None, provenance: dict[str, Any] | None = None) -> None:
        """Write the manifest, or check that the folder holds this same sweep (``resume``);
        ``content``: the points' input arrays, which enter the fingerprint by their hash;
        ``provenance``: this run's block (default :func:`pyengine.provenance.provenance` now),
        the manifest's ``provenance`` for a new store, appended to its ``resumed`` list otherwise."""
        fp = fingerprint(job, params, points, content)
        if provenance is None:
            provenance = gather(model=params.get("model") if isinstance(params.get("model"), str) else None)
        self.provenance = provenance
        if self.exists():
            old = self.manifest()
            if old.get("fingerprint") != fp:
                raise ValueError(f"out {self.path} holds another sweep (job {old.get('job')!r}, "
                                 f"{len(old.get('points', []))} points, fingerprint {old.get('fingerprint')}); "
                                 "choose another out folder")
            if not resume and self.done(len(points)):
                raise ValueError(f"out {self.path} already holds {len(self.done(len(points)))} results of this "
                                 "sweep; pass resume=True (--resume) to continue it, or choose another out folder")
            self._write_json(MANIFEST, {**old, "resumed": [*old.get("resumed", []), provenance]})
            return
        if os.path.isdir(self.path) and os.listdir(self.path):
            raise ValueError(f"out {self.path} exists and is not a sweep folder (no {MANIFEST}); "
                             "choose an empty or new folder")
        os.makedirs(os.path.join(self.path, POINTS), exist_ok=True)
        self._write_json(MANIFEST, {"job": job, "params": _jsonable(params), "points": _jsonable(points),
                                    "fingerprint": fp, "n_points": len(points), "provenance": provenance})

    def manifest(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.path, MANIFEST), encoding="utf-8") as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            raise OSError(f"out {self.path} is not a sweep folder: no {MANIFEST}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DamagedFile(f"{os.path.join(self.path, MANIFEST)} is damaged: {exc}") from None
        kinds = {"job": str, "params": dict, "points": list}
        bad = [k for k, t in kinds.items() if not isinstance(doc, dict) or not isinstance(doc.get(k), t)]
        if bad:
            what = f"a JSON {type(doc).__name__}" if not isinstance(doc, dict) else f"no valid {bad[0]!r}"
            raise DamagedFile(f"{os.path.join(self.path, MANIFEST)} is damaged: {what} "
                              "(expected an object with 'job', 'params' and 'points')")
        return doc

    def _write_json(self, name: str, doc: Any) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{name}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=1, default=repr)
        os.replace(tmp, os.path.join(self.path, name))

    # -- results
    def done(self, n_points: int) -> set[int]:
        """Indices of the points whose results are stored."""
        folder = os.path.join(self.path, POINTS)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return set()
        out = set()
        for n in names:
            if n.endswith(".npz") and n[:-4].isdigit() and int(n[:-4]) < n_points:
                out.add(int(n[:-4]))
        return out

    def write(self, index: int, arrays: dict[str, np.ndarray]) -> None:
        """Store the results of point ``index`` atomically (a temporary file, then a rename)."""
        folder = os.path.join(self.path, POINTS)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{index:06d}.", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays, **{CHECKSUM: _checksum(arrays)})
            os.replace(tmp, self.point_path(index))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def read(self, index: int) -> dict[str, np.ndarray]:
        """The arrays of point ``index``; :class:`DamagedFile` (a ValueError naming the file)
        if the file does not read back whole or its checksum does not match."""
        path = self.point_path(index)
        with open(path, "rb") as fh:  # np.load leaves a path it opened open when the data is garbage
            try:
                z = np.load(fh, allow_pickle=False)
                arrays = {k: z[k] for k in z.files} if hasattr(z, "files") else z
            except Exception as exc:  # empty, truncated or garbage files fail in many ways
                raise DamagedFile(f"point file {path} is damaged ({type(exc).__name__}: {exc})") from None
        if not isinstance(arrays, dict):  # np.load returns an array for a lone .npy file
            raise DamagedFile(f"point file {path} is damaged (not an .npz archive)")
        stored = arrays.pop(CHECKSUM, None)
        if stored is None:
            raise DamagedFile(f"point file {path} is damaged (no {CHECKSUM} checksum entry)")
        if not np.array_equal(stored, _checksum(arrays)):
            raise DamagedFile(f"point file {path} is damaged (its arrays {sorted(arrays)} do not match "
                              "their checksum)")
        return arrays

    def damaged(self, n_points: int) -> dict[int, str]:
        """Stored points whose file is damaged: index -> the message of :meth:`read`."""
        out = {}
        for i in sorted(self.done(n_points)):
            try:
                self.read(i)
            except DamagedFile as exc:
                out[i] = str(exc)
        return out

    def set_aside(self, index: int) -> str:
        """Rename the (damaged) file of point ``index`` to ``<name>.damaged``; the new path."""
        path = self.point_path(index)
        os.replace(path, path + ".damaged")
        return path + ".damaged"

    def write_errors(self, errors: list[dict[str, Any]]) -> None:
        self._write_json(ERRORS, {"errors": _jsonable(errors), "provenance": self.provenance or gather()})

    def errors(self) -> list[dict[str, Any]]:
        """The failed points of ``errors.json`` ([] without it); :class:`DamagedFile` if damaged."""
        path = os.path.join(self.path, ERRORS)
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            return []
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DamagedFile(f"{path} is damaged: {exc}") from None
        errs = doc.get("errors") if isinstance(doc, dict) else doc  # a bare list: a store written before
        if not isinstance(errs, list) or not all(isinstance(e, dict) and isinstance(e.get("index"), int)
                                                 for e in errs):
            raise DamagedFile(f"{path} is damaged: expected an object with a list 'errors' of "
                              "{'index', 'point', 'error'}")
        return errs
