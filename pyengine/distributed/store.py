"""The on-disk store of a sweep: one ``.npz`` per grid point plus a JSON manifest.

Layout of ``out/``::

    manifest.json        job name, its parameters, the grid points, a fingerprint of both,
                         the ``provenance`` block of the run that created the store and
                         those of the runs that resumed it (``resumed``)
    points/000042.npz    the metric arrays of grid point 42 (written by whoever computed it)
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
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

import numpy as np

from ..provenance import provenance as gather

__all__ = ["Store", "fingerprint"]

MANIFEST = "manifest.json"
ERRORS = "errors.json"
POINTS = "points"


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
            with open(os.path.join(self.path, MANIFEST)) as fh:
                return json.load(fh)
        except FileNotFoundError:
            raise OSError(f"out {self.path} is not a sweep folder: no {MANIFEST}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.path.join(self.path, MANIFEST)} is damaged: {exc}") from None

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
                np.savez(fh, **arrays)
            os.replace(tmp, self.point_path(index))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def read(self, index: int) -> dict[str, np.ndarray]:
        with np.load(self.point_path(index), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    def write_errors(self, errors: list[dict[str, Any]]) -> None:
        self._write_json(ERRORS, {"errors": _jsonable(errors), "provenance": self.provenance or gather()})

    def errors(self) -> list[dict[str, Any]]:
        try:
            with open(os.path.join(self.path, ERRORS)) as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            return []
        return doc["errors"] if isinstance(doc, dict) else doc  # a bare list: a store written before
