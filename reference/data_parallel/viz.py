"""Pictures of data parallelism: one step (`plot_data_parallel_step`), the overlap of
all-reduces with backward drawn from ``ddp.trace`` (`plot_overlap`; `summarize_overlap`
gives the same facts as numbers), and what a replica costs as the model grows
(`plot_dp_scaling`).

Every function returns a ``matplotlib.figure.Figure`` and touches no pyplot state.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.patches import FancyBboxPatch, Patch

from reference.viz import CATEGORICAL, NotebookFigure, fmt_bytes, fmt_seconds, lighten

__all__ = ["OverlapSummary", "summarize_overlap", "plot_overlap", "plot_data_parallel_step",
           "plot_dp_scaling"]

_BACKWARD = "0.55"
_HIDDEN = lighten(CATEGORICAL[0], 0.35)  # light blue: launched while backward still runs
_EXPOSED = CATEGORICAL[6]  # red: the step waits for it after backward


# ------------------------------------------------------------------- the trace
@dataclass(frozen=True)
class OverlapSummary:
    """One rank's synchronised step, read from ``ddp.trace`` (seconds)."""

    backward_s: float           # from the end of forward to the end of backward
    n_buckets: int              # all-reduces, one per bucket
    launched_in_backward: int   # of them, launched before backward ended
    exposed_s: float            # from the end of backward to the last wait's end: communication not hidden


def _parse(trace) -> dict:
    """{forward_end, backward_end: time; launch, wait_start, wait_end: {bucket: time}}."""
    if not trace:
        raise ValueError("the trace is empty: run forward and a synchronised backward through DDP first")
    single = {"forward_end": [], "backward_end": []}
    per_bucket = {"launch": {}, "wait_start": {}, "wait_end": {}}
    for e in trace:
        if not isinstance(e, dict) or not {"event", "bucket", "time"} <= e.keys():
            raise ValueError(f"a trace event is a dict with keys event, bucket, time; got {e!r}")
        if e["event"] in single:
            single[e["event"]].append(e["time"])
        elif e["event"] in per_bucket:
            per_bucket[e["event"]][e["bucket"]] = e["time"]
    for name, times in single.items():
        if len(times) != 1:
            raise ValueError(f"the trace must hold one {name!r} event, found {len(times)}: "
                             "pass the trace of one synchronised step (ddp.trace)")
    buckets = sorted(per_bucket["launch"])
    for name in ("wait_start", "wait_end"):
        if sorted(per_bucket[name]) != buckets:
            raise ValueError(f"buckets with a launch {buckets} differ from buckets with a "
                             f"{name} {sorted(per_bucket[name])}")
    return dict(forward_end=single["forward_end"][0], backward_end=single["backward_end"][0],
                buckets=buckets, **per_bucket)


def summarize_overlap(trace) -> OverlapSummary:
    """The overlap of one rank's step, as numbers (see `OverlapSummary`)."""
    t = _parse(trace)
    end = t["backward_end"]
    last_wait = max(t["wait_end"].values(), default=end)
    return OverlapSummary(
        backward_s=end - t["forward_end"],
        n_buckets=len(t["buckets"]),
        launched_in_backward=sum(t["launch"][b] < end for b in t["buckets"]),
        exposed_s=max(0.0, last_wait - end),
    )


