"""The ``provenance`` block of a subcommand's JSON files (:func:`pyengine.provenance.provenance`),
with the command line as the ``pyengine`` command received it and the model it ran on."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..provenance import file_hashes, provenance, weight_files

__all__ = ["ARGV", "block", "model_fields", "named_model_fields"]

#: The attribute of the parsed arguments that holds the command line (set by :func:`pyengine.cli.main`).
ARGV = "provenance_argv"


def model_fields(model: Any, name: str | None = None, *, synthetic: str | None = None) -> dict[str, Any]:
    """``{"model": ..., "weight_files": [...]}`` for :func:`block`, with ``"architecture"`` (the
    family) for a pretrained model.

    ``model`` is a loaded model (a :class:`~pyengine.models.PretrainedModel` knows the
    folder or file of its weights), a ``.npz`` path, or None with ``synthetic`` naming a
    seeded synthetic model (no weight files).
    """
    if isinstance(model, (str, os.PathLike)):
        return {"model": name or os.path.basename(os.fspath(model)), "weight_files": [os.fspath(model)]}
    source = getattr(model, "source", None)
    if model is not None and source is not None:
        return {"model": name or getattr(model, "name", None), "weight_files": weight_files(source),
                "architecture": getattr(model, "architecture", None)}
    return {"model": name or synthetic, "weight_files": []}


def named_model_fields(name: str, synthetic: dict[str, Any]) -> dict[str, Any]:
    """:func:`model_fields` of a model named by a string that a job loads later: one of
    ``synthetic`` (names of seeded synthetic stacks, seed 0), or a pretrained model found by
    :func:`~pyengine.models.pretrained.locate_pretrained` without reading its weights (a name
    it cannot resolve is kept as given; the job reports the error)."""
    if name in synthetic:
        return {"model": f"synthetic: {name} (seed 0)", "weight_files": []}
    from ..models.pretrained import locate_pretrained

    try:
        found, path = locate_pretrained(name)
    except (ValueError, TypeError, OSError):
        return {"model": name, "weight_files": []}
    return {"model": found, "weight_files": weight_files(path)}


def block(args: argparse.Namespace, *, inputs: tuple[str | None, ...] = (), **fields: Any) -> dict[str, Any]:
    """The provenance of this run: ``fields`` (seeds, model, weight_files, dtype, backend,
    extra) and the command line; ``inputs``: data files read, hashed into ``extra``."""
    files = [f for f in inputs if f]
    if files:
        fields["extra"] = {**(fields.get("extra") or {}), "inputs_sha256": file_hashes(files)}
    return provenance(argv=getattr(args, ARGV, None), **fields)
