"""Pictures of ZeRO: what each rank holds at each stage, measured bytes against the formula.

Each function returns a ``matplotlib.figure.Figure`` without touching pyplot, like
`reference.viz`. Colours as in the ZeRO paper's figure 1 (parameters blue, gradients orange,
optimizer state green); bytes in decimal units (1 GB = 1e9 bytes), as the paper quotes them.
`plot_zero_stages` draws the idea, `plot_memory_per_rank` measured bytes beside the formula,
`plot_memory_calculator` the calculator widget's figure, `plot_unit_residency` which FSDP
units are whole after each event of a step.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from matplotlib.colors import to_rgb
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from reference.memory import STAGE_NAMES, MemoryBytes, Precision, model_state_bytes
from reference.viz import NotebookFigure, fmt_bytes, lighten

__all__ = ["KINDS", "plot_zero_stages", "plot_memory_per_rank", "plot_memory_calculator",
           "plot_unit_residency"]

# (attribute of MemoryBytes, label, colour), in the order bars are stacked.
KINDS = (("params", "parameters", "tab:blue"),
         ("grads", "gradients", "tab:orange"),
         ("optimizer_state", "optimizer state", "tab:green"))
_SHORT_STAGE = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _byte_axis(ax) -> None:
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_bytes(v) if v else "0"))


def _check_stage(stage) -> None:
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0 (data parallel), 1, 2 or 3, got {stage!r}")


def _kind_legend(extra: Sequence = ()) -> list:
    return [Patch(facecolor=c, label=label) for _, label, c in KINDS] + list(extra)


# ---------------------------------------------------------------- the idea
def plot_zero_stages(dp: int = 4, precision: Optional[Precision] = None) -> NotebookFigure:
    """What each of `dp` ranks holds per parameter at each stage (the ZeRO paper's figure 1): a
    sharded kind pale but for rank r's slice [r/N, (r+1)/N), the formula in units of Psi on the right."""
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    precision = precision or Precision.fp32_adam()
    widths = [precision.param, precision.grad, precision.optimizer]
    total = sum(widths)
    fig = NotebookFigure(figsize=(8.5, 1.0 + 4 * (0.32 * dp + 0.55)), layout="constrained")
    axes = fig.subplots(4, 1, sharex=True)
    for stage, ax in enumerate(axes):
        # Stage 1 shards the optimizer state, 2 the gradients too, 3 the parameters too.
        sharded = [stage >= 3, stage >= 2, stage >= 1]
        for rank in range(dp):
            x0 = 0.0
            for (_, _, colour), width, is_sharded in zip(KINDS, widths, sharded):
                if is_sharded:
                    ax.add_patch(Rectangle((x0, rank + 0.1), width, 0.8,
                                           facecolor=lighten(to_rgb(colour), 0.8),
                                           edgecolor="white", lw=0.5))
                    ax.add_patch(Rectangle((x0 + width * rank / dp, rank + 0.1), width / dp, 0.8,
                                           facecolor=colour, edgecolor="black", lw=0.5))
                else:
                    ax.add_patch(Rectangle((x0, rank + 0.1), width, 0.8, facecolor=colour,
                                           edgecolor="black", lw=0.5))
                x0 += width
        held = [w / dp if s else w for w, s in zip(widths, sharded)]
        terms = " + ".join(f"{w}/{dp}" if s and dp > 1 else f"{w}" for w, s in zip(widths, sharded))
        ax.text(total * 1.02, dp / 2, f"{terms}\n= {sum(held):.3g} Ψ bytes", va="center", fontsize=9)
        ax.set_xlim(0, total * 1.3)
        ax.set_ylim(dp, 0)
        ax.set_yticks([r + 0.5 for r in range(dp)], [f"rank {r}" for r in range(dp)], fontsize=8)
        ax.tick_params(left=False)
        for spine in ("top", "right", "left"):
            ax.spines[spine].set_visible(False)
        ax.set_title(STAGE_NAMES[stage], fontsize=10, loc="left")
    axes[-1].set_xticks(range(0, total + 1, 2))
    axes[-1].set_xlabel("bytes per parameter")
    pale = Patch(facecolor="0.85", label="held by another rank")
    fig.legend(handles=_kind_legend([pale]), loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(f"What each of N = {dp} data-parallel ranks holds (bytes per parameter, "
                 f"{precision.param} + {precision.grad} + {precision.optimizer})", fontsize=11)
    return fig


# ---------------------------------------------------------------- measured vs formula
def _stack(ax, x, width, mem: MemoryBytes, hatch: str = "") -> None:
    bottom = 0
    for attr, _, colour in KINDS:
        value = getattr(mem, attr)
        ax.bar(x, value, width, bottom=bottom, color=colour, hatch=hatch,
               edgecolor="black" if hatch else colour, lw=0.5)
        bottom += value


def plot_memory_per_rank(measured: Mapping[str, Mapping[str, MemoryBytes]],
                         formula: Optional[Mapping[str, Mapping[str, MemoryBytes]]] = None,
                         title: str = "model-state bytes per rank") -> NotebookFigure:
    """Stacked bars of bytes per rank: one panel per outer key, one bar per inner key.

    ``measured = {"dp = 2": {"DDP": MemoryBytes, "ZeRO-1": ...}, "dp = 4": {...}}``. With
    `formula` (same keys) each bar gets the formula's beside it (hatched), labelled equal or not.
    """
    if not measured:
        raise ValueError("measured is empty: give {panel: {bar label: MemoryBytes}}")
    if formula is not None:
        for panel, bars in measured.items():
            if panel not in formula or set(formula[panel]) != set(bars):
                raise ValueError(f"formula must have the same panels and bars as measured; panel "
                                 f"{panel!r} has bars {sorted(bars)} measured and "
                                 f"{sorted(formula.get(panel, {}))} in the formula")
    n_bars = max(len(bars) for bars in measured.values())
    fig = NotebookFigure(figsize=(max(6.0, len(measured) * (1.2 * n_bars + 1.0)), 4.4), layout="constrained")
    axes = fig.subplots(1, len(measured), sharey=True, squeeze=False)[0]
    top = max(m.model_states for bars in measured.values() for m in bars.values())
    for ax, (panel, bars) in zip(axes, measured.items()):
        width = 0.38 if formula is not None else 0.6
        for i, (label, mem) in enumerate(bars.items()):
            if formula is None:
                _stack(ax, i, width, mem)
                ax.text(i, mem.model_states, fmt_bytes(mem.model_states), ha="center", va="bottom",
                        fontsize=8)
                continue
            want = formula[panel][label]
            _stack(ax, i - 0.2, width, mem)
            _stack(ax, i + 0.2, width, want, hatch="//")
            same = (mem.params, mem.grads, mem.optimizer_state) == \
                (want.params, want.grads, want.optimizer_state)
            verdict = "= formula" if same else f"formula {fmt_bytes(want.model_states)}"
            ax.text(i, max(mem.model_states, want.model_states),
                    f"{fmt_bytes(mem.model_states)}\n{verdict}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(bars)), list(bars), fontsize=9)
        ax.set_title(panel, fontsize=10)
        ax.set_ylim(0, top * 1.25)
        _byte_axis(ax)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("bytes per rank")
    extra = [Patch(facecolor="white", edgecolor="black", hatch="//", label="formula")] if formula else []
    if formula is not None:
        extra.insert(0, Patch(facecolor="0.6", label="measured"))
    fig.legend(handles=_kind_legend(extra), loc="outside lower center", ncol=5, fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


# ---------------------------------------------------------------- the calculator's figure
def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def plot_memory_calculator(num_params: int, dp: int, stage: int, precision: Optional[Precision] = None,
                           device_bytes: Optional[float] = None, precision_label: str = "") -> NotebookFigure:
    """Bytes per rank from `reference.memory.model_state_bytes`: left the three kinds at `stage`,
    right every stage's total, against one device's `device_bytes` when given."""
    _check_stage(stage)
    precision = precision or Precision.fp32_adam()
    rows = {s: model_state_bytes(int(num_params), dp, s, precision) for s in STAGE_NAMES}
    chosen = rows[stage]
    fig = NotebookFigure(figsize=(9.5, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[1, 1.3]))
    for i, (attr, label, colour) in enumerate(KINDS):
        value = getattr(chosen, attr)
        left.bar(i, value, 0.6, color=colour)
        left.text(i, value, fmt_bytes(value), ha="center", va="bottom", fontsize=9)
    left.set_xticks(range(3), [label for _, label, _ in KINDS], fontsize=9)
    left.set_ylim(0, max(chosen.params, chosen.grads, chosen.optimizer_state, 1) * 1.2)
    left.set_ylabel("bytes per rank")
    left.set_title(f"{STAGE_NAMES[stage]}: {fmt_bytes(chosen.model_states)} per rank", fontsize=10)
    for s, mem in rows.items():
        bottom = 0
        for attr, _, colour in KINDS:
            value = getattr(mem, attr)
            right.bar(s, value, 0.6, bottom=bottom, color=colour, alpha=1.0 if s == stage else 0.45,
                      edgecolor="black" if s == stage else "none", lw=1.5)
            bottom += value
        right.text(s, mem.model_states, fmt_bytes(mem.model_states), ha="center", va="bottom", fontsize=8)
    top = rows[0].model_states
    if device_bytes:
        right.axhline(device_bytes, color="crimson", ls="--", lw=1.2,
                      label=f"one device: {fmt_bytes(device_bytes)}")
        right.legend(loc="upper right", fontsize=8)
        top = max(top, device_bytes)
    right.set_ylim(0, top * 1.2)
    right.set_xticks(range(4), [_SHORT_STAGE[s] for s in STAGE_NAMES], fontsize=9)
    right.set_title(f"every stage at dp = {dp}", fontsize=10)
    for ax in (left, right):
        ax.grid(True, axis="y", alpha=0.3)
        _byte_axis(ax)
    label = precision_label or f"{precision.param}+{precision.grad}+{precision.optimizer} bytes/param"
    fig.suptitle(f"{_count(num_params)} parameters, {label}, dp = {dp}", fontsize=11)
    return fig


# ---------------------------------------------------------------- FSDP residency
def plot_unit_residency(steps: Sequence[tuple[str, Sequence[bool]]], unit_names: Sequence[str]) -> NotebookFigure:
    """Which FSDP units hold their full parameters after each event of a step: `steps` is a list
    of ``(event label, whole)``, one bool per unit of `unit_names`."""
    if not steps:
        raise ValueError("steps is empty: give a list of (event label, whole per unit)")
    for i, (label, whole) in enumerate(steps):
        if len(whole) != len(unit_names):
            raise ValueError(f"steps[{i}] ({label!r}) has {len(whole)} flags for "
                             f"{len(unit_names)} units {list(unit_names)}")
    n, k = len(steps), len(unit_names)
    fig = NotebookFigure(figsize=(min(16.0, 1.5 + 0.42 * n), 0.45 * k + 2.6), layout="constrained")
    ax = fig.add_subplot()
    for col, (_, whole) in enumerate(steps):
        for row, flag in enumerate(whole):
            ax.add_patch(Rectangle((col + 0.05, row + 0.08), 0.9, 0.84, lw=0,
                                   facecolor="tab:blue" if flag else "0.92"))
    ax.set_xlim(0, n)
    ax.set_ylim(k, 0)
    ax.set_xticks([c + 0.5 for c in range(n)], [label for label, _ in steps], rotation=70,
                  ha="right", fontsize=8)
    ax.set_yticks([r + 0.5 for r in range(k)], list(unit_names), fontsize=9)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    peak = max(sum(whole) for _, whole in steps)
    ax.set_title(f"FSDP units holding their full parameters (blue) after each event; "
                 f"at most {peak} of {k} at once", fontsize=10)
    return fig
