"""Pictures of pipeline schedules: timelines and the bubble against its formula.

`plot_timeline` draws one row per rank, rank 0 on top, and one box per forward (light) or
backward (dark) in its micro-batch's colour, the chunk as hatching: white space is the bubble.
`plot_stage_balance` draws each stage's compute (time) and what it holds (memory). `plot_overlap`
draws one rank's overlapped F&B pairs: each chunk computed, and each all-to-all in flight below it.
"""
from __future__ import annotations

from typing import Optional, Sequence

from matplotlib.patches import Patch, Rectangle

from reference.pipeline_parallel.actions import COMPUTE, IN_FLIGHT
from reference.pipeline_parallel.check import bubble_of
from reference.viz import CATEGORICAL, NotebookFigure, lighten

__all__ = ["plot_timeline", "plot_schedule", "plot_bubble_curve", "plot_stage_balance", "plot_overlap"]

_HATCHES = ["", "//", "..", "xx", "\\\\", "++", "oo", "--"]
_SHADE = {"F": 0.55, "B": 0.05, "I": 0.05, "W": 0.3}  # how far each compute box is lightened


def _new_axes(ax, size):
    if ax is not None:
        return ax.figure, ax
    fig = NotebookFigure(figsize=size)
    return fig, fig.add_subplot()


def plot_timeline(timeline, title: Optional[str] = None, ax=None, xlabel: str = "time",
                  show_comm: bool = False):
    """Ranks as rows, each F and B a coloured box from its start to its end; ``show_comm=True`` also
    draws a thin grey bar for the time a rank spent in a communication step."""
    n_ranks = len(timeline)
    events = [e for row in timeline for e in row]
    if not events:
        raise ValueError("the timeline has no events")
    t0 = min(e.start for e in events)
    span = max(e.end for e in events) - t0 or 1.0
    n_mb = 1 + max(e.action.mb for e in events)
    n_chunks = 1 + max(e.action.chunk for e in events)
    n_boxes = max(sum(e.action.op in COMPUTE for e in row) for row in timeline)
    fig, ax = _new_axes(ax, (min(16, 3 + 0.3 * n_boxes), 0.55 * n_ranks + 1.4))
    fontsize = 8 if n_boxes <= 24 else 6 if n_boxes <= 48 else 0
    for e in events:
        a, x, w = e.action, e.start - t0, e.end - e.start
        if a.op in COMPUTE:  # F light, B dark; a split B's I dark too, its W in between
            rgb = CATEGORICAL[2 * (a.mb % (len(CATEGORICAL) // 2))]
            face = lighten(rgb, _SHADE[a.op])
            ax.add_patch(Rectangle((x, e.rank + 0.1), w, 0.8, facecolor=face, edgecolor="black",
                                   lw=0.6, hatch=_HATCHES[a.chunk % len(_HATCHES)]))
            if fontsize and w / span > 0.012:
                ax.text(x + w / 2, e.rank + 0.5, f"{a.op}{a.mb}", ha="center", va="center",
                        fontsize=fontsize)
        elif show_comm and w > 0:
            ax.add_patch(Rectangle((x, e.rank + 0.85), w, 0.1, facecolor="0.6", lw=0))
    ax.set_xlim(0, span)
    ax.set_ylim(n_ranks, 0)  # rank 0 on top
    ax.set_yticks([r + 0.5 for r in range(n_ranks)], [f"rank {r}" for r in range(n_ranks)])
    ax.set_xlabel(xlabel)
    ax.tick_params(left=False)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    legend = [Patch(facecolor="0.85", edgecolor="black", label="forward"),
              Patch(facecolor="0.45", edgecolor="black", label="backward (B, or its input half I)")]
    if any(e.action.op == "W" for e in events):
        legend.append(Patch(facecolor="0.65", edgecolor="black", label="weight gradients W"))
    legend += [Patch(facecolor="white", edgecolor="black", hatch=_HATCHES[c], label=f"chunk {c}")
               for c in range(n_chunks)] if n_chunks > 1 else []
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title is None:
        title = f"{n_mb} micro-batches on {n_ranks} ranks: bubble {bubble_of(timeline):.0%}"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_schedule(schedule, t_f: float = 1.0, t_b: float = 2.0, ax=None, title: Optional[str] = None):
    """A schedule's ideal timeline (`Schedule.simulate`) as a figure, its bubble in the title."""
    if title is None:
        v = f", v={schedule.virtual}" if schedule.virtual > 1 else ""
        title = (f"{schedule.kind}: pp={schedule.pp}, m={schedule.m}{v}, "
                 f"bubble {schedule.bubble_fraction(t_f, t_b):.0%}")
    return plot_timeline(schedule.simulate(t_f, t_b), title=title, ax=ax,
                         xlabel=f"time (a stage's forward takes {t_f:g}, its backward {t_b:g})")


def plot_bubble_curve(ms: Sequence[int], measured: dict, pp: int, formula=None, ax=None,
                      title: Optional[str] = None):
    """Measured bubble fractions (``{label: [one per m]}``) as points against a
    formula (default (p - 1) / (m + p - 1)) drawn as a line, as m grows."""
    fig, ax = _new_axes(ax, (6, 3.6))
    formula = formula or (lambda m: (pp - 1) / (m + pp - 1))
    fine = [ms[0] + (ms[-1] - ms[0]) * i / 200 for i in range(201)]
    ax.plot(fine, [formula(m) for m in fine], color="black", lw=1.2, label="(p-1)/(m+p-1)")
    for i, (label, values) in enumerate(measured.items()):
        ax.plot(ms, values, "o--", color=CATEGORICAL[2 * i], label=label)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title or f"bubble against m, pp={pp}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_stage_balance(costs: dict, pp: int, m: int):
    """One row per cut (``{label: [StageCost per stage]}``, from `stage_costs`):
    left, each stage's flops per micro-batch, forward and backward (time balance);
    right, what it holds at the 1F1B peak (memory balance): its model states, 16
    bytes a parameter (fp32 AdamW), and min(m, pp - r) micro-batches' stored
    activations on rank r."""
    fig = NotebookFigure(figsize=(9, 1.7 * len(costs) + 0.6), layout="constrained")
    axes = fig.subplots(len(costs), 2, squeeze=False, sharex="col")
    states_c, act_c = CATEGORICAL[0], CATEGORICAL[2]
    for (label, stages), (ax_t, ax_m) in zip(costs.items(), axes):
        ranks = range(len(stages))
        ax_t.barh(ranks, [c.flops / 1e6 for c in stages], color=CATEGORICAL[6])
        states = [16 * c.params / 1e6 for c in stages]
        acts = [min(m, pp - r) * c.stored_bytes / 1e6 for r, c in zip(ranks, stages)]
        ax_m.barh(ranks, states, color=states_c, label="model states (16 B a parameter)")
        ax_m.barh(ranks, acts, left=states, color=act_c, label=f"stored activations, 1F1B peak (m = {m})")
        for ax in (ax_t, ax_m):
            ax.set_yticks(list(ranks), [f"stage {r}" for r in ranks], fontsize=8)
            ax.invert_yaxis()
            ax.tick_params(axis="x", labelsize=8)
        ax_t.set_title(f"{label}: Mflop per micro-batch (time)", fontsize=9, loc="left")
        ax_m.set_title("MB held at the peak (memory)", fontsize=9, loc="left")
    handles, labels = axes[0][1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return fig


def plot_overlap(trace, rank: int = 0, start: Optional[float] = None, end: Optional[float] = None,
                 ax=None, title: Optional[str] = None):
    """One rank's run of DualPipe's overlapped pairs (`run_pipeline` on `overlap_pairs`): top lane,
    the chunks computed (forward light, backward dark, in the micro-batch's colour, labelled);
    bottom lane, every all-to-all from its issue to its end (``A2A_F`` a forward's, ``A2A_B`` a
    backward's), so that one reads which chunk of which micro-batch ran while which exchange was
    in flight. ``start``, ``end``: the window (seconds of the trace) to draw."""
    events = [e for e in trace
              if e.rank == rank and (e.action.op in COMPUTE or e.action.op in IN_FLIGHT)]
    lo = min(e.start for e in events) if start is None else start
    hi = max(e.end for e in events) if end is None else end
    events = [e for e in events if e.end > lo and e.start < hi]
    if not events:
        raise ValueError(f"rank {rank} has no compute or all-to-all in [{lo}, {hi}]")
    fig, ax = _new_axes(ax, (12, 2.4))
    for e in events:
        a = e.action
        comm = a.op in IN_FLIGHT
        op = a.op[4:] if comm else a.op
        rgb = CATEGORICAL[2 * (a.mb % (len(CATEGORICAL) // 2))]
        y = 1.1 if comm else 0.1
        x0, x1 = max(e.start, lo), min(e.end, hi)
        ax.add_patch(Rectangle((x0 - lo, y), x1 - x0, 0.8, facecolor=lighten(rgb, _SHADE[op]),
                               edgecolor="black", lw=0.6, hatch=_HATCHES[a.chunk % len(_HATCHES)]))
        if (x1 - x0) / (hi - lo) > 0.02:
            ax.text((x0 + x1) / 2 - lo, y + 0.4, f"{op}{a.mb}" + (f".c{a.chunk}" if a.chunk else ""),
                    ha="center", va="center", fontsize=7)
    ax.set_xlim(0, hi - lo)
    ax.set_ylim(2, 0)
    ax.set_yticks([0.5, 1.5], ["compute", "all-to-all\nin flight"])
    ax.set_xlabel("seconds")
    ax.tick_params(left=False)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"rank {rank}: forward and backward in turns, each all-to-all under "
                          f"the other's compute", fontsize=10)
    fig.tight_layout()
    return fig
