"""Pictures of the all-reduce algorithms' cost model (notebook 07), each a ``Figure``.

Imported on its own (``from reference.comms import viz``), so that matplotlib stays out of the ranks.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from reference.comms.algorithms import ALGORITHMS, two_level_time
from reference.viz import CATEGORICAL, NotebookFigure

__all__ = ["plot_allreduce_times", "plot_scaling"]


def plot_allreduce_times(sizes: Sequence[float], n: int, node_size: int,
                         nics: Sequence[int] = (1,), algorithms: Sequence[str] = ALGORITHMS,
                         **links) -> Figure:
    """Seconds of one all-reduce against message bytes, one line per algorithm, one panel per
    number of NICs per node (`two_level_time`; ``links``: its ``intra`` and ``inter``)."""
    fig = NotebookFigure(figsize=(4.2 * len(nics) + 1.2, 3.6))
    axes = fig.subplots(1, len(nics), sharey=True, squeeze=False)[0]
    for ax, k in zip(axes, nics):
        for i, name in enumerate(algorithms):
            ax.plot(sizes, [two_level_time(name, s, n, node_size, nics_per_node=k, **links) for s in sizes],
                    "o-", ms=3, color=CATEGORICAL[2 * i], label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message bytes")
        ax.set_title(f"{k} NIC{'s' if k > 1 else ''} per node of {node_size} GPUs", fontsize=9)
    axes[0].set_ylabel("seconds")
    axes[-1].legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"all-reduce on {n} ranks, alpha-beta model", fontsize=10)
    fig.tight_layout()
    return fig


def plot_scaling(gpus: Sequence[int], curves: Mapping[str, Sequence[float]], title: str = "") -> Figure:
    """Speed-up over one GPU against the number of GPUs: one line per label, and the ideal."""
    fig = NotebookFigure(figsize=(6.5, 3.4))
    ax = fig.add_subplot()
    ax.plot(gpus, gpus, ":", color="0.5", label="ideal")
    for i, (label, values) in enumerate(curves.items()):
        ax.plot(gpus, values, "o-", ms=3, color=CATEGORICAL[2 * i], label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("data-parallel GPUs")
    ax.set_ylabel("speed-up over 1 GPU")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
