"""Two more pictures of mixture-of-experts routing: the gate's decision, and balance over training.

Like `reference.expert_parallel.viz`, each function returns a ``matplotlib.figure.Figure``
(no pyplot state) and takes tensors, numpy arrays or lists.

* `plot_gate`: one sequence's router probabilities as a heat map, the top-k
  cells framed and labelled with their combine weight. It shows the three
  steps of the router at once: softmax, top-k, renormalisation.
* `plot_balance_history`: tokens per expert at every training step, one heat
  map per run, with the imbalance (max / mean load) and the load-balancing loss
  of every run drawn as curves: load balancing watched while it happens.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from reference.expert_parallel.viz import as_array
from reference.viz import NotebookFigure

__all__ = ["plot_gate", "plot_balance_history"]


def plot_gate(probs, expert_idx, weights, *, title: str = "the gate: softmax, then top-k") -> Figure:
    """Heat map of one sequence's probabilities, an expert per row and a token per column.

    `probs` (T, E) the softmax of the gate's logits; `expert_idx` (T, k) the
    chosen experts, best first; `weights` (T, k) their combine weights. A chosen
    cell is framed (thick for the first choice) and shows its weight, so
    renormalisation is visible: a token's framed numbers sum to 1 when k > 1.
    """
    p, idx, w = as_array(probs), as_array(expert_idx), as_array(weights)
    if p.ndim != 2 or idx.ndim != 2 or idx.shape != w.shape or idx.shape[0] != p.shape[0]:
        raise ValueError(f"expected probs (T, E), expert_idx and weights (T, k); got shapes "
                         f"{p.shape}, {idx.shape}, {w.shape}")
    T, E = p.shape
    k = idx.shape[1]
    fig = NotebookFigure(figsize=(max(4.5, 0.42 * T + 2.0), max(2.2, 0.38 * E + 1.2)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(p.T, cmap="Greys", vmin=0, vmax=1, aspect="auto")  # (E, T): experts down, tokens across
    shades = colormaps["Blues"](np.linspace(0.95, 0.55, k))
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            ax.add_patch(Rectangle((t - 0.5, e - 0.5), 1, 1, fill=False, edgecolor=shades[j],
                                   lw=2.5 if j == 0 else 1.5))
            ax.text(t, e, f"{w[t, j]:.2f}", ha="center", va="center", fontsize=6.5,
                    color="white" if p[t, e] > 0.5 else "black")
    ax.set_xticks(range(T), [str(t) for t in range(T)], fontsize=7)
    ax.set_yticks(range(E), [f"expert {e}" for e in range(E)], fontsize=8)
    ax.set_xlabel("token position")
    ax.set_title(f"{title} (k={k}; framed: chosen, number: combine weight)", fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8, label="probability")
    return fig


def plot_balance_history(loads: Mapping[str, Sequence], balance_loss: Optional[Mapping[str, Sequence[float]]] = None,
                         *, title: str = "tokens per expert during training") -> Figure:
    """Top row: a heat map per run (expert x step, colour = assignments); bottom row: the curves.

    `loads` maps a run's name to its (steps, E) assignments per expert per step
    (``stats.tokens_per_expert`` stacked). The curves are max / mean load per
    step (1 is perfect balance) and, when given, each run's load-balancing loss
    per step (1 for uniform routing, E when every token picks one expert).
    """
    runs = {name: as_array(l).astype(float) for name, l in loads.items()}
    for name, l in runs.items():
        if l.ndim != 2:
            raise ValueError(f"loads[{name!r}] must be (steps, E), got shape {l.shape}")
    vmax = max(l.max() for l in runs.values())
    n_curves = 1 if balance_loss is None else 2
    # Heat maps on the top row, curves on the bottom row, all sharing the step axis.
    ncols = max(len(runs), n_curves)
    fig = NotebookFigure(figsize=(4.2 * ncols, 6.0), layout="constrained")
    grid = fig.add_gridspec(2, ncols)
    heat_axes = [fig.add_subplot(grid[0, j]) for j in range(len(runs))]
    curve_axes = [fig.add_subplot(grid[1, j]) for j in range(n_curves)]
    colours = colormaps["tab10"].colors
    for ax, (name, l) in zip(heat_axes, runs.items()):
        image = ax.imshow(l.T, cmap="viridis", vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        ax.set_title(name, fontsize=10)
    fig.colorbar(image, ax=heat_axes, shrink=0.8, label="assignments")
    curve = curve_axes[0]
    for j, (name, l) in enumerate(runs.items()):
        curve.plot(l.max(axis=1) / l.mean(axis=1), color=colours[j], label=name)
    curve.axhline(1.0, color="black", ls=":", lw=1)
    curve.set_xlabel("step")
    curve.set_ylabel("max / mean load")
    curve.set_title("imbalance (1 = balanced)", fontsize=10)
    curve.legend(fontsize=8)
    if balance_loss is not None:
        ax = curve_axes[1]
        for j, (name, values) in enumerate(balance_loss.items()):
            ax.plot(as_array(values).reshape(-1), color=colours[j], label=name)
        ax.axhline(1.0, color="black", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("balance loss")
        ax.set_title(r"load-balancing loss $E\,\Sigma_i\, f_i P_i$ (1 = uniform)", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig
