"""Schedules as data: their action lists, the checker, the ideal timeline, the bubble,
the activations held, and the picture. No process is started."""
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from reference.pipeline_parallel import (KINDS, Action, Schedule, ScheduleError, bubble_formula,
                                         build_schedule, plot_bubble_curve, simulate)

A = Action


def _args():
    """(kind, pp, m, virtual) over small pipelines, every schedule and interleaving depth."""
    for pp in range(1, 6):
        for m in range(1, 10):
            for kind in ("naive", "gpipe", "1f1b"):
                yield kind, pp, m, 1
            if pp >= 2 and (m < pp or m % pp == 0):
                for v in (2, 3):
                    yield "interleaved", pp, m, v


def test_actions_are_the_expected_lists():
    gpipe, f1b = build_schedule("gpipe", 2, 3), build_schedule("1f1b", 2, 3)
    assert gpipe.actions(0) == [
        A("F", 0), A("SEND_F", 0, 0, 1), A("F", 1), A("SEND_F", 1, 0, 1), A("F", 2),
        A("SEND_F", 2, 0, 1), A("RECV_B", 0, 0, 1), A("B", 0), A("RECV_B", 1, 0, 1), A("B", 1),
        A("RECV_B", 2, 0, 1), A("B", 2)]
    # 1F1B: one warm-up forward on rank 0, then a backward after every forward
    assert [str(a) for a in f1b.actions(0)] == [
        "F0", "SEND_F0->1", "F1", "SEND_F1->1", "RECV_B0<-1", "B0", "F2", "SEND_F2->1",
        "RECV_B1<-1", "B1", "RECV_B2<-1", "B2"]
    assert [str(a) for a in f1b.actions(1)] == [
        "RECV_F0<-0", "F0", "B0", "SEND_B0->0", "RECV_F1<-0", "F1", "B1", "SEND_B1->0",
        "RECV_F2<-0", "F2", "B2", "SEND_B2->0"]
    # consecutive messages form one step: sent and received together
    assert [[str(a) for a in s] for s in f1b.steps(1)][3] == ["SEND_B0->0", "RECV_F1<-0"]
    assert [[str(a) for a in s] for s in f1b.steps(0)][3] == ["SEND_F1->1", "RECV_B0<-1"]
    naive = build_schedule("naive", 2, 2)
    assert [str(a) for a in naive.actions(0)] == [
        "F0", "SEND_F0->1", "RECV_B0<-1", "B0", "F1", "SEND_F1->1", "RECV_B1<-1", "B1"]
    # interleaved: chunk 1 of rank 0 is stage 2, fed by rank 1 (stage 1)
    inter = build_schedule("interleaved", 2, 2, virtual=2)
    assert inter.stage(0, 1) == 2 and A("RECV_F", 0, 1, 1) in inter.actions(0)
    assert A("SEND_F", 0, 0, 0) in inter.actions(1)


@pytest.mark.parametrize("kind, pp, m, virtual", list(_args()))
def test_every_schedule_is_complete_and_matches_the_formula(kind, pp, m, virtual):
    s = build_schedule(kind, pp, m, virtual)  # validated on the way out
    last = pp * virtual - 1
    for r in range(pp):
        acts = s.actions(r)
        for op in ("F", "B"):
            assert sorted((a.mb, a.chunk) for a in acts if a.op == op) == \
                [(i, c) for i in range(m) for c in range(virtual)]
        stages = [s.stage(r, c) for c in range(virtual)]
        assert sum(a.op == "SEND_F" for a in acts) == m * sum(st < last for st in stages)
        assert sum(a.op == "SEND_B" for a in acts) == m * sum(st > 0 for st in stages)
    assert s.bubble_fraction() == pytest.approx(bubble_formula(kind, pp, m, virtual), abs=1e-12)
    # the bubble does not depend on how much slower backward is than forward
    assert s.bubble_fraction(t_f=1.0, t_b=1.0) == pytest.approx(s.bubble_fraction(), abs=1e-12)


@pytest.mark.parametrize("pp, m", [(1, 1), (2, 1), (2, 8), (4, 3), (4, 8), (5, 16)])
def test_peak_in_flight(pp, m):
    for r in range(pp):
        assert build_schedule("naive", pp, m).peak_in_flight(r) == 1
        assert build_schedule("gpipe", pp, m).peak_in_flight(r) == m
        assert build_schedule("1f1b", pp, m).peak_in_flight(r) == min(m, pp - r)
        if pp >= 2 and (m < pp or m % pp == 0):
            g = min(m, pp)  # micro-batches per round
            # warm-up forwards over both chunks, plus the one in steady state
            expect = min(g + 2 * (pp - 1 - r) + 1, 2 * m)
            assert build_schedule("interleaved", pp, m, 2).peak_in_flight(r) == expect


def test_bubble_formula_values():
    assert bubble_formula("naive", 4, 8) == pytest.approx(3 / 4)
    assert bubble_formula("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_formula("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_formula("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    # fewer micro-batches than ranks: interleaving cannot fill the pipeline
    assert bubble_formula("interleaved", 4, 1, 2) == pytest.approx(bubble_formula("naive", 4, 1))


def test_ideal_timeline_of_gpipe():
    tl = simulate(build_schedule("gpipe", 2, 2), t_f=1.0, t_b=2.0)
    compute = [[(str(e.action), e.start, e.end) for e in row if e.action.op in "FB"] for row in tl]
    assert compute == [
        [("F0", 0, 1), ("F1", 1, 2), ("B0", 5, 7), ("B1", 7, 9)],
        [("F0", 1, 2), ("F1", 2, 3), ("B0", 3, 5), ("B1", 5, 7)]]


def test_deadlock_is_rejected_naming_rank_and_action():
    # Rank 0 waits for the gradient of micro-batch 0 before it has sent micro-batch
    # 0 forward; rank 1 waits for that activation: neither can move.
    rank0 = [A("F", 0), A("RECV_B", 0, 0, 1), A("F", 1), A("SEND_F", 0, 0, 1),
             A("SEND_F", 1, 0, 1), A("B", 0), A("RECV_B", 1, 0, 1), A("B", 1)]
    rank1 = [A("RECV_F", 0, 0, 0), A("F", 0), A("B", 0), A("SEND_B", 0, 0, 0),
             A("RECV_F", 1, 0, 0), A("F", 1), A("B", 1), A("SEND_B", 1, 0, 0)]
    with pytest.raises(ScheduleError) as err:
        Schedule(2, 2, {0: rank0, 1: rank1}).validate()
    msg = str(err.value)
    assert "deadlock" in msg
    assert "rank 0 action #1 RECV_B0<-1 waits for rank 1" in msg
    assert "rank 1 action #0 RECV_F0<-0 waits for rank 0" in msg
    # the same actions with the send moved before the receive run fine
    fixed = [rank0[0], rank0[3], rank0[2], rank0[4], rank0[1], *rank0[5:]]
    Schedule(2, 2, {0: fixed, 1: rank1}).validate()


def _gpipe_lists():
    s = build_schedule("gpipe", 2, 2)
    return s.actions(0), s.actions(1)


@pytest.mark.parametrize("edit, message", [
    (lambda r0, r1: (r0[:-1], r1), "rank 0 never runs B1"),
    (lambda r0, r1: (r0 + [A("F", 0)], r1), "repeats action #0"),
    (lambda r0, r1: ([A("SEND_F", 0, 0, 1)] + r0[:1] + r0[2:], r1), "comes before"),
    (lambda r0, r1: ([A("F", 0), A("SEND_F", 0, 0, 0)] + r0[2:], r1), "lives on rank 1, not on rank 0"),
    (lambda r0, r1: (r0, [r1[2], r1[3], r1[0], r1[1]] + r1[4:]), "arrive in the order they are sent"),
    (lambda r0, r1: (r0 + [A("X", 0)], r1), "unknown op"),
    (lambda r0, r1: (r0, r1 + [A("F", 5)]), "out of range"),
    (lambda r0, r1: ([A("RECV_F", 0, 0, 1)] + r0, r1), "has no stage -1"),
])
def test_broken_schedules_are_rejected(edit, message):
    r0, r1 = edit(*_gpipe_lists())
    with pytest.raises(ScheduleError, match=message):
        Schedule(2, 2, {0: r0, 1: r1}).validate()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule kind 'zb'"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match="virtual must be 1"):
        build_schedule("1f1b", 2, 4, virtual=2)
    with pytest.raises(ValueError, match="multiple of pp=4"):
        build_schedule("interleaved", 4, 6, virtual=2)
    with pytest.raises(ValueError, match="pp >= 2"):
        build_schedule("interleaved", 1, 4, virtual=2)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        build_schedule("gpipe", 0, 4)
    with pytest.raises(ScheduleError, match="no action list for ranks \\[1\\]"):
        Schedule(2, 1, {0: []})


def test_plot_draws_one_box_per_forward_and_backward():
    for kind, pp, m, v in [("gpipe", 4, 4, 1), ("interleaved", 2, 4, 2)]:
        fig = build_schedule(kind, pp, m, v).plot()
        assert isinstance(fig, Figure)
        ax = fig.axes[0]
        boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(boxes) == 2 * pp * m * v
        labels = {t.get_text() for t in ax.texts}
        assert {f"F{i}" for i in range(m)} | {f"B{i}" for i in range(m)} <= labels
        assert kind in ax.get_title() and "bubble" in ax.get_title()
        assert fig._repr_png_()[:4] == b"\x89PNG"
    fig = plot_bubble_curve([1, 2, 4, 8], {"gpipe": [0.5, 0.34, 0.21, 0.12]}, pp=2)
    assert len(fig.axes[0].lines) == 2


def test_every_kind_is_buildable():
    assert set(KINDS) == {"naive", "gpipe", "1f1b", "interleaved"}
    for kind in KINDS:
        s = build_schedule(kind, 2, 2, 2 if kind == "interleaved" else 1)
        assert repr(s).startswith(f"Schedule({kind}")
