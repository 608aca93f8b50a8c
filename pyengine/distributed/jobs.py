"""Jobs of a sweep: what one grid point computes, and how the points read back as arrays.

A :class:`Job` turns a ``grid`` (a dict of parameters; the axes are sequences) into
fixed parameters, a list of grid points (small JSON-able dicts) and, per point, the
input arrays the point needs (token ids of a corpus window, for example). Workers get
only these: parameters, points and arrays, never compiled objects; a model is loaded
once per worker process (:mod:`pyengine.distributed.worker`).

Determinism: a point's result depends only on the job's parameters and the point (its
seeds are derived from the point's own global indices, never from its position in a
chunk), and each point is computed with the same array shapes wherever it runs, so
results are bit-identical in-process, on any cluster and in any chunking.

Jobs here: :class:`NormsJob` (``"norms"``: synthetic per-token LayerNorm/RMSNorm
spectral norms, the small-task benchmark); the model jobs ``"spectral"`` and
``"recovery"`` are in :mod:`pyengine.distributed.model_jobs`, the jobs that run an
experiment (``"attention"``, ``"stability"``) in :mod:`pyengine.distributed.experiment_jobs`.
Importing :mod:`pyengine.distributed` registers all of them; :func:`register_job` adds more.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["JOBS", "Job", "NormsJob", "get_job", "int_axis", "real_axis", "register_job", "seed_of"]


def seed_of(*keys: int) -> int:
    """A 63-bit seed from integer keys (the global seed and a point's global indices)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class Job:
    """Base class of a sweep job. Subclasses set :attr:`name`, :attr:`defaults` and :attr:`axes`
    and implement :meth:`run`; they may override :meth:`plan`, :meth:`point_bytes`, :meth:`combine`.

    ``defaults``: every parameter the job takes, with its default (``None``: required).
    ``axes``: the parameters that are grid axes (sequences); points are their product.
    """

    name: str = ""
    defaults: dict[str, Any] = {}
    axes: tuple[str, ...] = ()

    # -- on the client
    def check(self, params: dict[str, Any]) -> None:
        """Raise ValueError/TypeError naming the grid key of a bad value (before any task runs)."""

    def plan(self, grid: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, np.ndarray]]]:
        """(params, points, inputs) of ``grid``; every check happens here."""
        if not isinstance(grid, Mapping):
            raise TypeError(f"grid must be a dict of parameters of job {self.name!r}; got {type(grid).__name__}")
        unknown = sorted(set(grid) - set(self.defaults))
        if unknown:
            raise ValueError(f"grid has unknown key {unknown[0]!r}; job {self.name!r} takes: "
                             f"{', '.join(sorted(self.defaults))}")
        params = {**self.defaults, **grid}
        missing = [k for k, v in params.items() if v is None and k in self.required]
        if missing:
            raise ValueError(f"grid needs {missing[0]!r} for job {self.name!r}")
        values = {}
        for a in self.axes:
            v = params[a]
            if isinstance(v, (str, bytes)) or not isinstance(v, (Sequence, np.ndarray)):
                v = [v]
            v = list(v)
            if not v:
                raise ValueError(f"grid[{a!r}] is empty: an axis needs at least one value")
            values[a] = v
            params[a] = v
        self.check(params)
        points = [dict(zip(self.axes, combo)) for combo in itertools.product(*(values[a] for a in self.axes))]
        for p in points:  # plain Python scalars, so that points are JSON-able and hash the same
            for k, v in p.items():
                if isinstance(v, np.generic):
                    p[k] = v.item()
        return params, points, [{} for _ in points]

    required: tuple[str, ...] = ()

    def point_bytes(self, params: dict[str, Any], point: dict[str, Any]) -> int:
        """Working memory (bytes) of one point, for the chunk-size budget; default 1 MiB."""
        return 1 << 20

    # -- on the worker
    def run(self, params: dict[str, Any], point: dict[str, Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The metric arrays of one point."""
        raise NotImplementedError

    # -- on load
    def combine(self, params: dict[str, Any], points: list[dict[str, Any]],
                results: list[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
        """One array per metric. Default: the points' arrays stacked on a leading axis shaped like
        the grid axes (``len(axis)`` each), NaN where a point has no result."""
        first = next((r for r in results if r is not None), None)
        if first is None:
            return {}
        shape = tuple(len(params[a]) for a in self.axes)
        out = {}
        for k, v in first.items():
            arr = np.full((len(results),) + v.shape, np.nan, np.result_type(v.dtype, np.float32)
                          if v.dtype.kind in "fc" else np.float64)
            for i, r in enumerate(results):
                if r is not None:
                    arr[i] = r[k]
            out[k] = arr.reshape(shape + v.shape)
        return out


#: Job name -> the registered :class:`Job` (:func:`register_job` adds one).
JOBS: dict[str, Job] = {}


def register_job(job: Job) -> Job:
    """Make ``job`` available by its name to :func:`pyengine.scan`; returns it."""
    if not isinstance(job, Job) or not job.name:
        raise TypeError(f"job must be a named pyengine.distributed.Job; got {job!r}")
    JOBS[job.name] = job
    return job


def get_job(job: str | Job) -> Job:
    if isinstance(job, Job):
        return job
    if isinstance(job, str):
        if job in JOBS:
            return JOBS[job]
        raise ValueError(f"job must be one of {', '.join(map(repr, sorted(JOBS)))}; got {job!r}")
    raise TypeError(f"job must be a job name or a Job; got {type(job).__name__}")


def int_axis(params: dict[str, Any], key: str, low: int = 0) -> None:
    """Check that axis ``key`` of ``params`` holds integers >= ``low`` (ValueError naming it)."""
    for v in params[key]:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
            raise ValueError(f"grid[{key!r}] must hold integers >= {low}; got {v!r}")


def real_axis(params: dict[str, Any], key: str) -> None:
    """Check that axis ``key`` of ``params`` holds finite reals (ValueError naming it)."""
    for v in params[key]:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not np.isfinite(v):
            raise ValueError(f"grid[{key!r}] must hold finite real numbers; got {v!r}")


class NormsJob(Job):
    """``"norms"``: sigma_max of the LayerNorm (or RMSNorm) Jacobian of ``tokens`` seeded random
    tokens of width ``d`` per point, over ``seeds`` x ``scales`` (the token scale).

    A small job with no model: the sweep machinery's benchmark and test. A scale so large
    that float32 overflows makes that point fail (the kernel rejects Inf input), as any
    bad point of a real sweep would. Metric: ``sigma`` (seeds, scales, tokens).
    """

    name = "norms"
    defaults = {"seeds": (0,), "scales": (1.0,), "tokens": 64, "d": 64, "norm": "layernorm",
                "method": "exact", "dtype": "float32", "backend": "auto"}
    axes = ("seeds", "scales")

    def check(self, params: dict[str, Any]) -> None:
        int_axis(params, "seeds")
        real_axis(params, "scales")
        for k, low in (("tokens", 1), ("d", 2)):
            v = params[k]
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
                raise ValueError(f"grid[{k!r}] must be an integer >= {low}; got {v!r}")
        if params["norm"] not in ("layernorm", "rmsnorm"):
            raise ValueError(f"grid['norm'] must be 'layernorm' or 'rmsnorm'; got {params['norm']!r}")
        if params["method"] not in ("exact", "power", "lanczos"):
            raise ValueError(f"grid['method'] must be 'exact', 'power' or 'lanczos'; got {params['method']!r}")
        if params["dtype"] not in ("float32", "float64"):
            raise ValueError(f"grid['dtype'] must be 'float32' or 'float64'; got {params['dtype']!r}")

    def point_bytes(self, params: dict[str, Any], point: dict[str, Any]) -> int:
        return 8 * params["tokens"] * params["d"] * 4

    def run(self, params: dict[str, Any], point: dict[str, Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..linalg.spectral import layer_norm_spectral_norm, rms_norm_spectral_norm

        rng = np.random.default_rng(seed_of(point["seeds"]))
        with np.errstate(over="ignore"):  # a huge scale overflows float32 to Inf: the kernel says so
            x = (rng.standard_normal((params["tokens"], params["d"])) * point["scales"]).astype(params["dtype"])
        fn = layer_norm_spectral_norm if params["norm"] == "layernorm" else rms_norm_spectral_norm
        res = fn(x, None, 1e-5, "full", params["method"], seed=seed_of(point["seeds"], 1), backend=params["backend"])
        return {"sigma": res.sigma}


register_job(NormsJob())
