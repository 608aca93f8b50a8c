"""The spectral condition on a model's weights: :func:`weight_spectra`, by layer and by matrix kind.

For every weight matrix W of a Stack (a loaded pretrained model, say), with d_out
outputs and d_in inputs: sigma_max, the RMS -> RMS operator norm sqrt(d_in/d_out)
sigma_max (Yang, Simon & Bernstein's spectral condition asks it to be Theta(1), i.e.
sigma_max = Theta(sqrt(d_out/d_in))), its ratio to the target sqrt(d_out/d_in) (the same
number), and the stable rank ||W||_F² / sigma_max² (between 1 and min(d_out, d_in)).
sigma_max comes from :func:`pyengine.weight_scan` (a dense LAPACK SVD up to a short side
of 1024, Lanczos above: the faster at each size). The fused arrays of a Stack are split
into the model's own matrices: ``w_qkv`` into q, k, v (k, v of n_kv_heads heads), a
gated ``w_in`` into gate and up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._figures import PAGE, check_format, layer_axis, log_axis, save, styled, subplots
from ..linalg.weights import weight_scan
from ..models.stack import Stack

__all__ = ["WeightSpectra", "weight_spectra"]

#: Matrix kinds, in the order the summary lists them.
KINDS = ("q", "k", "v", "o", "gate", "up", "down", "embed", "lm_head")


@dataclasses.dataclass(frozen=True)
class WeightSpectra:
    """Per-matrix spectra of a model; arrays in the order of ``name``."""

    name: tuple[str, ...]
    layer: np.ndarray  # block index, -1 for embeddings and the head
    kind: tuple[str, ...]
    d_out: np.ndarray
    d_in: np.ndarray
    sigma_max: np.ndarray
    rms_to_rms: np.ndarray  # = ratio to sqrt(d_out / d_in)
    stable_rank: np.ndarray
    frobenius: np.ndarray

    def __len__(self) -> int:
        return len(self.name)

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Per kind: count, median / min / max of rms_to_rms, median stable rank."""
        out = {}
        for k in [k for k in KINDS if k in self.kind] + sorted(set(self.kind) - set(KINDS)):
            sel = np.array([kk == k for kk in self.kind])
            r = self.rms_to_rms[sel]
            out[k] = {"count": int(sel.sum()), "median": float(np.median(r)), "min": float(r.min()),
                      "max": float(r.max()), "stable_rank": float(np.median(self.stable_rank[sel]))}
        return out

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v.tolist() for k, v in d.items()}

    def to_text(self, per_matrix: bool = False) -> str:
        """The summary by kind (and, if ``per_matrix``, one row per matrix)."""
        head = f"{'kind':<8} {'n':>3}  {'rms->rms median':>15} {'[min, max]':>19}  {'stable rank':>11}"
        rows = [head, "-" * len(head)]
        for k, s in self.by_kind().items():
            rows.append(f"{k:<8} {s['count']:>3}  {s['median']:>15.4g} [{s['min']:>8.4g}, {s['max']:>8.4g}]  "
                        f"{s['stable_rank']:>11.4g}")
        if per_matrix:
            w = max(len(n) for n in self.name)
            rows += ["", f"{'matrix':<{w}}  {'d_out x d_in':>12}  {'sigma_max':>10}  {'rms->rms':>9}  {'st.rank':>8}"]
            for i, n in enumerate(self.name):
                rows.append(f"{n:<{w}}  {f'{self.d_out[i]}x{self.d_in[i]}':>12}  {self.sigma_max[i]:>10.4g}  "
                            f"{self.rms_to_rms[i]:>9.4g}  {self.stable_rank[i]:>8.4g}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.to_text()

    @styled
    def plot(self, path: str, title: str = "", fmt: str = "png") -> str:
        """RMS -> RMS norm and stable rank against block index, one line per kind (log scales).

        Saved as ``path`` with the extension ``fmt`` (png, pdf or svg); returns the path written.
        """
        check_format(fmt)
        fig, ax = subplots(1, 2, size=(PAGE, 2.7))
        for k in self.by_kind():
            sel = np.array([kk == k for kk in self.kind]) & (self.layer >= 0)
            if sel.any():
                ax[0].plot(self.layer[sel], self.rms_to_rms[sel], "o-", label=k)
                ax[1].plot(self.layer[sel], self.stable_rank[sel], "o-", label=k)
        ax[0].axhline(1.0, color="k", lw=0.6, ls="--")
        ax[0].set(xlabel="block", ylabel=r"$\sqrt{d_{\mathrm{in}}/d_{\mathrm{out}}}\;\sigma_{\max}(W)$ (RMS $\to$ RMS)",
                  title=f"spectral condition: {title}" if title else "spectral condition")
        ax[1].set(xlabel="block", ylabel=r"stable rank $\|W\|_F^2 / \sigma_{\max}^2$", title="stable rank")
        for a in ax:
            log_axis(a)
            layer_axis(a)
        handles, labels = ax[0].get_legend_handles_labels()
        fig.legend(handles, labels, title="matrix", loc="outside right center")
        return save(fig, path, fmt)


def _matrices(stack: Stack) -> list[tuple[str, int, str, np.ndarray]]:
    """(name, block, kind, W stored (d_in, d_out)) of every matrix of the stack."""
    c = stack.config
    w = stack.weights
    dh = c.head_dim
    out: list[tuple[str, int, str, np.ndarray]] = []
    for k in range(c.n_layers):
        p = f"blocks.{k}."
        qkv = w[p + "attn.w_qkv"]
        widths = [c.n_heads * dh, c.n_kv_heads * dh, c.n_kv_heads * dh]
        start = 0
        for kind, n in zip("qkv", widths):
            out.append((f"{p}attn.{kind}", k, kind, qkv[:, start:start + n]))
            start += n
        out.append((p + "attn.o", k, "o", w[p + "attn.w_o"]))
        win = w[p + "mlp.w_in"]
        if c.activation == "silu_gated":
            out += [(p + "mlp.gate", k, "gate", win[:, :c.d_mlp]), (p + "mlp.up", k, "up", win[:, c.d_mlp:])]
        else:
            out.append((p + "mlp.up", k, "up", win))
        out.append((p + "mlp.down", k, "down", w[p + "mlp.w_out"]))
    if "embed.tokens" in w:  # (vocab, d): a one-hot (vocab) -> d map, stored (in, out)
        out.append(("embed.tokens", -1, "embed", w["embed.tokens"]))
    if "lm_head.weight" in w:  # stored (vocab, d) = (out, in)
        out.append(("lm_head", -1, "lm_head", w["lm_head.weight"].T))
    return out


def weight_spectra(model: Stack, *, include_embeddings: bool = True, tol: float = 1e-8, seed: int = 0) -> WeightSpectra:
    """sigma_max, RMS -> RMS norm, stable rank of every weight matrix of ``model``.

    Parameters
    ----------
    model : Stack
        A :class:`~pyengine.models.stack.Stack` or a loaded
        :class:`~pyengine.models.pretrained.PretrainedModel`.
    include_embeddings : bool
        Also the token embedding and a separate LM head.
    tol, seed
        For the Lanczos path of :func:`pyengine.weight_scan` (matrices whose short side is over 1024).
    """
    if not isinstance(model, Stack):
        raise TypeError(f"model must be a Stack or a PretrainedModel; got {type(model).__name__}")
    mats = [m for m in _matrices(model) if include_embeddings or m[1] >= 0]
    scan = weight_scan({n: np.ascontiguousarray(a) for n, _, _, a in mats}, layout="in_out", tol=tol, seed=seed)
    fro = np.array([float(np.linalg.norm(a.astype(np.float64))) for _, _, _, a in mats])
    return WeightSpectra(
        name=scan.name, layer=np.array([m[1] for m in mats], np.int64), kind=tuple(m[2] for m in mats),
        d_out=scan.d_out, d_in=scan.d_in, sigma_max=scan.sigma_max, rms_to_rms=scan.rms_to_rms,
        stable_rank=fro**2 / scan.sigma_max**2, frobenius=fro,
    )
