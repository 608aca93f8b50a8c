"""asv suites for issue 18's per-call targets, each a figure measured in one process.

``SmallCall.track_us_per_call``: a public kernel on one token of d = 768 (float32,
``backend="auto"``, allocating its result), microseconds per call; the target is <= 8.
``LayerNormVsTorch.track_speedup``: torch's ``F.layer_norm`` time over ``pe.layer_norm``'s
at (2048, 768) float32, both allocating; the target is >= 1. ``NumbaVsCpp.track_ratio``:
the Numba backend's time over the C++ one with ``out=``; the target is <= 1.5.
"""

from __future__ import annotations

import numpy as np

import pyengine as pe

from .common import fastest_per_call, median_time, require_backend

D = 768


def _per_call(fn, n: int = 2000, repeat: int = 7) -> float:
    """The fastest of ``repeat`` means over ``n`` calls, in seconds, after one warm-up call:
    per-call overhead is a floor, and the minimum is the figure least disturbed by other work."""
    fn()
    return fastest_per_call(fn, repeat, loops=n)


def _one_token_calls():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, D)).astype(np.float32)
    v = rng.standard_normal((1, D)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, D).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    p = pe.softmax(x)
    return {
        "layer_norm": lambda: pe.layer_norm(x, g, b),
        "rms_norm": lambda: pe.rms_norm(x, g),
        "layer_norm_jvp": lambda: pe.layer_norm_jvp(x, v, g),
        "layer_norm_vjp": lambda: pe.layer_norm_vjp(x, v, g),
        "rms_norm_jvp": lambda: pe.rms_norm_jvp(x, v, g),
        "gelu": lambda: pe.activation("gelu", x),
        "gelu_grad": lambda: pe.activation_jvp_coef("gelu", x),
        "softmax": lambda: pe.softmax(x),
        "softmax_jvp": lambda: pe.softmax_jvp(p, v),
    }


class SmallCall:
    params = [list(_one_token_calls())]
    param_names = ["kernel"]

    def setup(self, kernel):
        self.call = _one_token_calls()[kernel]

    def track_us_per_call(self, kernel):
        return _per_call(self.call) * 1e6

    track_us_per_call.unit = "us"


class LayerNormVsTorch:
    def setup(self):
        try:
            import torch
            import torch.nn.functional as F
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2048, D)).astype(np.float32)
        g = rng.uniform(0.5, 1.5, D).astype(np.float32)
        b = rng.standard_normal(D).astype(np.float32)
        tx, tg, tb = (torch.from_numpy(a) for a in (x, g, b))
        self.ours = lambda: pe.layer_norm(x, g, b)
        self.theirs = lambda: F.layer_norm(tx, (D,), tg, tb)

    def track_speedup(self):
        return median_time(self.theirs, 30) / median_time(self.ours, 30)

    track_speedup.unit = "torch time / pyengine time"


class NumbaVsCpp:
    """The norm kernels at (8192, 4096) float32; the attention softmax and its JVP on a GPT-2
    small batch of causal scores, (64 sequences x 12 heads, 128, 128) float32."""

    params = [["layer_norm", "layer_norm_jvp", "layer_norm_vjp", "rms_norm", "rms_norm_jvp", "rms_norm_vjp",
               "softmax", "softmax_jvp"]]
    param_names = ["kernel"]
    timeout = 600

    def setup(self, kernel):
        require_backend("numba")
        require_backend("cpp")
        rng = np.random.default_rng(0)
        if kernel.startswith("softmax"):
            s = (3.0 * rng.standard_normal((64 * 12, 128, 128))).astype(np.float32)
            if kernel == "softmax":
                args, kw = (s,), {"offset": 0}
            else:
                args, kw = (pe.softmax(s[:12], offset=0), rng.standard_normal((64, 12, 128, 128)).astype(np.float32)), {}
        else:
            x = (1.0 + rng.standard_normal((8192, 4096))).astype(np.float32)
            g = rng.uniform(0.5, 1.5, 4096).astype(np.float32)
            args, kw = ((x, g) if kernel == "rms_norm" else (x, g, np.zeros(4096, np.float32))), {}
            if kernel.endswith(("jvp", "vjp")):
                args = (x, rng.standard_normal(x.shape).astype(np.float32), g)
        fn, out = getattr(pe, kernel), np.empty_like(args[1] if kernel == "softmax_jvp" else args[0])
        self.calls = {be: (lambda be=be: fn(*args, backend=be, out=out, **kw)) for be in ("numba", "cpp")}

    def track_ratio(self, kernel):
        return median_time(self.calls["numba"], 10) / median_time(self.calls["cpp"], 10)

    track_ratio.unit = "numba time / cpp time"
