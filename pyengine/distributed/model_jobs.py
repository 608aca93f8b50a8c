"""Sweep jobs over a model: ``"spectral"`` (every norm layer over a corpus) and ``"recovery"``
(propagation of injected directions over prompts x layers, with directions x scales inside).

Both name the model by a string (:mod:`pyengine.distributed.worker` loads it once per
worker) and ship token ids as the points' input arrays.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..corpus import load_corpus
from .jobs import Job, int_axis, real_axis, register_job, seed_of
from .worker import SYNTHETIC, get_model

__all__ = ["RecoveryJob", "SpectralJob", "corpus_ids", "corpus_text", "norm_sites"]

def corpus_text(path: str | None = None) -> str:
    """The text of a corpus file, or the built-in corpus.

    The built-in corpus is :func:`pyengine.corpus.load_corpus` (310 CC0 sentences, one per
    line), joined with newlines; :func:`corpus_ids` repeats it to the requested length.
    """
    if path is not None:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except FileNotFoundError:
            raise OSError(f"corpus file not found: {path}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"corpus file {path} is not UTF-8 text: {exc}") from None
        if not text.strip():
            raise ValueError(f"corpus file {path} is empty")
        return text
    return _as_text(load_corpus())


def _as_text(corpus: Any) -> str:
    """A corpus given as one string or as a sequence of documents, as one string."""
    return corpus if isinstance(corpus, str) else "\n".join(corpus)


def _tokenize(model_name: str, text: str) -> np.ndarray:
    if model_name in SYNTHETIC:  # byte-level vocabulary of the synthetic stacks
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    return np.asarray(get_model(model_name).tokenize(text), np.int64)


def corpus_size(model_name: str, path: str | None = None) -> int:
    """How many token ids the corpus has for ``model_name`` (before :func:`corpus_ids` repeats it)."""
    return int(_tokenize(model_name, corpus_text(path)).size)


def corpus_ids(model_name: str, tokens: int, path: str | None = None) -> np.ndarray:
    """``tokens`` token ids of the corpus for ``model_name``, the text repeated if it is shorter."""
    ids = _tokenize(model_name, corpus_text(path))
    if ids.size == 0:
        raise ValueError("the corpus has no tokens")
    reps = -(-tokens // ids.size)
    return np.tile(ids, reps)[:tokens]


def norm_sites(model: Any) -> list[str]:
    """Names (weight prefixes) of every normalization layer of ``model``, in stream order."""
    cfg = model.config
    sites = ["embed.norm"] if cfg.embed_norm else []
    for k in range(cfg.n_layers):
        sites.append(f"blocks.{k}.norm1")
        if cfg.layout == "sequential":
            sites.append(f"blocks.{k}.norm2")
    if cfg.final_norm:
        sites.append("final_norm")
    return sites


def _norm_inputs(model: Any, ids: np.ndarray) -> list[np.ndarray]:
    """The input (T, d) of every site of :func:`norm_sites` for one sequence of ids."""
    cfg = model.config
    h, caches = model.forward(ids, cache_from=0)
    out = []
    if cfg.embed_norm:
        if cfg.positions not in ("learned", "none"):
            raise ValueError(f"embedding-norm inputs need learned or no positions; got {cfg.positions!r}")
        x = model.embed(ids)
        if cfg.positions == "learned":
            x = x + model.weights["embed.positions"][: ids.size].astype(x.dtype)
        out.append(x)
    for c in caches:  # a BlockCache keeps each norm's input under its weight prefix (B = 1)
        out.append(c.data["norm1"][0])
        if cfg.layout == "sequential":
            out.append(c.data["norm2"][0])
    if cfg.final_norm:
        out.append(h[-1])
    return out


def _check_int(params: dict[str, Any], key: str, low: int) -> None:
    v = params[key]
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ValueError(f"grid[{key!r}] must be an integer >= {low}; got {v!r}")


class SpectralJob(Job):
    """``"spectral"``: per-token sigma_max of the Jacobian of every normalization layer of
    ``model`` over ``tokens`` tokens of ``corpus`` (a text file; default the built-in corpus),
    cut into windows of ``seq_len`` tokens (one grid point each; the last may be shorter).

    Metrics: ``sigma`` (sites, tokens) in corpus order; ``params["sites"]`` names the rows.
    ``method``/``mode``/``tol``/``max_iter`` as :func:`pyengine.layer_norm_spectral_norm`;
    a window's start vectors are seeded by (seed, window, site), so any chunking agrees.
    """

    name = "spectral"
    defaults = {"model": "all-MiniLM-L6-v2", "corpus": None, "tokens": 100_000, "seq_len": 128,
                "method": "exact", "mode": "full", "tol": 1e-6, "max_iter": 1000, "seed": 0,
                "dtype": "float32", "backend": "auto", "sites": None}

    def plan(self, grid: Any) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, np.ndarray]]]:
        params, _, _ = super().plan(grid)
        want = params.pop("sites")  # norm-input site names or globs (None: every norm)
        if not isinstance(params["model"], str):
            raise TypeError(f"grid['model'] must be a model name or path; got {type(params['model']).__name__}")
        for k, low in (("tokens", 1), ("seq_len", 1), ("max_iter", 1), ("seed", 0)):
            _check_int(params, k, low)
        for k, allowed in (("method", ("exact", "power", "lanczos")), ("mode", ("full", "frozen_scale")),
                           ("dtype", ("float32", "float64")), ("backend", ("auto", "cpp", "numba", "numpy"))):
            if params[k] not in allowed:
                raise ValueError(f"grid[{k!r}] must be one of {', '.join(map(repr, allowed))}; got {params[k]!r}")
        model = get_model(params["model"], params["dtype"])
        if params["seq_len"] > model.config.max_seq_len:
            raise ValueError(f"grid['seq_len'] = {params['seq_len']} exceeds the model's max_seq_len = "
                             f"{model.config.max_seq_len}")
        ids = corpus_ids(params["model"], params["tokens"], params["corpus"])
        L = params["seq_len"]
        params["sites"] = norm_sites(model)
        if want is not None:
            from ..analysis.site_spectra import norm_input_sites, select_norm_input_sites

            picked = select_norm_input_sites(model, want)  # ValueError naming the sites when a pattern matches none
            params["sites"] = [s for s in params["sites"] if s + ".input" in picked]
            if len(params["sites"]) != len(picked):
                raise ValueError(f"grid['sites']: the spectral job scans {', '.join(norm_sites(model))} (as "
                                 f"'<norm>.input'); {sorted(set(picked) - {s + '.input' for s in norm_sites(model)})} "
                                 f"of {norm_input_sites(model)[:3]}... are not among them")
        params["d"] = model.config.d_model
        points = [{"window": i, "start": a} for i, a in enumerate(range(0, ids.size, L))]
        return params, points, [{"ids": ids[p["start"]:p["start"] + L]} for p in points]

    def point_bytes(self, params: dict[str, Any], point: dict[str, Any]) -> int:
        # forward activations of one window (about 16 (T, d) arrays per block) plus the site inputs
        n_sites = len(params["sites"])
        return 4 * params["seq_len"] * params["d"] * (16 * n_sites + 8)

    def run(self, params: dict[str, Any], point: dict[str, Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..linalg.spectral import layer_norm_spectral_norm, rms_norm_spectral_norm

        model = get_model(params["model"], params["dtype"])
        cfg = model.config
        fn = layer_norm_spectral_norm if cfg.norm == "layernorm" else rms_norm_spectral_norm
        ids = inputs["ids"]
        sigma = np.empty((len(params["sites"]), ids.size), np.float64)
        for s, (site, x) in enumerate(zip(params["sites"], _norm_inputs(model, ids))):
            gamma = model.weights[site + ".gamma"].astype(x.dtype) * x.dtype.type(cfg.gamma_scale)
            res = fn(x, gamma, cfg.eps, params["mode"], params["method"], tol=params["tol"],
                     max_iter=params["max_iter"], seed=seed_of(params["seed"], point["window"], s),
                     backend=params["backend"])
            sigma[s] = res.sigma
        return {"sigma": sigma}

    def combine(self, params: dict[str, Any], points: list[dict[str, Any]],
                results: list[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
        n_sites, T = len(params["sites"]), params["tokens"]
        sigma = np.full((n_sites, T), np.nan)
        for p, r in zip(points, results):
            if r is not None:
                sigma[:, p["start"]:p["start"] + r["sigma"].shape[1]] = r["sigma"]
        return {"sigma": sigma}


class RecoveryJob(Job):
    """``"recovery"``: :func:`pyengine.propagate` of ``directions`` x ``scales`` injected at hidden
    state ``layers`` of every prompt of ``prompts`` (a grid point is one prompt x one layer).

    ``directions``: an int K (seeded unit vectors, by ``seed``) or an array (K, d_model).
    Metrics read at position ``read`` (``"last"`` or an int) of every hidden state, shape
    (prompts, layers, n_layers + 1, K, S), NaN before the injection layer: ``cosine``,
    ``projection``, ``norm_ratio``, ``delta_norm``.
    """

    name = "recovery"
    defaults = {"model": "default", "prompts": None, "layers": (2,), "directions": 4, "scales": (1.0, 4.0, 16.0),
                "positions": "all", "read": "last", "linearized": False, "seed": 0, "dtype": "float32"}
    axes = ("prompts", "layers")
    required = ("prompts",)
    METRICS = ("cosine", "projection", "norm_ratio", "delta_norm")

    def plan(self, grid: Any) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, np.ndarray]]]:
        grid = dict(grid)
        if isinstance(grid.get("directions"), np.ndarray):  # an array is a parameter, not an axis of values
            grid["directions"] = grid["directions"].tolist()
        params, points, _ = super().plan(grid)
        for p in params["prompts"]:
            if not isinstance(p, str) or not p:
                raise ValueError(f"grid['prompts'] must hold non-empty strings; got {p!r}")
        int_axis(params, "layers")
        model = get_model(params["model"], params["dtype"])
        n, d = model.config.n_layers, model.config.d_model
        for v in params["layers"]:
            if v >= n:
                raise ValueError(f"grid['layers'] must be hidden-state indices < n_layers = {n}; got {v}")
        if isinstance(params["scales"], (numbers.Real, np.number)):
            params["scales"] = [params["scales"]]
        params["scales"] = [float(s) for s in params["scales"]]
        real_axis(params, "scales")
        dirs = params["directions"]
        if isinstance(dirs, numbers.Integral) and not isinstance(dirs, bool):
            if dirs < 1:
                raise ValueError(f"grid['directions'] must be a count >= 1 or an array (K, {d}); got {dirs}")
            V = np.random.default_rng(seed_of(params["seed"], 7)).standard_normal((dirs, d))
        else:
            V = np.asarray(dirs, np.float64)
            if V.ndim != 2 or V.shape[1] != d or not np.isfinite(V).all() or (np.linalg.norm(V, axis=1) == 0).any():
                raise ValueError(f"grid['directions'] must be a count or a finite array (K, {d}) of non-zero "
                                 f"rows; got shape {V.shape}")
        params["directions"] = (V / np.linalg.norm(V, axis=1, keepdims=True)).tolist()
        if params["read"] != "last" and (isinstance(params["read"], bool) or not isinstance(params["read"], int)):
            raise ValueError(f"grid['read'] must be 'last' or a position index; got {params['read']!r}")
        params["n_layers"] = n
        ids = [_tokenize(params["model"], p) for p in params["prompts"]]
        index = {p: i for i, p in enumerate(params["prompts"])}
        for pt in points:
            pt["prompt"] = index[pt["prompts"]]
        return params, points, [{"ids": ids[pt["prompt"]]} for pt in points]

    def point_bytes(self, params: dict[str, Any], point: dict[str, Any]) -> int:
        return 64 << 20  # propagate's own batches are capped near 1 GiB; a point is one prompt

    def run(self, params: dict[str, Any], point: dict[str, Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..analysis import propagate

        model = get_model(params["model"], params["dtype"])
        V = np.asarray(params["directions"], np.float64)
        S = np.asarray(params["scales"], np.float64)
        layer = point["layers"]
        pr = propagate(model, inputs["ids"], V, S, layer, params["positions"], linearized=params["linearized"])
        t = -1 if params["read"] == "last" else params["read"]
        out = {}
        for m in self.METRICS:
            full = np.full((params["n_layers"] + 1, V.shape[0], S.size), np.nan)
            full[layer:] = getattr(pr, m)[:, :, t].reshape(-1, V.shape[0], S.size)
            out[m] = full
        return out


register_job(SpectralJob())
register_job(RecoveryJob())