def plot_overlap(traces, title: str | None = None, same_clock: bool = False):
    """The timeline of a DDP step, one panel per rank (``traces``: one ``ddp.trace`` or a list).

    Row "bucket i" runs from the launch of its all-reduce to the end of the wait for it: light
    while backward still ran, red where the step waited. On the CPU an all-reduce whose wait
    returned at once had finished somewhere inside its light bar; on a GPU (CUDA events) a bar
    ends when its all-reduce really finished. Each rank's time starts at its own forward end;
    ``same_clock=True`` draws all from the earliest one, for ranks sharing one machine's clock.
    """
    one_trace = bool(traces) and isinstance(traces[0], dict)
    per_rank = [traces] if one_trace else list(traces)
    if not per_rank:
        raise ValueError("no traces: pass ddp.trace, or a list of one trace per rank")
    parsed = [_parse(tr) for tr in per_rank]
    n_rows = 1 + max(len(t["buckets"]) for t in parsed)
    fig = NotebookFigure(figsize=(9, len(parsed) * (0.24 * n_rows + 0.9) + 0.6), layout="constrained")
    axes = fig.subplots(len(parsed), 1, squeeze=False, sharex=True)[:, 0]
    first_forward_end = min(t["forward_end"] for t in parsed)
    for rank, (ax, t, trace) in enumerate(zip(axes, parsed, per_rank)):
        t0 = first_forward_end if same_clock else t["forward_end"]
        end = 1e3 * (t["backward_end"] - t0)
        backward_start = 1e3 * (t["forward_end"] - t0)
        ax.barh(0, end - backward_start, left=backward_start, height=0.7, color=_BACKWARD)
        for row, b in enumerate(t["buckets"], start=1):
            start, done = 1e3 * (t["launch"][b] - t0), 1e3 * (t["wait_end"][b] - t0)
            if start < end:
                ax.barh(row, min(done, end) - start, left=start, height=0.7, color=_HIDDEN)
            if done > end:
                ax.barh(row, done - max(start, end), left=max(start, end), height=0.7, color=_EXPOSED)
            ax.plot([start], [row], marker="|", color="black", markersize=9)
        ax.axvline(end, color="black", ls="--", lw=1)
        s = summarize_overlap(trace)
        ax.set_yticks(range(n_rows), ["backward"] + [f"bucket {b}" for b in t["buckets"]], fontsize=8)
        ax.set_ylim(n_rows - 0.4, -0.6)  # backward on top, then bucket 0, 1, ...
        ax.set_title(f"rank {rank}: backward {fmt_seconds(s.backward_s)}, {s.launched_in_backward} of "
                     f"{s.n_buckets} all-reduces launched during it, {fmt_seconds(s.exposed_s)} "
                     f"waited after it", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    origin = "the first rank's forward ended" if same_clock else "forward ended"
    axes[-1].set_xlabel(f"ms since {origin} (dashed: backward ends)")
    fig.legend(handles=[Patch(color=_BACKWARD, label="backward"),
                        Patch(color=_HIDDEN, label="all-reduce launched while backward runs"),
                        Patch(color=_EXPOSED, label="waited for after backward")],
               loc="outside upper center", ncols=3, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# -------------------------------------------------------------- one step, drawn
def _box(ax, x, y, w, h, text, colour, fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.06",
                                facecolor=colour, edgecolor="black", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, x, y_from, y_to):
    ax.annotate("", (x, y_to), (x, y_from), arrowprops=dict(arrowstyle="->", lw=1))


def plot_data_parallel_step(world_size: int = 4):
    """One data-parallel step on `world_size` ranks, as a scheme: per rank its slice of the batch,
    its full model, its gradient g_r; one all-reduce, then the same optimizer step everywhere."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    n = world_size
    fig = NotebookFigure(figsize=(max(6.0, 2.1 * n + 0.6), 5.0), layout="constrained")
    ax = fig.subplots()
    # Bottom y of each row of boxes, top to bottom; boxes are 0.6 high, the all-reduce 0.9.
    y_slice, y_model, y_reduce, y_step = 4.4, 3.3, 1.6, 0.3

    def rows_of(k: int) -> str:  # k B / N, written as a reader would
        return "0" if k == 0 else "B/N" if k == 1 else f"{k}B/N"

    for r in range(n):
        tint = lighten(CATEGORICAL[2 * (r % 10)], 0.5)
        x = r * 2.1
        _box(ax, x, y_slice, 1.8, 0.6, f"rank {r}: batch rows\n[{rows_of(r)}, {rows_of(r + 1)})", tint)
        _box(ax, x, y_model, 1.8, 0.6, "full model (Ψ params)\nforward, backward", "0.92")
        _box(ax, x, y_step, 1.8, 0.6, "optimizer step with ḡ\n(same on every rank)", "0.92")
        _arrow(ax, x + 0.9, y_slice, y_model + 0.6)
        _arrow(ax, x + 0.9, y_model, y_reduce + 0.9)
        ax.text(x + 1.0, (y_model + y_reduce + 0.9) / 2, f"local gradient g_{r}", ha="left",
                va="center", fontsize=8)
        _arrow(ax, x + 0.9, y_reduce, y_step + 0.6)
    _box(ax, 0, y_reduce, 2.1 * n - 0.3, 0.9,
         f"all-reduce, then divide by N = {n}:  ḡ = (g_0 + ... + g_{n - 1}) / N\n"
         "each rank sends 2(N-1)/N · (gradient bytes)", lighten(CATEGORICAL[0], 0.6), fontsize=9)
    ax.set_xlim(-0.15, 2.1 * n + 0.25)
    ax.set_ylim(0.2, 5.1)
    ax.axis("off")
    ax.set_title(f"One data-parallel step on N = {n} ranks: global batch of B rows", fontsize=10)
    return fig


# ------------------------------------------------------------- cost of a replica
def plot_dp_scaling(names: Sequence[str], psis: Sequence[int], world_size: int,
                    state_bytes_per_param: int = 16, grad_bytes_per_param: int = 4,
                    device_bytes: float = 80e9, cost=None):
    """What plain data parallelism costs each rank, model by model (log scale): left the model
    states ``state_bytes_per_param * Ψ`` against one device, whatever N; right the bytes sent per
    step, ``2(N-1)/N * grad_bytes_per_param * Ψ``, timed by `cost` (`reference.comms.CostModel`)."""
    if len(names) != len(psis) or not psis:
        raise ValueError(f"give one name per model size: {len(names)} names for {len(psis)} sizes")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 for the gradients to be sent, got {world_size!r}")
    n = world_size
    states = [state_bytes_per_param * p for p in psis]
    sent = [2 * (n - 1) / n * grad_bytes_per_param * p for p in psis]
    fig = NotebookFigure(figsize=(10, 4.0), layout="constrained")
    ax_mem, ax_net = fig.subplots(1, 2)
    x = range(len(names))
    fits = [s <= device_bytes for s in states]
    ax_mem.bar(x, states, color=[_HIDDEN if f else _EXPOSED for f in fits])
    ax_mem.axhline(device_bytes, color="black", ls="--", lw=1)
    ax_mem.text(-0.4, device_bytes, f"one device: {fmt_bytes(device_bytes)}",
                ha="left", va="bottom", fontsize=8)
    ax_mem.set_title(f"model states per rank: {state_bytes_per_param}Ψ bytes (any N)", fontsize=10)
    ax_net.bar(x, sent, color=lighten(CATEGORICAL[4], 0.3))
    ax_net.set_title(f"sent per rank per step: 2(N-1)/N·{grad_bytes_per_param}Ψ bytes, N = {n}", fontsize=10)
    for i, (s, b) in enumerate(zip(states, sent)):
        ax_mem.text(i, s, fmt_bytes(s), ha="center", va="bottom", fontsize=7)
        label = fmt_bytes(b) + (f"\n{fmt_seconds(cost.time('all_reduce', grad_bytes_per_param * psis[i], n))}"
                                 if cost is not None else "")
        ax_net.text(i, b, label, ha="center", va="bottom", fontsize=7)
    for ax in (ax_mem, ax_net):
        ax.set_yscale("log")
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("bytes")
        ax.set_ylim(min(min(states), min(sent)) / 3, max(max(states), device_bytes) * 6)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig
