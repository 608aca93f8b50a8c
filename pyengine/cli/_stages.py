"""Finished stages of a subcommand on disk, and Ctrl-C that keeps them.

Every long subcommand writes each stage as soon as it has finished, to
``<out>/stages/NN-<stage>.json`` with the run's ``provenance`` block (a temporary name
renamed into place: never half a file), so Ctrl-C loses only the stage that was running.
:meth:`Stages.keep` turns the KeyboardInterrupt into ``KeyboardInterrupt("<what was kept>")``,
which :func:`pyengine.cli.main` prints as one line (exit status 130, no traceback).

Tests: with the environment variable ``PYENGINE_TEST_HOLD`` set to a path, the command
creates that file at its first hold point (after its first finished stage) and sleeps
there, so a test can send SIGINT at a known moment (``tests/test_cli_interrupt.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["HOLD_ENV", "Stages", "hold", "write_stage"]

HOLD_ENV = "PYENGINE_TEST_HOLD"


def hold() -> None:
    """The test hook: create the file ``$PYENGINE_TEST_HOLD`` (once) and wait for SIGINT there."""
    path = os.environ.get(HOLD_ENV)
    if not path or os.path.exists(path):
        return
    with open(path, "w"):
        pass
    time.sleep(300)


def write_stage(folder: str, index: int, stage: str, result: dict, provenance: dict | None = None) -> str:
    """Write one finished stage to ``folder/stages/NN-<stage>.json``; return the path.
    Written to a temporary name and renamed: never a half-written file, even on Ctrl-C.
    ``provenance``: the run's block (default: :func:`pyengine.provenance.provenance` now)."""
    slug = "-".join("".join(c if c.isalnum() else " " for c in stage.lower()).split())
    os.makedirs(os.path.join(folder, "stages"), exist_ok=True)
    path = os.path.join(folder, "stages", f"{index:02d}-{slug}.json")
    if provenance is None:
        from ..provenance import provenance as gather

        provenance = gather()
    doc = _clean({**(result if "stage" in result else {"stage": stage, **result}), "provenance": provenance})
    text = json.dumps(doc, allow_nan=False)  # json.dump would take the slower pure-Python encoder
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return path


def _clean(x: Any) -> Any:
    """Plain JSON values: arrays as lists, NaN and Inf as None (strict JSON)."""
    import math

    import numpy as np

    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "biu" or (x.dtype.kind == "f" and np.isfinite(x).all()):
            return x.tolist()  # nothing to clean: Python numbers, all finite
        return _clean(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class Stages:
    """``stages(name, result)`` writes a finished stage with the run's ``provenance`` block
    (see the module docstring)."""

    def __init__(self, folder: str, provenance: dict) -> None:
        self.folder, self.provenance, self.paths = folder, provenance, []

    def __call__(self, stage: str, result: dict) -> None:
        self.paths.append(write_stage(self.folder, len(self.paths) + 1, stage, result, self.provenance))
        hold()

    def message(self) -> str:
        if not self.paths:
            return "no stage had finished"
        return f"the {len(self.paths)} finished stage(s) are in {os.path.join(self.folder, 'stages')}"

    @contextlib.contextmanager
    def keep(self) -> Iterator[Stages]:
        """Ctrl-C inside: KeyboardInterrupt(what was kept), without the traceback's chain."""
        try:
            yield self
        except KeyboardInterrupt:
            raise KeyboardInterrupt(self.message()) from None
