"""Consecutive steps of a pipeline: separated by a global check, or overlapping (post-validation).

One step of a schedule, measured alone, ends when its slowest rank ends: every rank waits there
for the step's global checks (the gradient norm that clipping needs, fp16's overflow test), whose
all-reduce spans every stage. Qi et al. (2024, section 4, "optimizer post-validation") drop that
wait: each rank steps its optimizer as soon as its own last W is done and starts the next step's
forwards at once; the checks complete later, and a step that fails them is rolled back
(`reference.parallel.post_validation` does it in the real step). Then a rank's idle time is only
what lies between its own first and last action of a step, and steps tile: a parallelogram
(ZB-H2, ZB-V) fits into the next with no gap at all.

This module measures both with the checker's ideal timeline (`Schedule.simulate`): a step that
overlaps is the schedule repeated on every rank, the next step's micro-batches numbered after
this one's (`repeat`), so a rank's next F waits only for its own last action and for its input;
steps separated by a barrier are the step alone, back to back. The idle per rank and step is the
steady state's period minus a rank's busy time (`idle_per_step`; the optimizer's own time is
left out, as in the paper's formulas).

The paper's closed forms (its table 2, B being the input-gradient pass, the course's I; the idle
per rank and step, against which `paper_bubble` is tested):

    1F1B    (p - 1)(F + B + W)      ZB-H1   (p - 1)(F + B - W)      ZB-H2   (p - 1)(F + B - 2W)

and DualPipe's README (`dualpipe_readme_bubble`, B there being the whole backward, I + W, of a
chunk; F&B a forward and a backward run as one overlapped pair; PP the number of stages):

    1F1B  (PP - 1)(F + B)    ZB1P  (PP - 1)(F + B - 2W)    DualPipe, DualPipeV  (PP/2 - 1)(F&B + B - 3W)

DualPipeV's PP is its number of chunks, twice its ranks. Its row is the most idle rank's idle
when a pair F&B is one action that starts once both the forward's input and the backward's
gradient are there, as DeepSeek overlaps it (tests/test_pipeline_multistep.py reproduces it).
The course runs a pair's F and B one after the other, so the F need not wait for the other's
gradient: at F = I = W and F&B = F + B it idles half the row, (PP/2 - 1) I instead of
(PP/2 - 1) 2I per chunk.
"""
from __future__ import annotations

from reference.pipeline_parallel.actions import Action
from reference.pipeline_parallel.schedules import Schedule

__all__ = ["repeat", "idle_per_step", "idle_share", "paper_bubble", "dualpipe_readme_bubble"]


def repeat(schedule: Schedule, steps: int) -> Schedule:
    """``steps`` consecutive steps of ``schedule`` with nothing between them (post-validation):
    every rank's list repeated, step k's micro-batch i numbered k m + i; validated."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    m = schedule.m
    actions = {r: [Action(a.op, a.mb + k * m, a.chunk, a.peer)
                   for k in range(steps) for a in schedule.actions(r)] for r in range(schedule.pp)}
    return type(schedule)(schedule.pp, m * steps, actions, schedule.virtual,
                          f"{schedule.kind} x{steps}").validate()


def _makespan(schedule: Schedule, times: tuple) -> float:
    events = [e for rank in schedule.simulate(*times) for e in rank]
    return max(e.end for e in events) - min(e.start for e in events)


def idle_per_step(schedule: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_w: float = None,
                  overlap: bool = True, steps: int = 4) -> float:
    """Idle time of each rank per step in the steady state, F = ``t_f``, B = ``t_b`` (I + W),
    W = ``t_w`` (t_b / 2 unless given), per whole stage. ``overlap``: steps overlap
    (post-validation), the period read between the last two of ``steps`` repeated steps; else a
    global check between steps, the period one step's makespan. Every rank computes
    m (F + B) per step, so idle = period - m (F + B)."""
    times = (t_f, t_b, t_w)
    if overlap:
        period = _makespan(repeat(schedule, steps), times) - _makespan(repeat(schedule, steps - 1), times)
    else:
        period = _makespan(schedule, times)
    busy = schedule.m * (t_f + t_b)
    return period - busy


def idle_share(schedule: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_w: float = None,
               overlap: bool = True, steps: int = 4) -> float:
    """The steady state's idle share: idle / (idle + busy) per rank and step (`idle_per_step`)."""
    idle = idle_per_step(schedule, t_f, t_b, t_w, overlap, steps)
    return idle / (idle + schedule.m * (t_f + t_b))


def paper_bubble(kind: str, pp: int, t_f: float, t_i: float, t_w: float) -> float:
    """Qi et al.'s bubble per rank and step (their table 2) for ``kind`` "1f1b", "zb-h1" or
    "zb-h2"; ``t_i`` is the paper's B (the input-gradient pass)."""
    extra = {"1f1b": t_w, "zb-h1": -t_w, "zb-h2": -2 * t_w}
    if kind not in extra:
        raise ValueError(f"the paper's table gives 1f1b, zb-h1 and zb-h2, not {kind!r}")
    return (pp - 1) * (t_f + t_i + extra[kind])


def dualpipe_readme_bubble(kind: str, stages: int, t_f: float, t_b: float, t_w: float,
                           t_fb: float) -> float:
    """DualPipe's README bubble for ``kind`` "1f1b", "zb1p", "dualpipe" or "dualpipev" over
    ``stages`` pipeline stages, per chunk: F ``t_f``, whole backward B ``t_b``, W ``t_w``, an
    overlapped forward-and-backward pair ``t_fb``."""
    if kind == "1f1b":
        return (stages - 1) * (t_f + t_b)
    if kind == "zb1p":
        return (stages - 1) * (t_f + t_b - 2 * t_w)
    if kind in ("dualpipe", "dualpipev"):
        return (stages / 2 - 1) * (t_fb + t_b - 3 * t_w)
    raise ValueError(f"DualPipe's README gives 1f1b, zb1p, dualpipe and dualpipev, not {kind!r}")

