"""The result of :func:`~pyengine.experiments.recovery`: :class:`Recovery`, its per-layer
table and JSON form, and the summaries of the two runs it is built from (the gap between
the exact and linearized deltas, and the scales where they agree)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..analysis import DecayFit, Propagation
from ..analysis.linear_model import ScalingFit
from ..models import StackConfig
from ._report import LINEAR_TOL

__all__ = ["Recovery"]


@dataclasses.dataclass(eq=False)
class Recovery:
    """Everything :func:`~pyengine.experiments.recovery` measured (see :mod:`pyengine.experiments.recovery`).

    ``exact`` / ``linear``: the two :class:`~pyengine.Propagation` runs (K directions x
    S scales). ``fit_exact`` / ``fit_linear``: decay fits of the mean ``|projection|`` at
    the read-out (``read``) and the protocol scale. ``spectral``: per block passed,
    rho and sigma_max of the diagonal Jacobian block at each token of
    ``spectral_tokens`` and ``|A 1 - 1|_inf``; ``spectra_how``: which path found them (arrays
    ``rho_method``, ``sigma_method``: "dense", "lanczos", "power" or "arnoldi") and
    whether it converged (``rho_converged``, ``sigma_converged``), each (n_blocks, R). ``linear_gap`` (S,): the largest, over the
    layers after the injection, of ``|delta_ex - delta_lin| / |delta_lin|`` at the read-out
    positions (summed over directions); ``linear_regime`` the longest run of scales
    where it stays within 10 %. ``gain_linear``: the gain along v of each block. ``no_residual``, ``eps_sweep``,
    ``gamma_sweep``: decay fits of the ablations. ``verdicts``: one line per prediction;
    ``protocol`` the evaluation protocol in one line. ``spectra_skipped``: the spectra were
    not formed (``rho`` etc. then have no rows). ``scaling``: the linear model, the fit
    ``alpha I + beta 11^T/d`` of the composed Jacobian from hidden state ``layer`` to each later
    one at the last read-out token. ``uniform``: ``{"exact": (uniform, rest), "linear": ...}``,
    (L,) each: the norms of ``mean(delta) 1`` and of ``delta - mean(delta) 1`` at the read-out
    (protocol scale, mean over directions and read-out positions).
    """

    model: str
    config: StackConfig
    text: str | None
    ids: np.ndarray
    layer: int
    read: str
    protocol_scale: float
    exact: Propagation
    linear: Propagation
    fit_exact: DecayFit
    fit_linear: DecayFit
    spectral_tokens: np.ndarray
    rho: np.ndarray  # (n_blocks, R)
    sigma: np.ndarray  # (n_blocks, R)
    ones_residual: np.ndarray  # (n_blocks, R)
    linear_gap: np.ndarray  # (S,)
    linear_regime: tuple[float, float] | None
    no_residual: DecayFit
    eps_sweep: list[tuple[float, DecayFit]]
    gamma_sweep: list[tuple[float, DecayFit]]
    verdicts: list[str]
    seconds: dict[str, float]
    tokens: list[str] | None = None  # the text of each token id (the model's detokenize, or the bytes)
    site: str | None = None  # the site name when injected at one (``layer`` is then its block)
    spectra_skipped: bool = False
    scaling: ScalingFit | None = None
    uniform: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
    seed: int = 0
    protocol: str = ""
    spectra_how: dict[str, np.ndarray] | None = None  # method and converged per spectral value

    @property
    def scale_index(self) -> int:
        return int(np.argmin(np.abs(self.exact.scales - self.protocol_scale)))

    @property
    def gain_linear(self) -> np.ndarray:
        """(n_blocks,): v.A_k delta / v.delta of the linearized run (scale-free), geometric
        mean over directions of its magnitude averaged over the read-out positions."""
        li = self.linear
        g = np.abs(li.gain[..., li.position_mask(self.read)])
        with np.errstate(divide="ignore", invalid="ignore"):
            g = _finite_mean(g, axis=-1).reshape(-1, li.K, li.S)[:, :, 0]
            return np.exp(_finite_mean(np.log(g), axis=1))

    def layer_table(self) -> list[dict[str, float]]:
        """One row per hidden state k >= layer: the protocol read-out, mean over directions."""
        j, ex, li = self.scale_index, self.exact, self.linear
        m = ex.position_mask(self.read)

        def at(p: Propagation, metric: str) -> np.ndarray:
            return p.view(metric, self.read).reshape(-1, p.K, p.S)[:, :, j].mean(axis=1)

        gain = self.gain_linear
        rows = []
        for i, k in enumerate(ex.layers):
            whole = float(k).is_integer()  # row 0 of a site inside block k is labelled k + 0.5
            k = int(k) if whole else float(k)
            row = {
                "layer": k,
                "h_norm": float(ex.base_norm[i][m].mean()),
                "delta_norm": float(at(ex, "delta_norm")[i]),
                "projection": float(at(ex, "projection")[i]),
                "projection_linear": float(at(li, "projection")[i]),
                "cosine": float(at(ex, "cosine")[i]),
                "norm_ratio": float(at(ex, "norm_ratio")[i]),
                "gain_linear": float(gain[i - 1]) if i else float("nan"),
                "rho": float(self.rho[i].max()) if i < self.rho.shape[0] else float("nan"),
                "sigma_max": float(self.sigma[i].max()) if i < self.sigma.shape[0] else float("nan"),
                "adjacent_cosine": float(ex.base_adjacent_cosine[k - 1][m].mean()) if whole and k else float("nan"),
                "step_norm": float(ex.base_step[k - 1][m].mean()) if whole and k else float("nan"),
                **self._linear_model_row(i, whole),
                **self._how(i),
            }
            rows.append(row)
        return rows

    def _linear_model_row(self, i: int, whole: bool) -> dict[str, float]:
        """Row i of the linear model (the scaling fit starts at a hidden state, so a site's row 0 has none)."""
        nan = float("nan")
        sc, un = self.scaling, self.uniform or {}
        fit = sc is not None and whole and i < sc.alpha.size
        ex = un.get("exact", ((), ()))
        return {"alpha": float(sc.alpha[i]) if fit else nan, "beta": float(sc.beta[i]) if fit else nan,
                "unexplained": float(sc.unexplained[i]) if fit else nan,
                "uniform": float(ex[0][i]) if i < len(ex[0]) else nan,
                "nonuniform": float(ex[1][i]) if i < len(ex[1]) else nan}

    def _how(self, i: int) -> dict[str, Any]:
        """Row i's spectral methods (distinct ones joined by "+") and whether all its tokens converged."""
        how = self.spectra_how
        if how is None or i >= self.rho.shape[0]:
            return {"rho_method": None, "sigma_method": None, "rho_converged": None, "sigma_converged": None}
        return {"rho_method": "+".join(sorted(set(how["rho_method"][i].tolist()))),
                "sigma_method": "+".join(sorted(set(how["sigma_method"][i].tolist()))),
                "rho_converged": bool(how["rho_converged"][i].all()),
                "sigma_converged": bool(how["sigma_converged"][i].all())}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, table, fits, spectra, ablations, verdicts and both runs."""
        return {
            "model": self.model, "config": self.config.to_dict(), "text": self.text,
            "ids": self.ids.tolist(), "tokens": self.tokens, "layer": self.layer, "site": self.site,
            "read": self.read,
            "protocol_scale": self.protocol_scale, "table": self.layer_table(),
            "fit_exact": self.fit_exact.to_dict(), "fit_linear": self.fit_linear.to_dict(),
            "spectral": {"skipped": self.spectra_skipped,
                         "reason": "spectra skipped (--no-spectra)" if self.spectra_skipped else None,
                         "blocks": list(range(self.layer, self.layer + self.rho.shape[0])),
                         "tokens": self.spectral_tokens.tolist(), "rho": self.rho.tolist(),
                         "sigma_max": self.sigma.tolist(), "ones_residual": self.ones_residual.tolist(),
                         **{k: v.tolist() for k, v in (self.spectra_how or {}).items()}},
            "scaling_fit": None if self.scaling is None else self.scaling.to_dict(),
            "uniform_split": self._uniform_dict(),
            "linear_gap": dict(zip(map(float, self.exact.scales), map(float, self.linear_gap))),
            "linear_regime": list(self.linear_regime) if self.linear_regime else None,
            "no_residual": self.no_residual.to_dict(),
            "eps_sweep": [{"eps": e, **f.to_dict()} for e, f in self.eps_sweep],
            "gamma_sweep": [{"gamma_scale": g, **f.to_dict()} for g, f in self.gamma_sweep],
            "verdicts": self.verdicts, "protocol": self.protocol, "seconds": self.seconds,
            "exact": self.exact.to_dict(), "linear": self.linear.to_dict(),
        }


    def _uniform_dict(self) -> dict[str, Any] | None:
        """Per hidden state from ``layer`` on: the norms of the uniform part and of the rest."""
        if self.uniform is None:
            return None
        out: dict[str, Any] = {"layers": [float(k) for k in self.exact.layers], "scale": self.protocol_scale}
        for run, (u, r) in self.uniform.items():
            sfx = "" if run == "exact" else f"_{run}"
            out[f"uniform{sfx}"], out[f"nonuniform{sfx}"] = u.tolist(), r.tolist()
        return out


def _finite_mean(a: np.ndarray, axis: int) -> np.ndarray:
    """The mean of the finite entries along ``axis``; NaN (silently) where there are none
    (a read-out token that was not injected has no gain at the injected state)."""
    ok = np.isfinite(a)
    n = ok.sum(axis=axis)
    total = np.where(ok, a, 0.0).sum(axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def _linear_gap(ex: Propagation, li: Propagation) -> np.ndarray:
    """(S,): max over the layers after the injection of |delta_ex - delta_lin| / |delta_lin|,
    both summed over the directions and the kept (read-out) positions; NaN where
    delta_lin is 0 at every such layer."""
    L = ex.deltas.shape[0]
    de = ex.deltas[1:].reshape(L - 1, ex.K, ex.S, -1).astype(np.float64)
    dl = li.deltas[1:].reshape(L - 1, li.K, li.S, -1).astype(np.float64)
    num = np.sqrt(((de - dl) ** 2).sum(axis=(1, 3)))
    den = np.sqrt((dl**2).sum(axis=(1, 3)))
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.where(den > 0, num / den, np.nan)
    out = np.full(ex.S, np.nan)
    ok = np.isfinite(gap).any(axis=0)
    out[ok] = np.nanmax(gap[:, ok], axis=0)
    return out


def _regime(scales: np.ndarray, gap: np.ndarray) -> tuple[float, float] | None:
    """The longest run of consecutive scales (sorted) whose gap is within LINEAR_TOL."""
    order = np.argsort(scales)
    ok = np.nan_to_num(gap[order], nan=np.inf) <= LINEAR_TOL
    best, run = None, None
    for i, good in enumerate(ok):
        run = (run[0], i) if good and run else ((i, i) if good else None)
        if run and (best is None or run[1] - run[0] > best[1] - best[0]):
            best = run
    return None if best is None else (float(scales[order][best[0]]), float(scales[order][best[1]]))
