"""Pictures of context parallelism: memory against T, the ring's messages, causal work, bytes.

Every function returns a ``matplotlib.figure.Figure`` (no pyplot state, headless), drawn
from numbers the caller measured.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.patches import FancyBboxPatch

from reference.viz import NotebookFigure

__all__ = ["plot_memory_vs_length", "plot_ring_messages", "plot_causal_split", "plot_work_per_rank",
           "plot_bytes_per_rank", "rank_colour"]


def rank_colour(rank: int):
    """One colour per rank (tab10), the same in every picture of the notebook."""
    return colormaps["tab10"].colors[rank % 10]


def _figure(width: float, height: float, ncols: int = 1):
    fig = NotebookFigure(figsize=(width, height))
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _log2_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Both axes in powers of two, labelled, with a legend and a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def plot_memory_vs_length(lengths: Sequence[int], measured: Mapping[str, Sequence[float]],
                          formula: Optional[Mapping[str, Sequence[float]]] = None, *,
                          title: str = "attention memory against the sequence length"):
    """Log-log: each measured series as points joined by a line, each formula dashed."""
    fig, (ax,) = _figure(6.0, 3.6)
    for k, (name, values) in enumerate(measured.items()):
        ax.plot(lengths, values, "o-", color=rank_colour(k), label=f"{name} (measured)")
    for name, values in (formula or {}).items():
        ax.plot(lengths, values, "--", color="0.3", lw=1, label=name)
    _log2_axes(ax, "sequence length T (tokens)", "bytes", title)
    return fig


def plot_ring_messages(messages: Sequence[Mapping], cp: int, *,
                       title: str = "ring attention's forward, from its messages"):
    """messages: dicts with "step", "src", "dst", "block" (whose keys it carries), "bytes".

    Column s shows the block each rank computes on at step s: its own at step 0, then
    what it received at step s - 1. One arrow per recorded message."""
    holds = {(0, r): r for r in range(cp)}
    for m in messages:
        holds[(m["step"] + 1, m["dst"])] = m["block"]
    steps = 1 + max((m["step"] + 1 for m in messages), default=0)
    fig, (ax,) = _figure(1.6 + 1.7 * steps, 0.9 + 0.75 * cp)
    for (s, r), block in holds.items():
        colour = rank_colour(block)
        ax.add_patch(FancyBboxPatch((s - 0.36, r - 0.3), 0.72, 0.6, boxstyle="round,pad=0.02",
                                    facecolor=(*colour[:3], 0.45), edgecolor=colour))
        ax.text(s, r, f"K,V of {block}", ha="center", va="center", fontsize=8)
    for m in messages:
        ax.annotate("", xy=(m["step"] + 1 - 0.36, m["dst"]), xytext=(m["step"] + 0.36, m["src"]),
                    arrowprops=dict(arrowstyle="->", color="0.25", lw=1.1))
    sizes = sorted({m["bytes"] for m in messages})
    ax.set_xticks(range(steps), [f"step {s}" for s in range(steps)])
    ax.set_yticks(range(cp), [f"rank {r}" for r in range(cp)])
    ax.set_xlim(-0.6, steps - 0.4)
    ax.set_ylim(cp - 0.5, -0.5)
    ax.set_title(title + (f"\neach arrow: one message of {', '.join(map(str, sizes))} bytes"
                          if sizes else ""), fontsize=10)
    ax.spines[:].set_visible(False)
    return fig


def plot_causal_split(owners: Mapping[str, Sequence[int]], *,
                      title: str = "who computes which (query, key) pairs"):
    """owners: layout name -> the rank holding each position (length T). One panel each:
    the lower triangle of the (T, T) pairs, coloured by the rank that owns the query."""
    fig, axes = _figure(3.3 * len(owners), 3.5, len(owners))
    for ax, (name, owner) in zip(axes, owners.items()):
        owner = np.asarray(owner)
        T, cp = len(owner), int(owner.max()) + 1
        causal = np.tril(np.ones((T, T), dtype=bool))  # (query, key) pairs with key <= query
        grid = np.where(causal, owner[:, None], np.nan)
        cmap = ListedColormap([rank_colour(r) for r in range(cp)]).with_extremes(bad="white")
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=cp - 0.5, interpolation="nearest")
        pairs = [int(((owner == r)[:, None] & causal).sum()) for r in range(cp)]
        ax.set_title(f"{name}\npairs per rank {pairs}", fontsize=9)
        ax.set(xlabel="key position", ylabel="query position")
    fig.suptitle(title, fontsize=10)
    return fig


def plot_work_per_rank(per_step: Mapping[str, Sequence[Sequence[int]]], *,
                       title: str = "score entries each rank computes, by ring step"):
    """per_step: layout name -> [rank][step] entries. Stacked bars, one panel per layout."""
    fig, axes = _figure(3.6 * len(per_step), 3.2, len(per_step))
    top = max(sum(row) for rows in per_step.values() for row in rows)
    for ax, (name, rows) in zip(axes, per_step.items()):
        rows = np.asarray(rows)
        bottom = np.zeros(len(rows))
        for s in range(rows.shape[1]):
            shade = colormaps["Greys"](0.3 + 0.5 * s / max(1, rows.shape[1] - 1))  # later: darker
            ax.bar(range(len(rows)), rows[:, s], bottom=bottom, color=shade, edgecolor="white",
                   label=f"step {s}")
            bottom += rows[:, s]
        ax.set_ylim(0, top * 1.1)
        ax.set_xticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
        ax.set_title(f"{name}: max / min = {bottom.max() / bottom.min():.2f}", fontsize=9)
    axes[0].set_ylabel("score entries")
    axes[-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    return fig


def plot_bytes_per_rank(cps: Sequence[int], ring: Sequence[float], ulysses: Sequence[Optional[float]],
                        measured: Optional[Mapping[str, Mapping[int, float]]] = None, *,
                        title: str = "bytes each rank sends, forward of one attention"):
    """Formulas as lines (Ulysses None where cp does not divide the heads), measurements as
    points; log axes, so cp = 1 (nothing sent) is left out."""
    fig, (ax,) = _figure(6.0, 3.6)
    for k, (name, values) in enumerate((("ring", ring), ("Ulysses", ulysses))):
        shown = [(c, b) for c, b in zip(cps, values) if b]
        ax.plot([c for c, _ in shown], [b for _, b in shown], "-", color=rank_colour(k),
                label=f"{name} (formula)")
    for k, (name, points) in enumerate((measured or {}).items()):
        ax.plot(list(points), list(points.values()), "o", color=rank_colour(k), label=f"{name} (measured)")
    possible = [c for c, u in zip(cps, ulysses) if u is not None]
    if possible and max(possible) < max(cps):
        ax.axvspan(max(possible), max(cps), color="0.9", zorder=0,
                   label="Ulysses impossible: cp does not divide the heads")
    _log2_axes(ax, "cp (ranks sharing the sequence)", "bytes per rank", title)
    return fig
