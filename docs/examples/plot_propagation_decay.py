"""
Propagating a perturbation: exact against linearized
=====================================================

Add :math:`\\delta = \\alpha\\, v/\\lVert v\\rVert` to the residual stream at one hidden state
and follow it to the last block. :func:`pyengine.propagate` runs the stack twice (with and
without :math:`\\delta`, all perturbations in one batched pass) and reports, per hidden state
:math:`k`, the projection :math:`(h_k^{\\mathrm{inj}} - h_k^{\\mathrm{base}})\\cdot v/\\lVert v\\rVert`
and the cosine between the two streams. With ``linearized=True`` it pushes :math:`\\delta`
through the exact Jacobian-vector product of every block instead: the first-order answer.

The linearized response is linear in :math:`\\alpha`, so its projection divided by
:math:`\\alpha` is one curve for every scale; the exact response approaches it as
:math:`\\alpha` shrinks. :meth:`pyengine.Propagation.fit` fits
:math:`|p_k| \\approx e^{c - \\lambda k}` and gives the decay rate :math:`\\lambda` with its
95 % interval.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

import pyengine as pe

# %%
# A small seeded pre-LN stack (Xavier-normal weights) and one sequence of token ids.
config = pe.StackConfig(d_model=128, n_heads=4, n_layers=12, vocab_size=64)
stack = pe.init_weights(config, scheme="xavier_normal", seed=0)
ids = np.arange(48) % config.vocab_size
directions = np.random.default_rng(1).standard_normal((8, config.d_model))  # K = 8
scales = np.array([0.5, 8.0])  # S = 2; perturbation i * S + j is direction i at scale j

exact = pe.propagate(stack, ids, directions, scales, layer=2)
linear = pe.propagate(stack, ids, directions, scales, layer=2, linearized=True)
print(exact)

# %%
# Mean over the 8 directions of the projection at the last token, per scale, and the
# decay fit of the exact run at the larger scale.
def per_scale(result, metric):
    values = result.view(metric, "last")  # (hidden states, K * S), mean over the position
    return values.reshape(len(result.layers), -1, len(scales)).mean(axis=1)  # (L', S)


proj_exact, proj_linear = per_scale(exact, "projection"), per_scale(linear, "projection")
cos_exact, cos_linear = per_scale(exact, "cosine"), per_scale(linear, "cosine")
fit = exact.fit("last", scale_index=1)
print(f"decay rate {fit.rate:.4f} per layer, 95 % interval "
      f"[{fit.rate_ci[0]:.4f}, {fit.rate_ci[1]:.4f}], R^2 = {fit.r2:.2f}")

layers = exact.layers
fig, (ax_p, ax_c) = plt.subplots(1, 2, figsize=(7.0, 2.9), layout="constrained")
for j, (alpha, color) in enumerate(zip(scales, ("C0", "C3"))):
    ax_p.plot(layers, proj_exact[:, j] / alpha, "o-", color=color, ms=4,
              label=rf"exact, $\alpha = {alpha:g}$")
    ax_c.plot(layers, cos_exact[:, j], "o-", color=color, ms=4, label=rf"exact, $\alpha = {alpha:g}$")
    ax_c.plot(layers, cos_linear[:, j], "--", color=color, label=rf"linearized, $\alpha = {alpha:g}$")
ax_p.plot(layers, proj_linear[:, 0] / scales[0], "k--", label="linearized (any $\\alpha$)")
ax_p.plot(layers, np.exp(fit.intercept - fit.rate * layers) / scales[1], ":", color="C3",
          label=rf"fit, $\lambda = {fit.rate:.3f}$")
ax_p.set(xlabel="hidden state $k$", ylabel=r"$|p_k| \,/\, \alpha$",
         title=r"projection onto $v$")
ax_c.set(xlabel="hidden state $k$", ylabel=r"$\cos(h_k^{\mathrm{inj}}, h_k^{\mathrm{base}})$",
         title="cosine of the two streams")
for ax in (ax_p, ax_c):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7, frameon=False)
plt.show()
