"""Pictures for the course: the mesh, collectives, ring all-reduce, the cost model.

Every function returns a ``matplotlib.figure.Figure`` built without pyplot, so it works headless
and in tests; ``fig.savefig(path)`` writes it to a file. Cells are coloured by the value they
print, equal values alike, so a reader can follow a piece of data from one rank to another.
"""

from __future__ import annotations

import io
import math
from typing import Optional, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from reference.runtime import preload

preload(__name__)  # matplotlib: every rank that draws or imports a picture starts with it

# Data values take colours from these categorical maps, in order of first appearance.
CATEGORICAL = [c for name in ("tab20", "tab20b", "tab20c") for c in colormaps[name].colors]
_EMPTY = "#eeeeee"


class NotebookFigure(Figure):
    """A Figure that carries its own PNG form: as the last line of a cell it is drawn exactly once,
    with or without pyplot's inline backend."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()


# ----------------------------------------------------------------- helpers
def lighten(rgb, amount: float = 0.45):
    """Mix a colour with white so black text stays readable on it."""
    return tuple(amount + (1 - amount) * c for c in rgb[:3])


def _fmt(value) -> str:
    """A short label: integers without a decimal point, other floats to 3 digits."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ",".join(_fmt(v) for v in value)
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _as_values(x) -> list:
    """One rank's data as a flat list of Python numbers (a tensor, array, list, number or None)."""
    if x is None:
        return []
    if hasattr(x, "detach"):  # a torch.Tensor, any dtype or device
        return x.detach().cpu().reshape(-1).tolist()
    if isinstance(x, np.ndarray):
        return x.reshape(-1).tolist()
    if isinstance(x, (list, tuple)):
        return [_as_chunk(v) for v in x]
    return [x]


def _as_chunk(x):
    """One cell's content: a number, None, or a short list (a chunk of several elements)."""
    if x is None or isinstance(x, (int, float, bool, np.number)):
        return x.item() if isinstance(x, np.number) else x
    values = _as_values(x)
    return values[0] if len(values) == 1 else values


class _Palette:
    """Value label -> colour, fixed at first sight so equal values look equal."""

    def __init__(self):
        self._colours: dict[str, tuple] = {}

    def __call__(self, label: str):
        if label == "":
            return _EMPTY
        if label not in self._colours:
            rgb = CATEGORICAL[len(self._colours) % len(CATEGORICAL)]
            self._colours[label] = lighten(rgb)
        return self._colours[label]


def _draw_rank_rows(ax, rows: Sequence[Sequence], palette: _Palette, width: int, title: str):
    """One row of cells per rank (rank 0 on top), each cell holding its value."""
    fontsize = 9 if width <= 8 else 7
    for rank, row in enumerate(rows):
        for i, value in enumerate(row):
            label = _fmt(value)
            ax.add_patch(Rectangle((i, rank), 1, 1, facecolor=palette(label), edgecolor="white", lw=2))
            ax.text(i + 0.5, rank + 0.5, label, ha="center", va="center", fontsize=fontsize)
        if not row:
            ax.text(0.1, rank + 0.5, "(empty)", ha="left", va="center", fontsize=fontsize,
                    color="grey", style="italic")
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(len(rows), 0)  # rank 0 at the top
    ax.set_yticks([r + 0.5 for r in range(len(rows))], [f"rank {r}" for r in range(len(rows))])
    ax.set_xticks([])
    ax.tick_params(left=False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=10)


def fmt_bytes(n: float) -> str:
    # Decimal units, as network bandwidths are quoted (1 GB/s = 1e9 bytes per second), up to
    # TB: model states of large models run into terabytes.
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if float(f"{n:.3g}") < 1000 or unit == "TB":  # so 999.99... MB reads "1 GB"
            return f"{n:.3g} {unit}"
        n /= 1000


