"""
How much of the stream is position, layer by layer
==================================================

Stack the hidden states of :math:`C` contexts of :math:`T` tokens, :math:`h[c, t]`. Their
mean over contexts at each position, minus the overall mean :math:`\\mu`, is the positional
part :math:`\\mathrm{pos}_t`; what is left at a token is its context part.
:func:`pyengine.analysis.positions.positional_decomposition` measures, per layer, the
positional share :math:`\\rho = \\sqrt{C}\\,\\lVert \\mathrm{pos}\\rVert / \\lVert h - \\mu\\rVert`,
the context share, and the principal angles between the layer's leading positional
directions and layer 0's.

The matched pair of :func:`pyengine.experiments.positions.synthetic_pair` is one seeded
stack with sinusoidal positions, built twice: LayerNorm before each block (pre-LN) and
after it (post-LN). The same weights, the same random token ids.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from pyengine.analysis.positions import positional_decomposition
from pyengine.experiments.positions import synthetic_pair

# %%
# 64 contexts of 16 random token ids each, through both stacks.
pre, post = synthetic_pair(n_layers=8, d_model=64, seed=0)
ids = np.random.default_rng(0).integers(0, pre.config.vocab_size, size=(64, 16))  # (C, T)
decompositions = {name: positional_decomposition(stack.hidden_states(ids))  # h: (L + 1, C, T, d)
                  for name, stack in (("pre-LN", pre), ("post-LN", post))}
for name, dec in decompositions.items():
    print(f"{name}: positional share {dec.rel_norm[0]:.3f} at layer 0, {dec.rel_norm[-1]:.3f} "
          f"at layer {len(dec.rel_norm) - 1}")

# %%
# Left: positional share (solid) and context share (dashed). Right: the mean principal
# angle between the layer's :math:`k = 4` leading positional directions and layer 0's.
fig, (ax_s, ax_a) = plt.subplots(1, 2, figsize=(7.0, 2.9), layout="constrained")
for (name, dec), color in zip(decompositions.items(), ("C0", "C3")):
    layers = np.arange(len(dec.rel_norm))
    ax_s.plot(layers, dec.rel_norm, "o-", color=color, ms=4, label=rf"{name}, positional $\rho$")
    ax_s.plot(layers, dec.context_rel_norm, "s--", color=color, ms=3, label=f"{name}, context")
    ax_a.plot(layers, np.degrees(dec.angles.mean(axis=1)), "o-", color=color, ms=4, label=name)
ax_s.set(xlabel=r"layer $\ell$", ylabel=r"share of $\Vert h - \mu \Vert$", title="positional share")
ax_a.set(xlabel=r"layer $\ell$", ylabel=r"mean principal angle ($^\circ$)",
         title="positional subspace against layer 0")
for ax in (ax_s, ax_a):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7, frameon=False)
plt.show()
