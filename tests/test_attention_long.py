"""The fused attention head at lengths past the compiled backends' blocking: every path of
the Numba kernels' lane sums (blocks of 4 x LANES = 256 tokens, single LANES blocks, the
padding to a multiple of LANES) and the C++ chunks, odd lengths, causal, offset and
bidirectional masks; the backward pass of every backend against central differences of
its own forward pass in float64."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine.kernels import attention as pa

# (Tq, Tk, dk, dv, offset): odd lengths; 301 = 256 + 45 (one 4-LANES block, no whole LANES
# block, a padded tail); 641 = 2 x 256 + 2 x 64 + 1 (every path); Tq != Tk with an offset;
# 199 and 255 queries: the backward pass on the short-sequence kernels (attention.SHORT = 256).
LONG_CASES = [(301, 301, 10, 15, 0), (641, 641, 3, 5, None), (263, 333, 7, 9, 134), (199, 333, 7, 9, 134),
              (257, 257, 1, 1, 0), (255, 255, 4, 4, 0)]
LONG_IDS = [f"{c[0]}x{c[1]}-dk{c[2]}dv{c[3]}-off{c[4]}" for c in LONG_CASES]


def _head(tq, tk, dk, dv, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, tq, dk)), rng.standard_normal((2, tk, dk))
    k = k * 1.5  # logits up to ~|q||k|/sqrt(dk) * 1.5: peaked and flat rows both
    v, d_o = rng.standard_normal((2, tk, dv)), rng.standard_normal((2, tq, dv))
    return [a.astype(dtype) for a in (q, k, v, d_o)]


@pytest.mark.parametrize(("tq", "tk", "dk", "dv", "offset"), LONG_CASES, ids=LONG_IDS)
def test_long_fused_head_matches_the_reference(compiled, dtype, tq, tk, dk, dv, offset):
    q, k, v, d_o = _head(tq, tk, dk, dv, dtype, seed=tq)
    want = pa.attention_forward(q, k, v, offset=offset, backend="numpy")
    got = pa.attention_forward(q, k, v, offset=offset, backend=compiled)
    rtol = 1e-12 if dtype == np.float64 else 3e-5
    big = lambda a: float(np.abs(a).max())  # noqa: E731
    np.testing.assert_allclose(got.out, want.out, rtol=rtol, atol=rtol * big(v))
    np.testing.assert_allclose(got.lse, want.lse, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(got.entropy, want.entropy, rtol=rtol, atol=rtol * np.log(tk))
    wb = pa.attention_backward(q, k, v, d_o, want.lse, o=want.out, offset=offset, backend="numpy")
    gb = pa.attention_backward(q, k, v, d_o, want.lse, o=want.out, offset=offset, backend=compiled)
    for name in ("dq", "dk", "dv", "spread"):
        w = getattr(wb, name)
        np.testing.assert_allclose(getattr(gb, name), w, rtol=rtol, atol=rtol * big(w), err_msg=name)


@pytest.mark.parametrize("offset", [0, None], ids=["causal", "bidirectional"])
def test_backward_is_the_central_difference_of_its_forward(backend, offset):
    """<(dq, dk, dv), (a, b, c)> = d/dt sum(w * out(q + t a, k + t b, v + t c)) at t = 0, float64, T odd."""
    tq = tk = 301 if backend != "numpy" else 67
    q, k, v, w = _head(tq, tk, 6, 5, np.float64, seed=11)
    rng = np.random.default_rng(12)
    dirs = [rng.standard_normal(a.shape) for a in (q, k, v)]
    sc = 0.45

    def loss(t):
        out = pa.attention_forward(q + t * dirs[0], k + t * dirs[1], v + t * dirs[2], offset=offset, scale=sc,
                                   backend=backend).out
        return float((w * out).sum())

    f = pa.attention_forward(q, k, v, offset=offset, scale=sc, backend=backend)
    g = pa.attention_backward(q, k, v, w, f.lse, o=f.out, offset=offset, scale=sc, backend=backend)
    analytic = sum(float((gi * di).sum()) for gi, di in zip(g[:3], dirs))
    h = 1e-5
    fd = (loss(h) - loss(-h)) / (2 * h)
    fd2 = (loss(h / 2) - loss(-h / 2)) / h  # Richardson: O(h^4)
    fd = (4 * fd2 - fd) / 3
    assert abs(analytic - fd) <= 1e-8 * max(1.0, abs(fd)), (analytic, fd)
    # and each input's share alone (a wrong dk cannot hide behind a right dq)
    for i in range(3):
        one = [d if j == i else np.zeros_like(d) for j, d in enumerate(dirs)]

        def part(t, one=one):
            out = pa.attention_forward(q + t * one[0], k + t * one[1], v + t * one[2], offset=offset, scale=sc,
                                       backend=backend).out
            return float((w * out).sum())

        est = (4 * (part(h / 2) - part(-h / 2)) / h - (part(h) - part(-h)) / (2 * h)) / 3
        got = float((g[i] * dirs[i]).sum())
        assert abs(got - est) <= 1e-8 * max(1.0, abs(est)), (i, got, est)