def fmt_seconds(t: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if t >= scale or unit == "µs":
            return f"{t / scale:.3g} {unit}"


def _grid_shape(n: int) -> tuple[int, int]:
    """(columns, rows) of a grid of `n` panels, at most 4 a row."""
    ncols = min(n, 4)
    return ncols, math.ceil(n / ncols)


def _panels(fig, n: int, ncols: int, nrows: int) -> list:
    """The first `n` axes of an nrows x ncols grid, the unused cells removed."""
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for extra in axes[n:]:
        fig.delaxes(extra)
    return list(axes[:n])


# ---------------------------------------------------------------- pictures
def plot_mesh(mesh) -> Figure:
    """The mesh as one panel per pipeline stage, one box per rank: each row a TP group (tinted),
    each column a DP group; with ep > 1 dashed lines cut each column into EP groups of ``ep`` rows."""
    ncols, nrows = _grid_shape(mesh.pp)
    cell_w, cell_h = 1.25, 0.75 if mesh.ep == 1 else 0.95
    fig = NotebookFigure(figsize=(max(5.0, ncols * (mesh.tp * cell_w + 1.0)),
                                  max(2.5, nrows * (mesh.dp * cell_h + 1.0) + 0.6)), layout="constrained")
    axes = _panels(fig, mesh.pp, ncols, nrows)
    tints = [lighten(c, 0.55) for c in colormaps["tab10"].colors]
    for pp_rank, ax in enumerate(axes):
        for dp_rank in range(mesh.dp):
            tint = tints[dp_rank % len(tints)]  # one tint per TP group (a row)
            for tp_rank in range(mesh.tp):
                rank = mesh.rank_of(pp=pp_rank, dp=dp_rank, tp=tp_rank)
                c = mesh.coords(rank)
                label = f"rank {rank}\npp={c.pp} dp={c.dp} tp={c.tp}"
                if mesh.ep > 1:
                    label += f"\nep={c.ep} edp={c.edp}"
                ax.add_patch(Rectangle((tp_rank + 0.04, dp_rank + 0.06), 0.92, 0.88,
                                       facecolor=tint, edgecolor="black", lw=0.8))
                ax.text(tp_rank + 0.5, dp_rank + 0.5, label, ha="center", va="center", fontsize=8)
        for edp_rank in range(1, mesh.edp if mesh.ep > 1 else 0):
            ax.axhline(edp_rank * mesh.ep, color="black", ls="--", lw=1)
        ax.set_xlim(0, mesh.tp)
        ax.set_ylim(mesh.dp, 0)
        ax.set_xticks([t + 0.5 for t in range(mesh.tp)], [f"tp={t}" for t in range(mesh.tp)])
        ax.set_yticks([d + 0.5 for d in range(mesh.dp)], [f"dp={d}" for d in range(mesh.dp)])
        ax.xaxis.tick_top()
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(f"pipeline stage pp={pp_rank}", fontsize=10)
    note = "rows: TP groups (tinted), columns: DP groups"
    if mesh.ep > 1:
        note += f"\ndashed lines cut columns into EP groups of {mesh.ep}"
    fig.suptitle(f"{mesh}\n{note}", fontsize=10)
    return fig


def plot_collective(name: str, before: Sequence, after: Sequence) -> Figure:
    """Before and after of one collective from the ranks' real data: ``before`` and ``after`` hold
    one 1-D tensor or list of numbers per rank (lengths may differ, a receiver may be empty)."""
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} ranks but after has {len(after)}: give one entry per rank in each")
    rows_before = [_as_values(x) for x in before]
    rows_after = [_as_values(x) for x in after]
    width = max([len(r) for r in rows_before + rows_after] + [1])
    palette = _Palette()
    fig = NotebookFigure(figsize=(max(5.0, 2 * (0.6 * width + 1.0)), 0.5 * len(before) + 1.2), layout="constrained")
    ax_before, ax_after = fig.subplots(1, 2, sharey=True)
    _draw_rank_rows(ax_before, rows_before, palette, width, "before")
    _draw_rank_rows(ax_after, rows_after, palette, width, "after")
    fig.suptitle(name, fontsize=12)
    return fig


def plot_ring_steps(states: Sequence[tuple]) -> Figure:
    """Ring all-reduce (or any chunked algorithm), one panel per ``(label, chunks_per_rank)`` of
    ``states``: ``chunks_per_rank[r]`` holds rank r's chunks (numbers, short lists, None: unknown)."""
    if not states:
        raise ValueError("states is empty: give at least one (label, chunks_per_rank) snapshot")
    snapshots = []
    for i, state in enumerate(states):
        if not (isinstance(state, (tuple, list)) and len(state) == 2):
            raise ValueError(f"states[{i}] must be a (label, chunks_per_rank) pair, got {state!r}")
        label, per_rank = state
        snapshots.append((str(label), [_as_values(r) for r in per_rank]))
    width = max([len(row) for _, rows in snapshots for row in rows] + [1])
    world = max(len(rows) for _, rows in snapshots)
    ncols, nrows = _grid_shape(len(snapshots))
    fig = NotebookFigure(figsize=(ncols * (0.55 * width + 1.2), nrows * (0.4 * world + 0.9)), layout="constrained")
    axes = _panels(fig, len(snapshots), ncols, nrows)
    palette = _Palette()
    for ax, (label, rows) in zip(axes, snapshots):
        _draw_rank_rows(ax, rows, palette, width, label)
    return fig


