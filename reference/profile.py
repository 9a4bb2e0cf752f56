"""Profiles of a parallel step: a trace per rank, where the time went, and MFU.

    summary = profile_step(lambda: train_step(pm, opt, idx, tgt), trace_dir="traces")  # in a rank
    plot_profile([s for s in summaries])          # one bar per rank: compute, collectives, idle

`profile_step` runs one step under `torch.profiler` on this rank, writes its Chrome/Perfetto
trace (`traces/rank3.json`: open it at https://ui.perfetto.dev or chrome://tracing) and sorts
the step's wall time into:

* **compute**: the main thread's top-level operators (`aten::...` forward ops, autograd's
  backward functions), other than a collective's own record;
* **communication**, by kind (`COMM_KINDS`): the backend's own events (`gloo:all_reduce`,
  `nccl:...`) from start to end, so *waiting for a slower peer is included* (a long bar on one
  rank often means a late rank elsewhere);
* **idle**: the rest, when the main thread ran nothing the profiler saw (Python between
  operators, the optimizer's bookkeeping).

Overlapping intervals are merged first, so a collective running under a computation (DDP's
buckets during backward) counts as communication only where nothing was computing; the part
under a computation is `hidden`, and `overlap` the fraction of all communication hidden.

MFU (model FLOPs utilisation): the step's training FLOPs, 6 N per token for the weights plus
12 L T C per token for attention's two matmuls (PaLM, Chowdhery et al., 2022, appendix B),
divided by the step time and the machine's peak, *measured* (`measure_matmul_peak`: a large fp32
matmul on every core) rather than read from a datasheet.
"""
from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

__all__ = ["ProfileSummary", "profile_step", "training_flops", "measure_matmul_peak", "mfu",
           "plot_profile", "plot_comm_shares", "COMM_KINDS"]

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv")
_COMM_EVENT = re.compile(r"^(?:c10d::|gloo:|nccl:)(\w+)")
# Top-level events that are not computation: the collectives' own records and profiler markers.
_NOT_COMPUTE = ("c10d::", "gloo:", "nccl:", "record_param_comms", "ProfilerStep", "[memory]",
                "ncclDevKernel", "cuda")


@dataclass
class ProfileSummary:
    """Seconds of one step on one rank, by category (they add up to `step`)."""

    rank: int
    step: float
    compute: float
    communication: dict = field(default_factory=dict)   # kind -> seconds (not under compute)
    idle: float = 0.0
    trace_path: Optional[str] = None
    hidden: float = 0.0                                  # communication under computation

    @property
    def communication_total(self) -> float:
        return sum(self.communication.values())

    @property
    def communication_share(self) -> float:
        return self.communication_total / self.step if self.step else 0.0

    @property
    def overlap(self) -> float:
        """The fraction of the step's communication that ran under computation."""
        total = self.hidden + self.communication_total
        return self.hidden / total if total else 0.0


def _kind(name: str) -> Optional[str]:
    """The kind of collective of a backend event (`gloo:all_reduce`) or a process group's call
    (`c10d::allreduce_`), else None."""
    m = _COMM_EVENT.match(name)
    if not m:
        return None
    op = m.group(1).lower().replace("_base", "").replace("_", "")
    for key, kind in (("allreduce", "all_reduce"), ("allgather", "all_gather"),
                      ("reducescatter", "reduce_scatter"), ("broadcast", "broadcast"),
                      ("alltoall", "all_to_all"), ("send", "send"), ("recv", "recv")):
        if key in op:
            return kind
    return "all_reduce" if "reduce" in op else None


def _merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _minus(intervals, cover):
    """The parts of `intervals` not covered by `cover` (both merged, sorted)."""
    out, j = [], 0
    for a, b in intervals:
        start = a
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            if cover[k][0] > start:
                out.append([start, cover[k][0]])
            start = max(start, cover[k][1])
            k += 1
        if start < b:
            out.append([start, b])
    return out


