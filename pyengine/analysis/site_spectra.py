"""Per-token sigma_max of a model's normalization Jacobians at named norm-input sites.

The sites are the norm inputs of the naming table of :mod:`pyengine.models.sites`:
``embed.norm.input`` (BERT), ``blocks.k.norm1.input``, ``blocks.k.norm2.input`` (layouts
with a second norm) and ``final_norm.input``. :func:`norm_site_inputs` returns their
activations at one sequence (from ``run_with_cache``: exactly what the forward feeds the
norm, also in a post-LN block, where the norm input is ``resid_pre + attn.out``) with each
norm's gamma (``gamma_scale`` applied); :func:`site_spectra` scans them with
:func:`pyengine.layer_norm_spectral_norm` / :func:`pyengine.rms_norm_spectral_norm`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..linalg.spectral import layer_norm_spectral_norm, rms_norm_spectral_norm
from ..models.sites import match_sites

__all__ = ["SiteSpectra", "norm_input_sites", "norm_site_inputs", "select_norm_input_sites", "site_spectra"]

#: The default selection: every norm input of every block.
DEFAULT_SITES = "blocks.*.norm*.input"


def norm_input_sites(model: Any) -> list[str]:
    """Every norm-input site of ``model``, in forward order."""
    return [n for n in model.site_names() if n.endswith(".input")]


def select_norm_input_sites(model: Any, sites: Any) -> list[str]:
    names = norm_input_sites(model)
    pats = [sites] if isinstance(sites, str) else list(sites)
    if not pats:
        raise ValueError("sites must name at least one norm-input site")
    out = match_sites(names, pats, lambda p: (
        f"sites: {p!r} matches no norm-input site of this model; they are "
        f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''} (globs like {DEFAULT_SITES!r})"))
    order = {n: i for i, n in enumerate(names)}
    return sorted(out, key=order.__getitem__)


def norm_site_inputs(model: Any, input_ids: Any, sites: Any = DEFAULT_SITES, dtype: Any = None
                     ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(names, X (S, T, d), gamma (S, d)) of the norm-input sites ``sites`` (names or globs)
    at one sequence ``input_ids``; X in the compute dtype, gamma in X's dtype."""
    if not hasattr(model, "site_names"):
        raise TypeError(f"model must be a pyengine Stack or pretrained model; got {type(model).__name__}")
    names = select_norm_input_sites(model, sites)
    ids = np.asarray(input_ids)
    if ids.ndim != (1 if ids.dtype.kind in "iu" else 2):
        raise ValueError(f"input_ids must be one sequence: (T,) ids or (T, d_model) floats; got shape {ids.shape}")
    _, cache = model.run_with_cache(ids, names, dtype=dtype)
    X = np.stack([cache[n] for n in names])
    cfg = model.config
    w = model.weights
    gamma = np.stack([np.asarray(w[n[: -len(".input")] + ".gamma"], np.float64) for n in names])
    return names, X, (gamma * cfg.gamma_scale).astype(X.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class SiteSpectra:
    """sigma_max (and the solver's bounds) per site and token: arrays (S, T)."""

    sites: list[str]
    sigma: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    converged: np.ndarray
    norm: str
    method: str
    mode: str

    def to_dict(self) -> dict[str, Any]:
        return {"sites": list(self.sites), "norm": self.norm, "method": self.method, "mode": self.mode,
                "sigma": self.sigma.tolist(), "lower": self.lower.tolist(), "upper": self.upper.tolist(),
                "converged": self.converged.tolist()}


def site_spectra(model: Any, input_ids: Any, sites: Any = DEFAULT_SITES, *, mode: str = "full",
                 method: str = "exact", tol: float = 1e-6, max_iter: int = 1000, seed: int = 0,
                 backend: str = "auto", dtype: Any = None) -> SiteSpectra:
    """sigma_max of the norm Jacobian at every token of each norm-input site ``sites``.

    ``sites``: names or globs of norm-input sites (default every block's norm inputs,
    ``"blocks.*.norm*.input"``); the model's norm kind, eps and gamma are used.
    Each site is scanned on its own (start vectors seeded by ``seed`` per site).
    """
    names, X, gamma = norm_site_inputs(model, input_ids, sites, dtype)
    cfg = model.config
    fn = layer_norm_spectral_norm if cfg.norm == "layernorm" else rms_norm_spectral_norm
    res = [fn(X[i], gamma[i], cfg.eps, mode, method, tol=tol, max_iter=max_iter, seed=seed, backend=backend)
           for i in range(len(names))]
    f = lambda k: np.stack([np.ravel(getattr(r, k)) for r in res])  # noqa: E731
    return SiteSpectra(names, f("sigma"), f("lower"), f("upper"), f("converged"), cfg.norm, method, mode)
