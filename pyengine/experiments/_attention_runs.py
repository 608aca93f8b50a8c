"""One finished (seed, arm) run of :func:`~pyengine.experiments.attention_dynamics.attention_dynamics`
as flat named arrays, and back, bit for bit: what a caller stores as each run ends (the
``on_run`` hook) and hands back to resume (``done_runs``). ``pyengine attention`` keeps them in a
checksummed store, ``OUT/runs`` (:class:`pyengine.distributed.Store`, one point per (seed, arm)).

A run is the dict of :func:`~pyengine.experiments.attention_dynamics.run_arm`: ``hist``
(steps + 1, metrics), ``pca`` (2,), ``curve`` (schedule, n_heldout + 3), ``change`` (steps, 4),
``skipped`` (int), ``W`` (name -> weight) and ``heat`` (step -> heat map). Arrays keep their
dtype; the names are ``hist``, ``pca``, ``curve``, ``change``, ``skipped``, ``W.<name>`` and
``heat.<step>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["missing_arms", "partial_summary", "run_from_arrays", "run_to_arrays"]

_PLAIN = ("hist", "pca", "curve", "change")


def run_to_arrays(run: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The run as flat named arrays (the run's own arrays, not copies)."""
    out = {k: np.asarray(run[k]) for k in _PLAIN}
    out["skipped"] = np.asarray(run["skipped"], dtype=np.int64)
    out.update({f"W.{k}": np.asarray(v) for k, v in run["W"].items()})
    out.update({f"heat.{int(s)}": np.asarray(v) for s, v in run["heat"].items()})
    return out


def run_from_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The inverse of :func:`run_to_arrays`; a ValueError naming what is missing."""
    lost = [k for k in (*_PLAIN, "skipped") if k not in arrays]
    if lost:
        raise ValueError(f"a stored attention run lacks {', '.join(lost)}")
    run: dict[str, Any] = {k: np.asarray(arrays[k]) for k in _PLAIN}
    run["skipped"] = int(arrays["skipped"])
    run["W"] = {k[2:]: np.asarray(v) for k, v in arrays.items() if k.startswith("W.")}
    run["heat"] = dict(sorted(((int(k[5:]), np.asarray(v)) for k, v in arrays.items() if k.startswith("heat.")),
                             key=lambda kv: kv[0]))
    return run


def missing_arms(seeds: Sequence[int], arms: Sequence[str], done: Mapping[tuple[int, str], Any]
                 ) -> dict[int, tuple[str, ...]]:
    """Seed -> the arms without a finished run (seeds with every arm finished are left out)."""
    out = {}
    for s in seeds:
        lost = tuple(a for a in arms if (s, a) not in done)
        if lost:
            out[int(s)] = lost
    return out


def partial_summary(seed: int, arm: str, run: Mapping[str, Any], metrics: Sequence[str], n_heldout: int
                    ) -> dict[str, Any]:
    """A finished run of a seed whose other arms did not finish: its final held-out and training
    losses and its training metrics per step (metric -> (steps + 1,))."""
    hist, curve = run["hist"], run["curve"]
    return {"seed": int(seed), "arm": arm, "heldout_loss": float(curve[-1, :n_heldout].mean()),
            "validation_loss": float(curve[-1, n_heldout]), "train_loss": float(hist[-1, metrics.index("loss")]),
            "m_step_skipped": int(run["skipped"]), "metrics": {m: hist[:, i] for i, m in enumerate(metrics)}}
