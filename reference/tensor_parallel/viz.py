"""Pictures of tensor parallelism: where the shards of a split GEMM live, and activation memory.

Y = X A, X (T, K) the input, A (K, N) the weight, split by columns or rows of A (`layers`).
`split_layout` says which block of X, A and Y each rank holds and `plot_matrix_split` draws
exactly that, so a notebook can check the picture against a real layer's shards. Every function
returns a ``matplotlib.figure.Figure`` (no pyplot state); artists carry a ``gid`` ("rank 1: A",
"TP+SP @ tp=2") so tests can find what was drawn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from reference.viz import NotebookFigure, fmt_bytes, lighten

__all__ = ["KINDS", "HeldBlocks", "split_layout", "plot_matrix_split", "plot_activation_memory"]

KINDS = ("column", "row")

_RANK_COLOURS = [lighten(c, 0.35) for c in colormaps["tab10"].colors]
_SHARED = "#d9d9d9"  # a block every rank holds (replicated), or the sum of every rank's part


def _rank_colour(rank: int):
    return _RANK_COLOURS[rank % len(_RANK_COLOURS)]


@dataclass(frozen=True)
class HeldBlocks:
    """The block of X (T, K), A (K, N) and Y (T, N) one rank holds, as (rows, cols) slices;
    ``partial``: the Y block is a partial sum, added over the ranks (the row split)."""

    x: tuple[slice, slice]
    a: tuple[slice, slice]
    y: tuple[slice, slice]
    partial: bool


def split_layout(kind: str, tp: int, t: int, k: int, n: int) -> list[HeldBlocks]:
    """What each of the `tp` ranks holds of Y = X A, X (t, k), A (k, n), under a `kind` split:
    contiguous, equal blocks in rank order, as `column_shard` and `row_shard` cut them."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    for name, value in (("tp", tp), ("t", t), ("k", k), ("n", n)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    split, what = (n, "n (the columns of A)") if kind == "column" else (k, "k (the rows of A)")
    if split % tp:
        raise ValueError(f"a {kind} split on tp={tp} ranks needs {what} = {split} to divide by tp={tp}")
    w = split // tp
    every = slice(None)
    blocks = []
    for r in range(tp):
        mine = slice(r * w, (r + 1) * w)
        if kind == "column":  # X whole on every rank; A's and Y's columns r
            blocks.append(HeldBlocks(x=(every, every), a=(every, mine), y=(every, mine), partial=False))
        else:  # X's columns r meet A's rows r; every rank writes a whole, partial Y
            blocks.append(HeldBlocks(x=(every, mine), a=(mine, every), y=(every, every), partial=True))
    return blocks


def _draw_matrix(ax, rows: int, cols: int, title: str) -> None:
    """A rows x cols grid of empty cells, row 0 on top."""
    for i in range(rows):
        for j in range(cols):
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor="white", edgecolor="0.85", lw=0.5))
    ax.add_patch(Rectangle((0, 0), cols, rows, fill=False, edgecolor="black", lw=1.0))
    ax.set_xlim(-0.1, cols + 0.1)
    ax.set_ylim(rows + 0.1, -0.1)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=9)


def _draw_block(ax, sl: tuple[slice, slice], shape: tuple[int, int], label: str, colour, gid: str,
                hatch: str = "") -> None:
    (r0, r1, _), (c0, c1, _) = sl[0].indices(shape[0]), sl[1].indices(shape[1])
    patch = Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=colour, edgecolor="black", lw=1.0,
                      hatch=hatch)
    patch.set_gid(gid)
    ax.add_patch(patch)
    box = dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1) if hatch else None
    ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=8, bbox=box)