def profile_step(step: Callable[[], object], trace_dir=None, rank: Optional[int] = None) -> ProfileSummary:
    """Run ``step()`` once under the profiler; summarise it (and write the trace when
    ``trace_dir`` is given). Times are seconds."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = list(prof.events())
    if not events:
        return ProfileSummary(rank, wall, 0.0, {}, wall)
    start = min(e.time_range.start for e in events)
    to_s = lambda us: (us - start) / 1e6  # noqa: E731
    ops = [e for e in events if e.cpu_parent is None and not e.name.startswith(_NOT_COMPUTE)]
    threads = Counter(e.thread for e in ops)
    main_thread = threads.most_common(1)[0][0] if threads else None  # where the step's operators ran
    mine = [e for e in events if main_thread is None or e.thread == main_thread]
    # Blocking communication: the main thread inside a collective's call (a TP all-reduce in a
    # forward, a pipeline send): it counts as communication even inside an operator.
    blocking: dict = {}
    for e in mine:
        if e.name.startswith("c10d::") and (kind := _kind(e.name)):
            blocking.setdefault(kind, []).append([to_s(e.time_range.start), to_s(e.time_range.end)])
    blocked = _merge([iv for v in blocking.values() for iv in v])
    # Computation: the main thread's top-level operators (forward ops, autograd's backward
    # functions), minus the time they spent blocked in a collective.
    compute = _minus(_merge([[to_s(e.time_range.start), to_s(e.time_range.end)] for e in ops
                             if main_thread is None or e.thread == main_thread]), blocked)
    # Asynchronous communication (the backend's own events: DDP's buckets, a receive waited for)
    # counts where the main thread was neither computing nor blocked.
    comm = {k: _merge(v) for k, v in blocking.items()}
    for e in events:
        if not e.name.startswith("c10d::") and (kind := _kind(e.name)):
            comm.setdefault(kind, []).append([to_s(e.time_range.start), to_s(e.time_range.end)])
    taken = _merge(compute + blocked)
    comm_only = {}
    for kind in sorted(comm, key=lambda k: -_length(_merge(comm[k]))):
        mine_k = _merge(blocking.get(kind, []))
        extra = _minus(_minus(_merge(comm[kind]), taken), _merge([iv for v in comm_only.values() for iv in v]))
        comm_only[kind] = _merge(mine_k + extra)
    busy = _merge([iv for v in comm_only.values() for iv in v] + compute)
    span = max(wall, _length(busy))
    every_comm = _merge([iv for v in comm.values() for iv in v])
    summary = ProfileSummary(rank, span, _length(compute),
                             {k: _length(v) for k, v in comm_only.items()},
                             max(0.0, span - _length(busy)),
                             hidden=_length(every_comm) - _length(_minus(every_comm, _merge(compute))))
    if trace_dir is not None:
        path = Path(trace_dir) / f"rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        summary.trace_path = str(path)
    return summary


def training_flops(n_params: int, tokens: int, n_layer: int, seq_len: int, n_embd: int) -> float:
    """6 N per token for the weights, plus 12 L T C per token for attention (forward and backward)."""
    return tokens * (6 * n_params + 12 * n_layer * seq_len * n_embd)


def measure_matmul_peak(n: int = 1024, repeats: int = 5, dtype=torch.float32) -> float:
    """FLOP/s of an n x n matmul on this machine (all intra-op threads), best of ``repeats``."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    return flops_per_step / step_seconds / peak_flops


def plot_profile(summaries, title: Optional[str] = None, labels=None):
    """One horizontal bar per summary (`labels`, default "rank r"): compute, each kind of
    communication, idle, and its communication share at the end."""
    from reference.viz import CATEGORICAL, NotebookFigure

    kinds = [k for k in COMM_KINDS if any(k in s.communication for s in summaries)]
    parts = ["compute"] + kinds + ["idle"]
    fig = NotebookFigure(figsize=(8.5, 0.45 * len(summaries) + 2.0))
    ax = fig.add_subplot()
    colours = {"compute": CATEGORICAL[0], "idle": (0.85, 0.85, 0.85)}
    colours.update({k: CATEGORICAL[2 * (i + 2)] for i, k in enumerate(kinds)})
    longest = 0.0
    for row, s in enumerate(summaries):
        left = 0.0
        for part, value in [("compute", s.compute)] + [(k, s.communication.get(k, 0.0)) for k in kinds] \
                + [("idle", s.idle)]:
            ax.barh(row, value * 1e3, left=left * 1e3, color=colours[part],
                    label=part if row == 0 else None, edgecolor="white", lw=0.5)
            left += value
        ax.text(left * 1e3, row, f" {s.communication_share:.0%} comm", va="center", fontsize=7)
        longest = max(longest, left)
    ax.set_xlim(0, longest * 1e3 * 1.16 or 1.0)   # room for the "% comm" labels
    ax.set_yticks(range(len(summaries)), labels or [f"rank {s.rank}" for s in summaries], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds of the step")
    ax.set_title(title or "where each rank's step went", fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    height = fig.get_size_inches()[1]
    fig.legend(handles, names, fontsize=8, frameon=False, loc="lower center", ncol=len(parts))
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))   # the legend's strip at the bottom
    return fig


def plot_comm_shares(labels, shares, threshold: float = 0.3, title: Optional[str] = None):
    """One bar per configuration: the share of its step spent communicating, with the line
    a step should stay under (the troubleshooting table's 30 %)."""
    from reference.viz import CATEGORICAL, NotebookFigure

    fig = NotebookFigure(figsize=(7, 2.8))
    ax = fig.add_subplot()
    ax.bar(range(len(shares)), [100 * s for s in shares], color=CATEGORICAL[0])
    ax.axhline(100 * threshold, color="0.4", ls="--", lw=1)
    ax.text(len(shares) - 0.5, 100 * threshold + 1, f"{threshold:.0%}", ha="right", fontsize=8)
    ax.set_xticks(range(len(shares)), labels, fontsize=7)
    ax.set_ylabel("% of the step communicating")
    ax.set_title(title or "communication share of the step", fontsize=10)
    fig.tight_layout()
    return fig
