"""
Signal propagation through a stack at initialization
====================================================

How large is the residual stream :math:`h_\\ell` after :math:`\\ell` blocks, and how large
is the gradient :math:`\\partial L/\\partial h_\\ell` that flows back to it?
:func:`pyengine.analysis.stack_signal_propagation` feeds :math:`T` random tokens through a
stack, pulls a random cotangent back through the exact block VJPs, and returns the RMS of
both per layer beside the mean-field prediction of the initialization formula.

Under GPT-2's initialization (weights of standard deviation 0.02, the residual outputs
shrunk by :math:`\\sqrt{2L}`) the blocks add almost nothing: the stream keeps its size.
Under Kaiming-normal weights every pre-LN block adds a term of the stream's own size, so
the forward RMS grows with depth and the gradient reaching the first layers grows with it.
"""

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

import pyengine as pe
from pyengine.analysis import stack_signal_propagation

# %%
# The same pre-LN architecture under two initialization schemes.
config = pe.StackConfig(d_model=64, n_heads=4, n_layers=16)
results = {}
for scheme in ("gpt2", "kaiming_normal"):
    stack = pe.init_weights(config, scheme=scheme, seed=0)
    results[scheme] = stack_signal_propagation(stack, 32, scheme=scheme, seed=0)
    forward, backward = results[scheme].departure()
    print(f"{scheme:>15}: largest |log(measured / predicted)| forward {forward:.3f}, backward {backward:.3f}")

# %%
# Measured RMS (markers) against the prediction (dashed), forward and backward.
fig, axes = plt.subplots(1, 2, figsize=(7.0, 2.9), layout="constrained")
ylabels = {"forward": r"$\mathrm{RMS}(h_\ell)$", "backward": r"$\mathrm{RMS}(\partial L / \partial h_\ell)$"}
for ax, (direction, ylabel) in zip(axes, ylabels.items()):
    for (scheme, r), color in zip(results.items(), ("C0", "C3")):
        layers = range(r.depth + 1)
        ax.plot(layers, getattr(r, f"{direction}_rms"), "o", color=color, ms=4, label=f"{scheme}, measured")
        ax.plot(layers, getattr(r, f"{direction}_pred"), "--", color=color, label=f"{scheme}, predicted")
    ax.set(xlabel=r"layer $\ell$", ylabel=ylabel, title=direction)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7, frameon=False)
plt.show()
