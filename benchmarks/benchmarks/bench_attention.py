"""asv suites for the attention backward kernels and the fused head: one class per kernel id.

``time_<kernel>`` times one kernel call (``pyengine.backends.resolve``, preallocated
outputs, seeded arrays). Shapes: ``12x128x128x64`` is the (12 heads, 128, 128)
score-gradient target with GPT-2's head width 64;
``1x2000x2000x10`` the attention-dynamics experiment's head (T = 2000, dk = 10,
dv = 15), where the fused kernels run every training step. All causal.
"""

from __future__ import annotations

import numpy as np

from pyengine import backends

from .common import BACKENDS, DTYPES, KernelBenchmark, require_backend

#: heads x Tq x Tk x head width.
SHAPES = ["12x128x128x64", "1x2000x2000x10"]


def _arrays(kernel: str, dtype: str, shape: str) -> list:
    n, tq, tk, d = (int(s) for s in shape.split("x"))
    dv = 15 if d == 10 else d  # the experiment's value width
    rng = np.random.default_rng(0)
    rand = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    if kernel in ("attention_score_grad", "attention_advantage"):
        p = np.empty((n, tq, tk), dtype)
        backends.resolve("softmax", "numpy")(3.0 * rand(n, tq, tk), 0, p)
        outs = [np.zeros_like(p) for _ in range(2 if kernel == "attention_advantage" else 1)]
        return [p, rand(n, tq, dv), rand(n, tk, dv), 0, *outs]
    q, k, v = rand(n, tq, d), rand(n, tk, d), rand(n, tk, dv)
    scale = 1.0 / np.sqrt(d)
    lse, ent = np.zeros((n, tq)), np.zeros((n, tq))
    out = np.zeros((n, tq, dv), dtype)
    if kernel == "attention_forward":
        return [q, k, v, 0, scale, out, lse, ent]
    backends.resolve("attention_forward", "cpp" if backends.provides("attention_forward", "cpp") else "numpy")(
        q, k, v, 0, scale, out, lse, ent)
    return [q, k, v, out, rand(n, tq, dv), lse, 0, scale, np.zeros_like(q), np.zeros_like(k), np.zeros_like(v),
            ent]


class _Attention(KernelBenchmark):
    kernel = ""
    params = [BACKENDS, DTYPES, SHAPES]

    def make(self, rng, backend, dtype, shape):
        if backend == "numpy" and shape.startswith("1x2000") and self.kernel.endswith("backward"):
            raise NotImplementedError("the materialized reference backward at T = 2000 takes minutes")
        self.fn = backends.resolve(self.kernel, backend)
        self.args = _arrays(self.kernel, dtype, shape)
        return lambda: self.fn(*self.args)


class AttentionScoreGrad(_Attention):
    kernel = "attention_score_grad"

    def time_attention_score_grad(self, *params):
        self.fn(*self.args)


class AttentionAdvantage(_Attention):
    kernel = "attention_advantage"

    def time_attention_advantage(self, *params):
        self.fn(*self.args)


class AttentionForward(_Attention):
    kernel = "attention_forward"

    def time_attention_forward(self, *params):
        self.fn(*self.args)


class AttentionBackward(_Attention):
    kernel = "attention_backward"

    def time_attention_backward(self, *params):
        self.fn(*self.args)


class AttentionTrainingStep(KernelBenchmark):
    """One full-batch training step of the attention-dynamics model (T = 2000, float32):
    ``Model.step`` as the experiment runs it (single-threaded BLAS; the kernels' threads).
    The comparison with torch autograd is ``benchmarks/scripts/attention_step.py``."""

    params = [[b for b in BACKENDS if b != "numpy"]]
    param_names = ["backend"]
    seed = 42  # the data and weights; the symbols' means from seed 0

    def make(self, rng, backend):
        import importlib

        from threadpoolctl import threadpool_limits

        ad = importlib.import_module("pyengine.experiments.attention_dynamics")
        mu = np.random.default_rng(0).standard_normal((8, ad.D_IN))
        X, y = ad.make_data(ad.markov_chain(), 2000, mu, rng)
        self.model = ad.Model(X.astype(np.float32), y, 8, backend)
        self.W = ad.init_params(rng, 8, "float32")
        self.limit = threadpool_limits(1)  # kept for the process: asv runs each benchmark in its own
        return lambda: self.model.step(self.W)

    def time_training_step(self, backend):
        self.model.step(self.W)


class AttentionCppRegisterBlocked:
    """The C++ kernels' register-blocked path on the 12x128x128x64 shape, which otherwise takes
    BLAS (``_core.attention_force_fallback``): what runs where NumPy has no OpenBLAS."""

    params = [["attention_score_grad", "attention_advantage", "attention_backward"], DTYPES]
    param_names = ["kernel", "dtype"]
    timeout = 600

    def setup(self, kernel, dtype):
        require_backend("cpp")
        from pyengine import _core

        self.core = _core
        self.fn = backends.resolve(kernel, "cpp")
        self.args = _arrays(kernel, dtype, "12x128x128x64")
        _core.attention_force_fallback(True)
        self.fn(*self.args)

    def teardown(self, kernel, dtype):
        self.core.attention_force_fallback(False)

    def time_register_blocked(self, kernel, dtype):
        self.fn(*self.args)
