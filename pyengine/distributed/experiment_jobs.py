"""Sweep jobs that run a layer-4 experiment: ``"attention"`` and ``"stability"``.

The sweep layer sits above the experiments (tests/test_layers.py: experiments < distributed
< cli), so these jobs live here and are registered when :mod:`pyengine.distributed` is
imported; each imports its experiment only when a point runs (or is checked), which keeps
``import pyengine`` from loading the experiments' SciPy and threadpoolctl imports.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .jobs import Job, int_axis, real_axis, register_job

__all__ = ["AttentionJob", "StabilityJob"]


class AttentionJob(Job):
    """``"attention"``: :func:`pyengine.experiments.attention_dynamics` over ``seeds`` x ``lrs``.
    Metrics ``<arm>.<metric>`` of shape (seeds, lrs, steps + 1)."""

    name = "attention"
    defaults = {"seeds": (42, 2024, 1337, 7777, 9999), "lrs": (0.01,), "steps": 1000, "T": 2000, "n_symbols": 8,
                "stay": 0.3, "value_lr_factor": 10.0, "dtype": "float32", "backend": "auto"}
    axes = ("seeds", "lrs")

    def check(self, params: dict[str, Any]) -> None:
        int_axis(params, "seeds")
        real_axis(params, "lrs")
        if any(v <= 0 for v in params["lrs"]):
            raise ValueError(f"grid['lrs'] must hold positive learning rates; got {params['lrs']}")

    def run(self, params: dict[str, Any], point: dict[str, Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..experiments import attention_dynamics

        keys = ("steps", "T", "n_symbols", "stay", "value_lr_factor", "dtype", "backend")
        rep = attention_dynamics(seeds=(point["seeds"],), lr=point["lrs"], **{k: params[k] for k in keys})
        return {f"{arm}.{m}": np.asarray(v[0], np.float64) for arm, ms in rep.metrics.items() for m, v in ms.items()}


class StabilityJob(Job):
    """``"stability"``: the signal-propagation report of :func:`pyengine.experiments.stability` per
    scheme of ``schemes``. Metrics (schemes, settings, depth + 1): forward/backward RMS and predictions."""

    name = "stability"
    defaults = {"schemes": ("kaiming_normal", "xavier_normal", "torch_default", "orthogonal"), "depth": 48,
                "width": 768, "tokens": 128, "activation": "relu", "seed": 0}
    axes = ("schemes",)

    def check(self, params: dict[str, Any]) -> None:
        from ..models.initialization import ALIASES, SCHEMES

        for s in params["schemes"]:
            if s not in SCHEMES and s not in ALIASES:
                raise ValueError(f"grid['schemes'] must hold init schemes ({', '.join(SCHEMES)}); got {s!r}")

    def run(self, params: dict[str, Any], point: dict[str, Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..experiments import stability

        rep = stability((point["schemes"],), params["depth"], params["width"], params["tokens"],
                        activation=params["activation"], demo=False, seed=params["seed"])
        return {k: np.stack([getattr(r, k) for r in rep.runs])
                for k in ("forward_rms", "backward_rms", "forward_pred", "backward_pred")}


register_job(AttentionJob())
register_job(StabilityJob())