def plot_matrix_split(kind: str, tp: int = 2, t: int = 4, k: int = 8, n: int = 8) -> Figure:
    """Y = X A split by `kind` ("column" or "row") on `tp` ranks: the whole product, each block
    coloured by its rank (grey: held by all, or the sum of all), then a row of panels per rank."""
    layout = split_layout(kind, tp, t, k, n)
    shapes = {"X": (t, k), "A": (k, n), "Y": (t, n)}
    fig = NotebookFigure(figsize=(1.2 + 0.32 * (k + 2 * n), 0.5 + 0.3 * (tp + 1) * max(t, k) + 0.4 * tp),
                  layout="constrained")
    axes = fig.subplots(tp + 1, 3, squeeze=False, gridspec_kw=dict(width_ratios=[k, n, n]))
    titles = {"X": f"X  ({t} × {k})", "A": f"A = weightᵀ  ({k} × {n})", "Y": f"Y = X A  ({t} × {n})"}
    for j, m in enumerate(shapes):
        _draw_matrix(axes[0, j], *shapes[m], "whole: " + titles[m])
    # Whole product: every rank's block in its colour, or one grey block shared by all.
    for r, held in enumerate(layout):
        for m in ("A", "Y") if kind == "column" else ("X", "A"):
            _draw_block(axes[0, "XAY".index(m)], getattr(held, m.lower()), shapes[m], f"${m}_{r}$",
                        _rank_colour(r), f"whole: {m}_{r}")
    every = (slice(None), slice(None))
    if kind == "column":
        _draw_block(axes[0, 0], every, shapes["X"], "$X$\n(every rank)", _SHARED, "whole: X")
    else:
        _draw_block(axes[0, 2], every, shapes["Y"], "$\\sum_r X_r A_r$\n(all-reduce)", _SHARED, "whole: Y",
                    hatch="//")
    # One row per rank: only what it holds.
    for r, held in enumerate(layout):
        row = axes[r + 1]
        for j, m in enumerate(shapes):
            _draw_matrix(row[j], *shapes[m], f"rank {r}: {m}")
        x_label = "$X$" if kind == "column" else f"$X_{r}$"
        y_label = f"$Y_{r} = X A_{r}$" if kind == "column" else f"$X_{r} A_{r}$\n(partial)"
        _draw_block(row[0], held.x, shapes["X"], x_label, _rank_colour(r), f"rank {r}: X")
        _draw_block(row[1], held.a, shapes["A"], f"$A_{r}$", _rank_colour(r), f"rank {r}: A")
        _draw_block(row[2], held.y, shapes["Y"], y_label, _rank_colour(r), f"rank {r}: Y",
                    hatch="//" if held.partial else "")
    if kind == "column":
        parts = r" \,|\, ".join(f"X A_{r}" for r in range(tp))
        headline = f"column-parallel on {tp} ranks: A split by columns, $Y = [{parts}]$, no sum"
    else:
        parts = " + ".join(f"X_{r} A_{r}" for r in range(tp))
        headline = f"row-parallel on {tp} ranks: A split by rows, $Y = {parts}$: an all-reduce"
    fig.suptitle(headline, fontsize=10)
    return fig


def plot_activation_memory(tps: Sequence[int], measured: Mapping[str, Sequence[float]],
                           predicted: Optional[Mapping[str, Sequence[float]]] = None, *,
                           unit_bytes: Optional[float] = None, unit_name: str = "S",
                           title: str = "activation memory per rank, one transformer block") -> Figure:
    """Grouped bars of measured bytes, one per mode (``{"TP": [bytes per tp], ...}``) for each tp;
    `predicted` (same keys) is a black tick on each bar. With `unit_bytes` the axis counts units
    of that many bytes (``unit_name``, e.g. S = B T C x 4 bytes, one fp32 activation)."""
    tps = list(tps)
    if not tps:
        raise ValueError("tps is empty: give at least one tensor-parallel size")
    if not measured:
        raise ValueError("measured is empty: give at least one mode")
    for kind, values_of in (("measured", measured), ("predicted", predicted or {})):
        for label, values in values_of.items():
            if label not in measured:
                raise ValueError(f"predicted[{label!r}] has no measured bars; modes are {list(measured)}")
            if len(values) != len(tps):
                raise ValueError(f"{kind}[{label!r}] has {len(values)} values for {len(tps)} tp sizes {tps}")
    scale = float(unit_bytes) if unit_bytes else 1.0
    modes = list(measured)
    width = 0.8 / len(modes)
    fig = NotebookFigure(figsize=(max(5.5, 1.6 + 1.2 * len(tps) * len(modes) * 0.6), 3.8), layout="constrained")
    ax = fig.subplots()
    colours = colormaps["tab10"].colors
    top, formula_in_legend = 0.0, False
    for i, mode in enumerate(modes):
        for g, tp in enumerate(tps):
            x = g + (i - (len(modes) - 1) / 2) * width
            height = float(measured[mode][g]) / scale
            bar = ax.bar(x, height, width * 0.92, color=lighten(colours[i % 10], 0.25),
                         edgecolor="black", lw=0.6, label=mode if g == 0 else None)[0]
            bar.set_gid(f"{mode} @ tp={tp}")
            label = f"{height:.3g}" if unit_bytes else fmt_bytes(height)
            ax.text(x, height, label, ha="center", va="bottom", fontsize=7)
            top = max(top, height)
            if predicted and mode in predicted:
                p = float(predicted[mode][g]) / scale
                tick, = ax.plot([x - width * 0.46, x + width * 0.46], [p, p], color="black", lw=2,
                                label=None if formula_in_legend else "formula")
                formula_in_legend = True
                tick.set_gid(f"formula: {mode} @ tp={tp}")
                top = max(top, p)
    ax.set_xticks(range(len(tps)), [f"tp={tp}" for tp in tps])
    ax.set_ylim(0, top * 1.15 or 1.0)
    ax.set_ylabel(f"per rank (units of {unit_name})" if unit_bytes else "bytes per rank")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig
