"""
The largest singular value of LayerNorm's Jacobian
==================================================

Per token :math:`x\\in\\mathbb{R}^d`, LayerNorm's Jacobian is
:math:`J = \\mathrm{diag}(\\gamma)/s\\,(I - \\mathbf{1}\\mathbf{1}^\\top/d - \\hat x\\hat x^\\top/d)`
with :math:`s = \\sqrt{\\mathrm{var}(x) + \\epsilon}`. The bracket is a projection, so
:math:`\\sigma_{\\max}(J) \\le \\max_i|\\gamma_i|/s`, with equality for a constant
:math:`\\gamma` (and :math:`d \\ge 3`). For a general :math:`\\gamma`,
:math:`s^2 J^\\top J` is a diagonal matrix minus a rank-2 term, and its largest eigenvalue
solves a 2 x 2 secular equation: :func:`pyengine.layer_norm_spectral_norm` computes
:math:`\\sigma_{\\max}` exactly that way, in :math:`O(d)` per token, with no iteration.
Its ``method="lanczos"`` runs matrix-free Lanczos on :math:`J^\\top J` per token instead,
the method for operators without such structure; here the two agree to the tolerance.
"""

import matplotlib.pyplot as plt
import numpy as np

import pyengine as pe

# %%
# 400 tokens of width 64 with spread-out scales (so :math:`s` varies over two decades),
# and two gains: a constant :math:`\gamma = 1.5` and a jittered one.
rng = np.random.default_rng(0)
d, eps = 64, 1e-5
x = rng.standard_normal((400, d)) * np.exp(rng.uniform(-2.5, 2.5, (400, 1))) + rng.standard_normal((400, 1))
s = np.sqrt(x.var(axis=1) + eps)
gammas = {"constant $\\gamma$": np.full(d, 1.5), "jittered $\\gamma$": 1.5 + 0.4 * rng.standard_normal(d)}

exact = {name: pe.layer_norm_spectral_norm(x, g, eps=eps).sigma for name, g in gammas.items()}
g = gammas["jittered $\\gamma$"]
lanczos = pe.layer_norm_spectral_norm(x, g, eps=eps, method="lanczos", tol=1e-10)
rel = np.abs(lanczos.sigma - exact["jittered $\\gamma$"]) / exact["jittered $\\gamma$"]
print(f"Lanczos against the exact sigma_max: largest relative difference {rel.max():.1e}, "
      f"all converged: {bool(lanczos.converged.all())}")

# %%
# Left: :math:`\sigma_{\max}` as a fraction of the bound :math:`\max_i|\gamma_i|/s`: one
# for the constant gain, below one for the jittered gain. Right: how far Lanczos lands from
# the exact value (an exact match, zero, is drawn at :math:`10^{-17}`).
fig, (ax_s, ax_l) = plt.subplots(1, 2, figsize=(7.0, 2.9), layout="constrained")
for (name, gamma), marker in zip(gammas.items(), ("o", "x")):
    bound = np.abs(gamma).max() / s
    ax_s.semilogx(bound, exact[name] / bound, marker, ms=3, alpha=0.7, label=name)
ax_s.set(xlabel=r"$\max_i |\gamma_i| \,/\, s$", ylabel=r"$\sigma_{\max}(J) \,/\, (\max_i |\gamma_i| / s)$",
         title=r"exact $\sigma_{\max}$ against its bound")
ax_s.legend(fontsize=7, frameon=False)
ax_l.semilogx(exact["jittered $\\gamma$"], np.maximum(rel, 1e-17), "o", ms=3, color="C1")
ax_l.axhline(1e-10, color="k", lw=0.8, ls="--", label="tol = $10^{-10}$")
ax_l.set_yscale("log")
ax_l.set(xlabel=r"exact $\sigma_{\max}$", ylabel=r"$|\sigma_{\mathrm{Lanczos}} - \sigma_{\max}| \,/\, \sigma_{\max}$",
         title=r"Lanczos against the exact value")
ax_l.legend(fontsize=7, frameon=False)
plt.show()
