"""Initialization schemes: each measured variance against its formula, and the stack's init.

Tolerances: a sample variance of N i.i.d. entries has relative standard error
sqrt((kurtosis - 1)/N) (2/N for a normal, 0.8/N for a uniform). With N = 256 * 512,
that is at most 0.0039; the tests allow 3 % (more than 7 standard errors).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import pyengine as pe
from pyengine.models import initialization as ini

FAN_IN, FAN_OUT = 256, 512
CASES = [
    ("gpt2", {}),
    ("xavier_normal", {}),
    ("xavier_uniform", {}),
    ("xavier", {}),
    ("kaiming_normal", {}),
    ("kaiming_normal", {"mode": "fan_out"}),
    ("kaiming_normal", {"nonlinearity": "tanh"}),
    ("kaiming_uniform", {}),
    ("kaiming_uniform", {"nonlinearity": "leaky_relu"}),
    ("kaiming", {}),
    ("torch_default", {}),
    ("orthogonal", {}),
    ("orthogonal", {"gain": 2.0}),
]


@pytest.mark.parametrize("shape", [(FAN_IN, FAN_OUT), (FAN_OUT, FAN_IN)], ids=["wide", "tall"])
@pytest.mark.parametrize(("scheme", "kw"), CASES, ids=[f"{s}-{'-'.join(map(str, k.values())) or 'default'}" for s, k in CASES])
def test_variance_matches_the_formula(scheme, kw, shape):
    rng = np.random.default_rng(1)
    w = ini.init_matrix(rng, scheme, *shape, **kw)
    assert w.shape == shape and w.dtype == np.float64
    want = ini.init_variance(scheme, *shape, **kw)
    assert np.mean(w * w) == pytest.approx(want, rel=0.03)
    assert abs(np.mean(w)) < 5 * math.sqrt(want / w.size)


def test_the_formulas_by_hand():
    n_in, n_out = 300, 100
    assert ini.init_variance("xavier_uniform", n_in, n_out) == pytest.approx(2 / 400)
    assert ini.init_variance("kaiming_normal", n_in, n_out) == pytest.approx(2 / 300)
    assert ini.init_variance("kaiming_normal", n_in, n_out, mode="fan_out") == pytest.approx(2 / 100)
    assert ini.init_variance("torch_default", n_in, n_out) == pytest.approx(1 / 900)  # not He: 6x smaller
    assert ini.init_variance("orthogonal", n_in, n_out) == pytest.approx(1 / 300)
    assert ini.calculate_gain("leaky_relu", 0.2) == pytest.approx(math.sqrt(2 / 1.04))
    assert ini.calculate_gain("tanh") == pytest.approx(5 / 3)
    assert ini.forward_gain("kaiming_normal", n_in, n_out) == pytest.approx(2.0)


def test_torch_default_bound_is_one_over_sqrt_fan_in():
    w = ini.init_matrix(np.random.default_rng(0), "torch_default", 400, 50)
    assert np.abs(w).max() <= 1 / 20 and np.abs(w).max() > 0.99 / 20


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (300, 700)])
def test_orthogonal_is_semi_orthogonal(shape):
    w = ini.init_matrix(np.random.default_rng(2), "orthogonal", *shape)
    small = min(shape)
    gram = w.T @ w if shape[0] >= shape[1] else w @ w.T
    np.testing.assert_allclose(gram, np.eye(small), atol=1e-12)
    assert np.mean(w * w) == pytest.approx(ini.init_variance("orthogonal", *shape), rel=1e-12)  # exact


@pytest.mark.parametrize("shape", [(64, 256), (300, 1200), (1200, 300), (200, 200)])  # 300: Lanczos
def test_spectral_has_the_stated_sigma_max(shape):
    w = ini.init_matrix(np.random.default_rng(3), "spectral", *shape)
    s = np.linalg.svd(w, compute_uv=False)
    assert s[0] == pytest.approx(math.sqrt(shape[1] / shape[0]), rel=1e-9)
    # the entry variance follows from the Marchenko-Pastur edge (finite-size: within 10 %)
    assert np.mean(w * w) == pytest.approx(ini.init_variance("spectral", *shape), rel=0.1)


def test_reproducible_and_seeded():
    a = ini.init_matrix(np.random.default_rng(5), "spectral", 300, 400)
    b = ini.init_matrix(np.random.default_rng(5), "spectral", 300, 400)
    np.testing.assert_array_equal(a, b)
    cfg = pe.StackConfig(d_model=32, n_heads=2, n_layers=2)
    for s in ini.SCHEMES:
        w1 = pe.init_weights(cfg, s, seed=7).weights
        w2 = pe.init_weights(cfg, s, seed=7).weights
        w3 = pe.init_weights(cfg, s, seed=8).weights
        assert all(np.array_equal(w1[k], w2[k]) for k in w1)
        assert not np.array_equal(w1["blocks.0.mlp.w_in"], w3["blocks.0.mlp.w_in"])


def test_init_weights_uses_the_scheme_per_matrix():
    cfg = pe.StackConfig(d_model=64, n_heads=4, n_layers=1, d_mlp=256)
    w = pe.init_weights(cfg, "kaiming_normal", mode="fan_out", dtype=np.float64).weights
    win = w["blocks.0.mlp.w_in"]  # (64, 256): fan_out 256
    assert np.mean(win**2) == pytest.approx(2 / 256, rel=0.05)
    w = pe.init_weights(cfg, "spectral", dtype=np.float64).weights
    assert np.linalg.norm(w["blocks.0.mlp.w_out"], 2) == pytest.approx(math.sqrt(64 / 256), rel=1e-9)
    qkv = w["blocks.0.attn.w_qkv"]  # q, k, v are separate square matrices
    for j in range(3):
        assert np.linalg.norm(qkv[:, 64 * j:64 * (j + 1)], 2) == pytest.approx(1.0, rel=1e-9)


def test_bad_arguments():
    cfg = pe.StackConfig(d_model=16, n_heads=2, n_layers=1)
    with pytest.raises(ValueError, match="scheme"):
        pe.init_weights(cfg, "he")
    with pytest.raises(ValueError, match="mode"):
        pe.init_weights(cfg, "kaiming_normal", mode="fan")
    with pytest.raises(ValueError, match="nonlinearity"):
        pe.init_weights(cfg, "kaiming_normal", nonlinearity="swish")
    with pytest.raises(ValueError, match="gain"):
        pe.init_weights(cfg, "orthogonal", gain=-1.0)


@pytest.mark.parametrize("scheme", ["gpt2", "kaiming_normal", "xavier_uniform", "torch_default", "orthogonal",
                                    "spectral"])
def test_float32_draws_are_float32_seeded_and_follow_the_formula(scheme):
    a = ini.init_matrix(np.random.default_rng(4), scheme, 300, 500, dtype=np.float32)
    b = ini.init_matrix(np.random.default_rng(4), scheme, 300, 500, dtype=np.float32)
    assert a.dtype == np.float32 and a.shape == (300, 500)
    np.testing.assert_array_equal(a, b)
    rel = 0.1 if scheme == "spectral" else 0.02  # 150,000 entries: the sample variance is within ~1 %
    assert np.mean(a.astype(np.float64) ** 2) == pytest.approx(ini.init_variance(scheme, 300, 500), rel=rel)
    with pytest.raises(TypeError, match="dtype"):
        ini.init_matrix(np.random.default_rng(4), scheme, 3, 5, dtype=np.int32)


@pytest.mark.parametrize("shape", [(700, 300), (256, 256)])
def test_orthogonal_is_the_sign_fixed_householder_q(shape):
    """CholeskyQR2 gives the Q of the QR with diag(R) > 0 (Haar), as Householder QR with fixed signs."""
    w = ini.init_matrix(np.random.default_rng(11), "orthogonal", *shape)
    q, r = np.linalg.qr(np.random.default_rng(11).standard_normal(shape))
    np.testing.assert_allclose(w, q * np.sign(np.diag(r)), atol=1e-12)
    assert ini._haar_columns(np.ones((4, 2))).shape == (4, 2)  # rank-deficient: the Householder fallback


def _whole_draws(cfg, scheme, seed, dtype, **opts):
    """init_weights' arrays drawn the obvious way: each matrix in one float64 draw, concatenated, rounded."""
    import zlib

    std, std_res = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    dh = cfg.head_dim

    def mat(rng, fi, fo, s=std):
        return ini.init_matrix(rng, scheme, fi, fo, gpt2_std=s, **opts)

    out = {}
    for name, shape in pe.models.config.expected_arrays(cfg).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("gamma", "q_norm", "k_norm"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf == "beta" or leaf.startswith("b_"):
            a = 0.05 * rng.standard_normal(shape)
        elif name.startswith("embed."):
            a = rng.normal(0.0, std, shape)
        elif name == "lm_head.weight":
            a = mat(rng, cfg.d_model, cfg.vocab_size).T
        elif leaf == "w_qkv":
            a = np.concatenate([mat(rng, cfg.d_model, n * dh) for n in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)], 1)
        elif leaf == "w_in" and cfg.activation == "silu_gated":
            a = np.concatenate([mat(rng, cfg.d_model, cfg.d_mlp) for _ in range(2)], axis=1)
        else:
            a = mat(rng, *shape, std_res if leaf in ("w_o", "w_out") else std)
        out[name] = a.astype(dtype)
    return out


@pytest.mark.parametrize("chunk", [1, 37, 1 << 19])
@pytest.mark.parametrize("scheme", ["gpt2", "xavier_normal", "kaiming_uniform", "orthogonal", "spectral"])
@pytest.mark.parametrize("activation", ["silu_gated", "gelu_tanh_gated"])
def test_chunked_draws_are_the_whole_draws_bit_for_bit(monkeypatch, chunk, scheme, activation):
    """init_weights draws elementwise schemes in row chunks (``_DRAW_CHUNK`` entries; 1: a row
    at a time, 37: chunks shorter than a row, so one row each, or several rows); the values,
    and the order in which q, k, v (gate, up) consume one generator, are those of whole draws."""
    monkeypatch.setattr(ini, "_DRAW_CHUNK", chunk)
    cfg = pe.StackConfig(d_model=24, n_heads=4, n_kv_heads=2, n_layers=2, d_mlp=40, vocab_size=19,
                         activation=activation, bias=True, lm_head="separate", positions="learned",
                         max_seq_len=11, qk_norm=True, norm="rmsnorm")
    for dtype in (np.float32, np.float64):
        got = pe.init_weights(cfg, scheme, seed=3, dtype=dtype, gamma_jitter=0.1, bias_std=0.05, mode="fan_out",
                              nonlinearity="tanh").weights
        want = _whole_draws(cfg, scheme, 3, dtype, mode="fan_out", nonlinearity="tanh", gain=None)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == dtype and got[k].flags.c_contiguous and not got[k].flags.writeable
            np.testing.assert_array_equal(got[k].view(f"u{got[k].itemsize}"), want[k].view(f"u{want[k].itemsize}"),
                                          err_msg=k)
