"""Pictures of mixture-of-experts routing: loads, routes, the all-to-all, memory, the gate, balance.

Each function returns a ``matplotlib.figure.Figure`` (no pyplot state). Inputs are what `MoE`
and `ExpertParallelMoE` record in ``layer.last_stats`` (tensors, arrays or lists).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from reference.viz import NotebookFigure, fmt_bytes

__all__ = ["plot_tokens_per_expert", "plot_routing", "plot_all_to_all", "plot_expert_memory", "plot_gate",
           "plot_balance_history"]

# Counts may be a list, a numpy array or a torch tensor (converted with _as_array).
Counts = Union[Sequence[int], np.ndarray]


def _as_array(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def plot_tokens_per_expert(counts: Union[Counts, Mapping[str, Counts]], *,
                           capacity: Optional[int] = None, title: str = "tokens per expert") -> Figure:
    """Bars of assignments per expert; pass ``{"before": c0, "after": c1}`` to compare runs. Dotted:
    the balanced load, total / E; dashed: `capacity`, the slots of each expert for the whole batch."""
    series = dict(counts) if isinstance(counts, Mapping) else {"tokens": counts}
    series = {label: _as_array(c).reshape(-1) for label, c in series.items()}
    n_experts = max(len(c) for c in series.values())
    fig = NotebookFigure(figsize=(max(5.0, 0.45 * n_experts * len(series) + 2.0), 3.4), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    colours = colormaps["tab10"].colors
    for j, (label, c) in enumerate(series.items()):
        x = np.arange(len(c)) - 0.4 + width * (j + 0.5)
        ax.bar(x, c, width=width, color=colours[j % 10], label=label)
        ax.axhline(c.sum() / len(c), color=colours[j % 10], ls=":", lw=1)
    if capacity is not None:
        ax.axhline(capacity, color="black", ls="--", lw=1, label=f"capacity ({capacity})")
    ax.set_xticks(range(n_experts))
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments")
    ax.set_title(title, fontsize=10)
    if len(series) > 1 or capacity is not None:
        ax.legend(fontsize=8)
    return fig


def plot_routing(expert_idx: Counts, kept: Optional[Counts] = None, n_experts: Optional[int] = None, *,
                 title: str = "routes of one sequence") -> Figure:
    """One sequence's routes (`expert_idx` (T, k) as ``stats.expert_idx[g]``, `kept` (T, k) bool): a
    column per token, a row per expert, a first choice darker than a second, a dropped one crossed out."""
    idx = _as_array(expert_idx)
    if idx.ndim != 2:
        raise ValueError(f"expert_idx must be (T, k) for one sequence, got shape {idx.shape}")
    keep = np.ones_like(idx, dtype=bool) if kept is None else _as_array(kept).astype(bool)
    T, k = idx.shape
    E = int(idx.max()) + 1 if n_experts is None else n_experts
    fig = NotebookFigure(figsize=(max(4.0, 0.3 * T + 1.5), max(2.0, 0.3 * E + 1.0)), layout="constrained")
    ax = fig.add_subplot()
    shades = colormaps["Blues"](np.linspace(0.85, 0.35, k))
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            ax.add_patch(Rectangle((t, e), 1, 1, facecolor=shades[j], edgecolor="white", lw=1))
            if not keep[t, j]:
                ax.plot([t + 0.1, t + 0.9], [e + 0.1, e + 0.9], color="crimson", lw=1.5)
                ax.plot([t + 0.1, t + 0.9], [e + 0.9, e + 0.1], color="crimson", lw=1.5)
    ax.set_xlim(0, T)
    ax.set_ylim(E, 0)
    ax.set_xticks(np.arange(T) + 0.5, [str(t) for t in range(T)], fontsize=7)
    ax.set_yticks(np.arange(E) + 0.5, [f"expert {e}" for e in range(E)], fontsize=8)
    ax.set_xlabel("token position")
    dropped = int((~keep).sum())
    ax.set_title(f"{title} (k={k}; {dropped} dropped)", fontsize=10)
    return fig


def plot_all_to_all(send_counts: Counts, *, title: str = "all-to-all: rows sent") -> Figure:
    """The dispatch as a matrix, every rank's ``stats.send_counts`` stacked: [s, d] the rows ep rank
    s sends to ep rank d. The diagonal stays on its rank; the combine sends the transpose back."""
    m = _as_array(send_counts)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"send_counts must be a square (P, P) matrix, got shape {m.shape}")
    P = m.shape[0]
    fig = NotebookFigure(figsize=(1.0 * P + 2.2, 0.9 * P + 1.2), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(m, cmap="Oranges", vmin=0)
    for s in range(P):
        for d in range(P):
            ax.text(d, s, str(int(m[s, d])), ha="center", va="center", fontsize=9,
                    fontweight="bold" if s != d else "normal")
    ax.set_xticks(range(P), [f"to {d}" for d in range(P)])
    ax.set_yticks(range(P), [f"rank {s}" for s in range(P)])
    crossing = int(m.sum() - np.trace(m))
    ax.set_title(f"{title}\n{crossing} of {int(m.sum())} rows cross ranks", fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8)
    return fig


def plot_expert_memory(expert_bytes: Sequence[int], dense_bytes: Sequence[int], *,
                       title: str = "parameter bytes per rank") -> Figure:
    """Stacked bars per rank: expert parameters (split by ep) over the replicated dense ones."""
    experts, dense = _as_array(expert_bytes).reshape(-1), _as_array(dense_bytes).reshape(-1)
    if experts.shape != dense.shape:
        raise ValueError(f"one value per rank in each: {experts.shape} expert vs {dense.shape} dense")
    ranks = np.arange(len(experts))
    fig = NotebookFigure(figsize=(max(4.0, 0.6 * len(ranks) + 2.0), 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(ranks, dense, color="#9e9e9e", label="dense (replicated)")
    ax.bar(ranks, experts, bottom=dense, color="#e6851e", label="experts (split)")
    for r in ranks:
        ax.text(r, dense[r] + experts[r], fmt_bytes(dense[r] + experts[r]), ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.set_xlabel("rank")
    ax.set_ylabel("bytes")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_gate(probs, expert_idx, weights, *, title: str = "the gate: softmax, then top-k") -> Figure:
    """Heat map of one sequence's `probs` (T, E), an expert per row: the chosen cells (`expert_idx`
    (T, k), best first) framed with their combine `weights` (T, k), which sum to 1 when k > 1."""
    p, idx, w = _as_array(probs), _as_array(expert_idx), _as_array(weights)
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
    """Top row: a heat map per run of `loads` ({name: (steps, E) ``stats.tokens_per_expert``
    stacked}); bottom row: max / mean load per step (1: balanced) and, given, each run's balance loss."""
    runs = {name: _as_array(l).astype(float) for name, l in loads.items()}
    for name, l in runs.items():
        if l.ndim != 2:
            raise ValueError(f"loads[{name!r}] must be (steps, E), got shape {l.shape}")
    vmax = max(l.max() for l in runs.values())
    n_curves = 1 if balance_loss is None else 2
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
            ax.plot(_as_array(values).reshape(-1), color=colours[j], label=name)
        ax.axhline(1.0, color="black", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("balance loss")
        ax.set_title(r"load-balancing loss $E\,\Sigma_i\, f_i P_i$ (1 = uniform)", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig
