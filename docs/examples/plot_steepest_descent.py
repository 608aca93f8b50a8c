"""
Steepest descent under three norms
==================================

The steepest-descent step for a gradient :math:`G` under a norm :math:`\\lVert\\cdot\\rVert`,
:math:`\\Delta^* = \\arg\\min_\\Delta \\langle G, \\Delta\\rangle + \\lVert\\Delta\\rVert^2/(2\\eta)`,
depends on the norm:

- :math:`\\ell_2` (Frobenius): :math:`\\Delta^* = -\\eta\\, G`, plain gradient descent;
- :math:`\\ell_\\infty` (largest entry): :math:`\\Delta^* = -\\eta\\, \\lVert G\\rVert_1 \\operatorname{sign} G`,
  sign descent;
- spectral (:math:`\\sigma_{\\max}`): :math:`\\Delta^* = -\\eta\\, \\lVert G\\rVert_* U V^\\top`
  for :math:`G = U\\Sigma V^\\top`, every singular value set equal (the update of Muon-like
  optimizers).

In each case :math:`\\langle G, \\Delta^*\\rangle = -\\eta\\, \\lVert G\\rVert_\\dagger^2`, with
:math:`\\lVert\\cdot\\rVert_\\dagger` the dual norm (:func:`pyengine.linalg.dual_norm`).
:func:`pyengine.steepest_descent` computes all three for a stack of matrices.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

import pyengine as pe
from pyengine.linalg import dual_norm

# %%
# A gradient with a few strong directions plus noise: rank 3 and a small full-rank part.
rng = np.random.default_rng(0)
d_out, d_in = 24, 32
G = rng.standard_normal((d_out, 3)) @ np.diag([4.0, 2.0, 1.0]) @ rng.standard_normal((3, d_in)) / 4
G += 0.3 * rng.standard_normal((d_out, d_in))

norms = {"l2": r"$\ell_2$", "linf": r"$\ell_\infty$", "spectral": "spectral"}
steps = {norm: pe.steepest_descent(G, norm, lr=1.0) for norm in norms}
for norm, step in steps.items():
    decrease = np.sum(G * step)
    print(f"{norm:>8}: <G, step> = {decrease:10.3f}, -||G||_dagger^2 = {-dual_norm(G, norm) ** 2:10.3f}")

# %%
# The gradient and the three steps (each scaled to its largest entry), then the singular
# values of each, relative to the largest: the spectral step's are all one.
fig, axes = plt.subplots(1, 4, figsize=(8.0, 2.2), layout="constrained")
for ax, (title, m) in zip(axes, [("gradient $G$", G)] + [(f"{label} step", -steps[n]) for n, label in norms.items()]):
    ax.imshow(m / np.abs(m).max(), cmap="RdBu_r", vmin=-1, vmax=1)
    ax.set(title=title, xticks=[], yticks=[])
plt.show()

fig, ax = plt.subplots(figsize=(3.6, 2.6), layout="constrained")
index = np.arange(1, min(d_out, d_in) + 1)
ax.plot(index, np.linalg.svd(G, compute_uv=False) / np.linalg.norm(G, 2), "k.-", label="gradient")
for (norm, label), marker in zip(norms.items(), ("o", "s", "^")):
    sv = np.linalg.svd(steps[norm], compute_uv=False)
    ax.plot(index, sv / sv[0], marker, ms=3, label=f"{label} step")
ax.set(xlabel="index $i$", ylabel=r"$\sigma_i / \sigma_{\max}$", title="singular values", ylim=(0, 1.05))
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
ax.legend(fontsize=7, frameon=False)
plt.show()
