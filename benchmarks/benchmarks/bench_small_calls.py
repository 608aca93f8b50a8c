"""asv suites for the per-call targets, each a figure measured in one process.

``SmallCall.track_us_per_call``: a public kernel on one token of d = 768 (float32,
``backend="auto"``, allocating its result), microseconds per call; the target is <= 8.
``LayerNormVsTorch.track_speedup``: torch's ``F.layer_norm`` time over ``pe.layer_norm``'s
at (2048, 768) float32, both allocating; the target is >= 1. ``NumbaVsCpp.track_ratio``:
the Numba backend's time over the C++ one with ``out=``; the target is <= 1.5. Both ratios
alternate the two calls (``common.interleaved_ratio``).
"""

from __future__ import annotations

import numpy as np

import pyengine as pe
from pyengine import backends

from .common import fastest_per_call, interleaved_ratio, require_backend

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
        return interleaved_ratio(self.theirs, self.ours, 30)

    track_speedup.unit = "torch time / pyengine time"


class NumbaVsCpp:
    """Numba's time over C++'s (target: within 1.5x on every kernel). The norm kernels at
    (8192, d) float32; their exact sigma_max at (256, d); the attention softmax and its JVP on a
    GPT-2 small batch of causal scores, (64 sequences x 12 heads, 128, 128) float32 (d = 4096
    only: they have no d)."""

    params = [["layer_norm", "layer_norm_jvp", "layer_norm_vjp", "rms_norm", "rms_norm_jvp", "rms_norm_vjp",
               "layer_norm_sigma_max", "rms_norm_sigma_max", "softmax", "softmax_jvp"], [768, 4096]]
    param_names = ["kernel", "d"]
    timeout = 600

    def setup(self, kernel, d):
        require_backend("numba")
        require_backend("cpp")
        rng = np.random.default_rng(0)
        if kernel.startswith("softmax"):
            if d != 4096:
                raise NotImplementedError("the softmax rows have no d")
            s = (3.0 * rng.standard_normal((64 * 12, 128, 128))).astype(np.float32)
            if kernel == "softmax":
                args, kw = (s,), {"offset": 0}
            else:
                args, kw = (pe.softmax(s[:12], offset=0), rng.standard_normal((64, 12, 128, 128)).astype(np.float32)), {}
        elif kernel.endswith("sigma_max"):
            x = (1.0 + rng.standard_normal((256, d))).astype(np.float32)
            args = (x, rng.uniform(0.5, 1.5, d).astype(np.float32))
        else:
            x = (1.0 + rng.standard_normal((8192, d))).astype(np.float32)
            g = rng.uniform(0.5, 1.5, d).astype(np.float32)
            args, kw = ((x, g) if kernel == "rms_norm" else (x, g, np.zeros(d, np.float32))), {}
            if kernel.endswith(("jvp", "vjp")):
                args = (x, rng.standard_normal(x.shape).astype(np.float32), g)
        if kernel.endswith("sigma_max"):  # the registered kernels (the public call is spectral_norm)
            out = np.empty(args[0].shape[0])
            fns = {be: backends.resolve(kernel, be) for be in ("numba", "cpp")}
            self.calls = {be: (lambda be=be: fns[be](*args, 1e-5, False, out)) for be in fns}
        else:
            fn = getattr(pe, kernel)
            out = np.empty_like(args[1] if kernel == "softmax_jvp" else args[0])
            self.calls = {be: (lambda be=be: fn(*args, backend=be, out=out, **kw)) for be in ("numba", "cpp")}
        for call in self.calls.values():
            call()  # compilation and first touch are not timed

    def track_ratio(self, kernel, d):
        return interleaved_ratio(self.calls["numba"], self.calls["cpp"], 30)

    track_ratio.unit = "numba time / cpp time"