def plot_cost_model(sizes_bytes: Sequence[float], measured_seconds: Optional[Sequence[float]] = None, *,
                    alpha: float = 2e-5, beta: float = 1e-9, world_size: int = 4) -> Figure:
    """The alpha-beta model of ring all-reduce against message size n, log-log:
    ``T(n) = 2(N-1) alpha + 2(N-1)/N n beta`` (2(N-1) steps each paying the latency alpha, every
    rank sending 2(N-1)/N of the n bytes at beta s/byte). The first term dominates small messages,
    the second large ones; they are equal at ``n* = N alpha / beta``. ``measured_seconds``: timings
    at ``sizes_bytes``. Defaults: alpha = 20 µs, beta = 1 ns/byte (1 GB/s), N = 4."""
    sizes = np.asarray([float(s) for s in sizes_bytes])
    if sizes.size == 0 or not np.all(sizes > 0):
        raise ValueError(f"sizes_bytes must be positive message sizes, got {list(sizes_bytes)}")
    if not (isinstance(world_size, int) and world_size >= 2):
        raise ValueError(f"world_size must be an int >= 2 for a ring all-reduce to send anything, got {world_size!r}")
    if not (alpha > 0 and beta > 0):
        raise ValueError(f"alpha and beta must be positive, got alpha={alpha}, beta={beta}")
    n_ranks = world_size
    latency = 2 * (n_ranks - 1) * alpha                       # seconds, whatever n
    per_byte = 2 * (n_ranks - 1) / n_ranks * beta             # seconds per byte of message
    crossover = latency / per_byte                            # = N alpha / beta

    lo, hi = min(sizes.min(), crossover / 2), max(sizes.max(), crossover * 2)
    n = np.geomspace(lo, hi, 200)
    fig = NotebookFigure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.loglog(n, latency + per_byte * n, color="black", lw=2,
              label="model T(n) = 2(N-1)α + 2(N-1)/N·nβ")
    ax.loglog(n, np.full_like(n, latency), ls="--", color="tab:blue",
              label=f"latency-bound: 2(N-1)α = {fmt_seconds(latency)}")
    ax.loglog(n, per_byte * n, ls="--", color="tab:orange", label="bandwidth-bound: 2(N-1)/N·nβ")
    y = [latency + per_byte * n[0], latency + per_byte * n[-1]]
    if measured_seconds is not None:
        measured = np.asarray([float(t) for t in measured_seconds])
        if measured.shape != sizes.shape:
            raise ValueError(f"measured_seconds has {measured.size} values but sizes_bytes has {sizes.size}")
        ax.loglog(sizes, measured, "o", color="tab:red", label="measured")
        y += [measured[measured > 0].min(), measured.max()] if np.any(measured > 0) else []
    ax.axvline(crossover, color="grey", ls=":", lw=1)
    bottom = min(y) / 3
    ax.annotate(f"n* = Nα/β = {fmt_bytes(crossover)}", (crossover, bottom),
                xytext=(4, 4), textcoords="offset points", fontsize=9, color="dimgrey")
    ax.set_ylim(bottom, max(y) * 3)
    ax.set_xlabel("message size n (bytes)")
    ax.set_ylabel("all-reduce time (s)")
    ax.set_title(f"Ring all-reduce on N={n_ranks} ranks: α={fmt_seconds(alpha)}, "
                 f"1/β={fmt_bytes(1 / beta)}/s", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    return fig


def plot_latency_vs_ranks(cost, sizes_bytes: Sequence[float], ranks: Sequence[int], *,
                          mark: Optional[int] = None) -> Figure:
    """The two terms of a ring all-reduce's time (`reference.comms.CostModel` ``cost``) against
    the number of ranks N, log-log: the latency term 2(N-1) alpha grows with N, the bandwidth term
    2(N-1)/N n beta of each size in ``sizes_bytes`` hardly moves; ``mark`` draws a line at N ranks."""
    ranks = [int(n) for n in ranks]
    if not ranks or min(ranks) < 2:
        raise ValueError(f"ranks must be numbers of ranks >= 2, got {list(ranks)}")
    if not sizes_bytes or min(sizes_bytes) <= 0:
        raise ValueError(f"sizes_bytes must be positive message sizes, got {list(sizes_bytes)}")
    fig = NotebookFigure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.subplots()
    latency = [cost.time("all_reduce", 0, n) for n in ranks]
    ax.loglog(ranks, latency, "o-", color="black", lw=2, ms=4, label="latency term 2(N-1)α")
    for k, nbytes in enumerate(sizes_bytes):
        bandwidth = [cost.time("all_reduce", nbytes, n) - t for n, t in zip(ranks, latency)]
        ax.loglog(ranks, bandwidth, "s--", ms=3, color=CATEGORICAL[2 * k + 2],
                  label=f"bandwidth term 2(N-1)/N·nβ, n = {fmt_bytes(nbytes)}")
    if mark is not None:
        ax.axvline(mark, color="grey", ls=":", lw=1)
        ax.annotate(f"N = {mark}", (mark, min(latency)), xytext=(4, 4), textcoords="offset points",
                    fontsize=9, color="dimgrey")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("seconds")
    ax.set_title(f"Ring all-reduce: α = {fmt_seconds(cost.alpha)}, 1/β = {fmt_bytes(cost.bandwidth)}/s",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    return fig
