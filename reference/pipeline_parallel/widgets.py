"""The pipeline schedule explorer: pp, m, schedule and virtual stages -> timeline and bubble.

Every change of a control rebuilds the schedule (validated), simulates its ideal timeline (F 1, B 2,
messages free) and draws it. The picture travels as PNG bytes in an ``Image`` widget, so it draws
with no frontend at all (a test, a notebook executed headless):

    explorer = schedule_explorer(kind="1f1b", pp=4, m=8)
    explorer                           # the live widget in JupyterLab
    explorer.kind.value = "interleaved"
    explorer.figure, explorer.bubble   # redrawn for the new settings
"""
from __future__ import annotations

from typing import Optional

import ipywidgets as widgets

from reference.pipeline_parallel.registry import build_schedule
from reference.pipeline_parallel.schedules import KINDS, Schedule, bubble_formula
from reference.pipeline_parallel.zero_bubble import ZB_KINDS, zero_bubble_formula

__all__ = ["ScheduleExplorer", "schedule_explorer", "MAX_PP", "MAX_M", "MAX_VIRTUAL"]

# Beyond these the boxes of a timeline are too thin to read.
MAX_PP, MAX_M, MAX_VIRTUAL = 8, 16, 4


def _formula_text(kind: str, pp: int, m: int) -> str:
    """The textbook bubble of a schedule as text (zero-bubble ones: `zero_bubble_formula` at F = I = W)."""
    if kind in ZB_KINDS:
        return "(p-1)/(3m+p-1)" if kind in ("zb-h1", "zb-h2") else "(p-1)/(6m+p-1)"
    if kind == "naive":
        return "(p-1)/p"
    if kind != "interleaved":
        return "(p-1)/(m+p-1)"
    # with fewer micro-batches than ranks, rank 0 idles before each next chunk
    return "(p-1)/(vm+p-1)" if m >= pp else "1 - vm/(vp+m-1)"


def _check(name: str, value, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an int from {low} to {high}, got {value!r}")


class ScheduleExplorer(widgets.VBox):
    """Controls `kind`, `pp`, `m` and `virtual` (interleaved only); the timeline, the bubble against
    its formula, the micro-batches each rank holds at its peak and the messages sent. A combination
    that cannot run is no exception: the summary says why, ``.schedule`` and ``.figure`` are None."""

    def __init__(self, kind: str = "1f1b", pp: int = 4, m: int = 8, virtual: int = 2):
        if kind not in KINDS + ZB_KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS + ZB_KINDS)}, got {kind!r}")
        _check("pp", pp, 1, MAX_PP)
        _check("m", m, 1, MAX_M)
        _check("virtual", virtual, 2, MAX_VIRTUAL)  # only the interleaved schedule reads it
        style = dict(description_width="150px")
        self.kind = widgets.ToggleButtons(options=list(KINDS + ZB_KINDS), value=kind, description="schedule",
                                          style=style)
        self.pp = widgets.IntSlider(value=pp, min=1, max=MAX_PP, description="pipeline ranks pp",
                                    continuous_update=False, style=style)
        self.m = widgets.IntSlider(value=m, min=1, max=MAX_M, description="micro-batches m",
                                   continuous_update=False, style=style)
        self.virtual = widgets.IntSlider(value=virtual, min=2, max=MAX_VIRTUAL,
                                         description="chunks per rank v", continuous_update=False,
                                         style=style)
        self.summary = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.schedule: Optional[Schedule] = None
        self.figure = None
        self.bubble: Optional[float] = None
        self.error: Optional[str] = None
        super().__init__([self.kind, self.pp, self.m, self.virtual, self.summary, self.image])
        for control in (self.kind, self.pp, self.m, self.virtual):
            control.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, change) -> None:
        self.update()

    @property
    def settings(self) -> tuple[str, int, int, int]:
        """(kind, pp, m, virtual) as `build_schedule` takes them: virtual = 1 unless interleaved
        (the slider's), or 2 for the V of zb-v and dualpipev."""
        kind = self.kind.value
        v = {"interleaved": self.virtual.value, "zb-v": 2, "dualpipev": 2}.get(kind, 1)
        return kind, self.pp.value, self.m.value, v

    def update(self):
        """Rebuild the schedule for the controls' current values, redraw, return the figure
        (None when the combination cannot run; ``.error`` then says why)."""
        kind, pp, m, v = self.settings
        self.virtual.disabled = kind != "interleaved"  # the other schedules have one chunk per rank
        try:
            schedule = build_schedule(kind, pp, m, v)
        except ValueError as err:  # bad combination: say so, draw nothing
            self.schedule = self.figure = self.bubble = None
            self.error = str(err)
            self.summary.value = f"<span style='color:#b00'>cannot build this schedule: {err}</span>"
            self.image.value = b""
            return None
        self.schedule, self.error = schedule, None
        self.bubble = schedule.bubble_fraction()
        text = _formula_text(kind, pp, m)
        try:  # the zero-bubble ones with F = I = W (the timeline's t_b = 2 t_f, W half of B)
            formula = zero_bubble_formula(kind, pp, m) if kind in ZB_KINDS else bubble_formula(kind, pp, m, v)
        except ValueError:  # outside the closed form's range: the timeline is the measure
            formula, text = self.bubble, "none in closed form here: the timeline's"
        held = ", ".join(str(schedule.peak_in_flight(r)) for r in range(pp))
        messages = sum(a.is_comm for r in range(pp) for a in schedule.actions(r)) // 2
        self.summary.value = (
            f"<b>{kind}</b>, pp = {pp}, m = {m}" + (f", v = {v}" if v > 1 else "")
            + f": bubble <b>{self.bubble:.1%}</b> of the time "
            f"(formula {text} = {formula:.1%}); "
            f"micro-batches held at the peak, rank 0 to {pp - 1}: {held}; "
            f"{messages} point-to-point messages")
        self.figure = schedule.plot()
        self.image.value = self.figure._repr_png_()  # a viz._Figure draws its own PNG
        return self.figure

    def __repr__(self) -> str:
        # The default repr lists every child, image bytes included.
        kind, pp, m, v = self.settings
        return f"ScheduleExplorer(kind={kind!r}, pp={pp}, m={m}, virtual={v})"


def schedule_explorer(kind: str = "1f1b", pp: int = 4, m: int = 8, virtual: int = 2) -> ScheduleExplorer:
    """The schedule explorer widget, drawn for its starting values."""
    return ScheduleExplorer(kind, pp, m, virtual)
