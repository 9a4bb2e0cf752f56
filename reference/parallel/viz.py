"""Pictures of a composed step: one row per rank, and the costs of configurations.

* `plot_step(traces, mesh)`: what every rank did in one `train_step` (forward and backward
  of each micro-batch, the pipeline's messages, the data-parallel gradient reduction, the
  optimizer step), from the real trace, each rank labelled with its (pp, dp, tp) place;
* `plot_bubble_against_m(pp, ms)`: the pipeline bubble of a configuration as m grows;
* `plot_memory_breakdown(estimates)`: memory per GPU of several configurations, stacked by
  parameters, gradients, optimizer state and activations, against the device's memory.
"""
from __future__ import annotations

from typing import Optional, Sequence

from matplotlib.patches import Patch, Rectangle

from reference.viz import CATEGORICAL, NotebookFigure, lighten

__all__ = ["plot_step", "plot_bubble_against_m", "plot_memory_breakdown"]

_KIND_COLOURS = {"F": CATEGORICAL[1], "B": CATEGORICAL[0], "I": CATEGORICAL[0], "W": CATEGORICAL[2],
                 "SEND": (0.45,) * 3, "RECV": (0.7,) * 3, "A2A": CATEGORICAL[3], "reduce": CATEGORICAL[6],
                 "optimizer": CATEGORICAL[4]}
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradient (I)", "W": "weight gradients (W)",
               "SEND": "send", "RECV": "receive", "A2A": "expert all-to-all in flight (overlapped F&B)",
               "reduce": "gradient reduction (tp, dp)",
               "optimizer": "optimizer step"}


def plot_step(traces: Sequence[Sequence], mesh=None, title: Optional[str] = None):
    """``traces[r]``: rank r's `StepResult.trace`. Rows are ranks, rank 0 on top."""
    if not traces or not any(traces):
        raise ValueError("no events to draw: pass every rank's StepResult.trace")
    span = max(e.end for row in traces for e in row) or 1.0
    fig = NotebookFigure(figsize=(11, 0.45 * len(traces) + 1.6))
    ax = fig.add_subplot()
    for r, row in enumerate(traces):
        for e in row:
            colour = _KIND_COLOURS.get(e.kind, "0.3")
            thin = e.kind in ("SEND", "RECV", "A2A")
            # an all-to-all in flight runs under the other micro-batch's compute: a bar below its row's boxes
            y, h = (r + 0.9, 0.1) if e.kind == "A2A" else (r + 0.35, 0.3) if thin else (r + 0.1, 0.8)
            ax.add_patch(Rectangle((e.start, y), max(e.end - e.start, span * 1e-3), h,
                                   facecolor=colour if not thin else lighten(colour, 0.1),
                                   edgecolor="black" if not thin else "none", lw=0.4))
            if e.kind in ("F", "B", "I", "W") and (e.end - e.start) / span > 0.03:
                ax.text((e.start + e.end) / 2, r + 0.5, e.label.split(".")[0], ha="center",
                        va="center", fontsize=7)
    labels = []
    for r in range(len(traces)):
        if mesh is not None:
            c = mesh.coords(r)
            labels.append(f"rank {r}  pp{c.pp} dp{c.dp} tp{c.tp}")
        else:
            labels.append(f"rank {r}")
    ax.set_xlim(0, span)
    ax.set_ylim(len(traces), 0)
    ax.set_yticks([r + 0.5 for r in range(len(traces))], labels, fontsize=8)
    ax.set_xlabel("seconds since the step began")
    ax.tick_params(left=False)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    present = {e.kind for row in traces for e in row}
    ax.legend(handles=[Patch(facecolor=_KIND_COLOURS[k], edgecolor="black", label=_KIND_NAMES[k])
                       for k in _KIND_COLOURS if k in present],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "one training step, every rank", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bubble_against_m(pp: int, ms: Sequence[int], virtual: int = 1, title: Optional[str] = None):
    """(pp - 1) / (v m + pp - 1) for each m: the idle share of a pipeline of pp stages."""
    fig = NotebookFigure(figsize=(6, 3.4))
    ax = fig.add_subplot()
    bubbles = [(pp - 1) / (virtual * m + pp - 1) for m in ms]
    ax.plot(ms, bubbles, "o-", color=CATEGORICAL[0])
    for m, b in zip(ms, bubbles):
        ax.annotate(f"{b:.0%}", (m, b), textcoords="offset points", xytext=(0, 6), ha="center",
                    fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ms), [str(m) for m in ms])
    ax.set_xlabel("micro-batches per step m")
    ax.set_ylabel("bubble")
    ax.set_ylim(0, max(bubbles) * 1.2 + 0.01)
    ax.set_title(title or f"pipeline bubble, pp={pp}" + (f", v={virtual}" if virtual > 1 else ""),
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_memory_breakdown(estimates: dict, device_bytes: float = 80e9, title: Optional[str] = None):
    """``estimates``: {label: `Estimate`}; stacked bars in GB per GPU and the device's line."""
    fig = NotebookFigure(figsize=(max(6, 1.3 * len(estimates) + 3), 3.8))
    ax = fig.add_subplot()
    parts = [("parameters", lambda e: e.model_states.params), ("gradients", lambda e: e.model_states.grads),
             ("optimizer state", lambda e: e.model_states.optimizer_state),
             ("activations", lambda e: e.activations)]
    labels = list(estimates)
    bottoms = [0.0] * len(labels)
    for i, (name, get) in enumerate(parts):
        values = [get(estimates[k]) / 1e9 for k in labels]
        ax.bar(range(len(labels)), values, bottom=bottoms, color=CATEGORICAL[2 * i], label=name)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, total in enumerate(bottoms):
        ax.text(x, total, f"{total:.0f} GB", ha="center", va="bottom", fontsize=8)
    ax.axhline(device_bytes / 1e9, color="black", ls="--", lw=1)
    ax.text(len(labels) - 0.5, device_bytes / 1e9, f" {device_bytes / 1e9:.0f} GB device",
            va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("GB per GPU")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "memory per GPU", fontsize=10)
    fig.tight_layout()
    return fig
