"""PyTorch's zero-bubble schedules beside the course's: same stages, same gloo ranks.

`bench/zero_bubble_vs_pytorch.py` runs both sides (its docstring says how); here on 2
ranks, m = 4, the rows whose two sides run one schedule: PyTorch's ``ScheduleZBVZeroBubble``
beside ``zb-v``, ``ScheduleDualPipeV`` beside ``dualpipev`` and
``ScheduleInterleavedZeroBubble`` with one stage per rank beside ``zb-h1``. Each side runs
one step without costs (its gradients), and, for ZB-V and DualPipeV, two steps with them.

* The order: PyTorch's compute actions (its ``pipeline_order``, DualPipeV's pairs
  unpacked) are the course's, rank by rank, so the two timelines can be compared at all.
* Gradients: PyTorch's equal the course's and one process's within
  `reference.tolerance.gradient(m + 1)`: each run adds the m micro-batches' gradients (and
  the tied embedding's second use) in its own order, which section 1 of
  `reference.tolerance` bounds; every parameter is covered.
* Idle shares under injected costs (each action sleeps its cost, F = I = W): each rank's,
  measured from each side's timeline, is the course's simulated one within
  `idle_margin`: twice the mean lateness of an action in that step (how late the OS wakes
  a sleeping process, plus the tiny model's compute and the runtime's own code) over the
  smallest cost, a ratio measured in the same run. Of the two steps, each side's less late
  one is taken: the machine's other work can hold a rank up for tens of milliseconds now
  and then. The margin must leave 1F1B's bubble on the same pipeline outside, or the
  comparison could not tell the schedules apart (PyTorch's DualPipeV, which sends later by
  design, is held between the simulated bubble and 1F1B's: `LATER_SENDS`): where it does not (a machine busy with other
  work, as beside another test worker), the test skips and says so rather than compare.

A PyTorch schedule other than ZB-V that raises on every rank is skipped with its error.
"""
import functools
import importlib.util
import pathlib

import pytest
import torch

from reference.pipeline_parallel import build_schedule
from reference.pipeline_parallel.costs import idle_margin, lateness
from reference.runtime import launch
from reference.tolerance import gradient

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("zero_bubble_vs_pytorch", ROOT / "bench" / "zero_bubble_vs_pytorch.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

PP, M, TAU = 2, 4, 0.16  # a whole stage's F = I = W = 160 ms: a chunk's 80 ms under the V
ROWS = {kind: (name, v, kind) for name, v, kind in bench.ROWS if kind in ("zb-h1", "zb-v", "dualpipev")}
TIMED = {"zb-v": 2, "dualpipev": 2}  # steps with the costs, per side
# PyTorch's DualPipeV sends both results of a paired forward and backward after both have run
# (its `pipeline_order_with_comms`), so a forward's output leaves one action later than the
# simulation (and the course) sends it: its idle share sits above the simulated one by that
# structure (about 4 points here), not by noise. It is held between the simulated bubble and
# 1F1B's instead.
LATER_SENDS = {("dualpipev", "torch")}


@functools.lru_cache(maxsize=None)
def _run():
    return launch(bench.rank_body, PP, list(ROWS.values()), PP, M, TAU, TIMED, 0, timeout=180, quiet=True)


def _results(kind):
    """Every rank's result for the row; skipped (not ZB-V) with PyTorch's own error."""
    row = ROWS[kind]
    got = [r[row] for r in _run()]
    errors = [g for g in got if isinstance(g, str)]
    if errors:
        message = f"PyTorch's {row[0]} does not run on gloo CPU in torch {torch.__version__}: {errors[0]}"
        if kind == "zb-v" or len(errors) < len(got):  # ZB-V must run; an error on some ranks only is a bug
            pytest.fail(message)
        pytest.skip(message)
    return got


@pytest.mark.parametrize("kind", list(ROWS))
def test_pytorch_runs_the_course_order(kind):
    for rank, got in enumerate(_results(kind)):
        assert got["orders"]["torch"] == got["orders"]["ours"], (kind, rank)
        assert got["orders"]["ours"], (kind, rank)


@pytest.mark.parametrize("kind", list(ROWS))
def test_gradients_equal_ours_and_one_process(kind):
    got = _results(kind)
    ref = bench.one_process_grads(PP, M)
    tol = gradient(M + 1)
    covered = {"ours": set(), "torch": set()}
    for rank, g in enumerate(got):
        ours, theirs = g["grads"]["ours"], g["grads"]["torch"]
        assert set(ours) == set(theirs), (kind, rank)
        for name in ours:
            where = f"{kind} rank {rank} {name}"
            tol.assert_close(theirs[name], ours[name], f"{where}: PyTorch's against ours")
            tol.assert_close(theirs[name], ref[name], f"{where}: PyTorch's against one process")
            tol.assert_close(ours[name], ref[name], f"{where}: ours against one process")
        covered["ours"] |= set(ours)
        covered["torch"] |= set(theirs)
    assert covered["ours"] == covered["torch"] == set(ref), kind


@pytest.mark.parametrize("kind", list(TIMED))
def test_idle_shares_agree_with_the_simulated_bubble(kind):
    got = _results(kind)
    _, v, _ = ROWS[kind]
    cost = bench.costs(TAU, v)
    want = bench.simulated(kind, PP, M, v, TAU)
    f1b = build_schedule("1f1b", PP, M).bubble_fraction()  # F = I = W: B = 2 F
    for side in ("ours", "torch"):
        steps = [[g["timelines"][side][s] for g in got] for s in range(TIMED[kind])]
        assert all(rank for timeline in steps for rank in timeline), (kind, side)
        timeline = min(steps, key=lambda tl: lateness(tl, cost))
        margin = idle_margin(lateness(timeline, cost), cost)
        if margin >= f1b - max(want):  # the machine's other work made the timeline meaningless
            pytest.skip(f"{kind} {side}: a margin of {margin:.1%} (mean lateness of an action over its "
                        f"{min(cost.values()) * 1e3:g} ms: the machine is busy) cannot tell the simulated "
                        f"idle {want} from 1F1B's {f1b:.1%}; run it alone to measure")
        measured = bench.idle_by_rank(timeline)
        for rank, (m_r, w_r) in enumerate(zip(measured, want)):
            if (kind, side) in LATER_SENDS:  # above the simulated bubble, never below; under 1F1B's
                assert w_r - margin <= m_r < f1b, (
                    f"{kind} {side} rank {rank}: idle {m_r:.1%}, simulated {w_r:.1%}, 1F1B {f1b:.1%}")
                continue
            assert abs(m_r - w_r) <= margin, (
                f"{kind} {side} rank {rank}: idle {m_r:.1%}, simulated {w_r:.1%}, margin {margin:.1%}")
