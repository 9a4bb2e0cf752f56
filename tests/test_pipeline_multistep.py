"""Consecutive steps of a pipeline, and the sources' bubble formulas reproduced by the simulator.

* ZB-H2 (Qi et al., 2024, "handcrafted 2"): complete and free of deadlock (the checker, through
  `build_schedule`); with F = I = W and m >= 2p - 1 no rank idles between its own first and last
  action (a parallelogram) and every rank holds at most 2p - 1 micro-batches (the paper's
  (2p - 1) M_B).
* Steps that overlap (optimizer post-validation, `reference.pipeline_parallel.multistep`): at
  p = 4, m = 8, F = I = W the idle per rank and step of 1F1B, ZB-H1 and ZB-H2 equals the paper's
  table 2, (p - 1)(F + B + W), (p - 1)(F + B - W), (p - 1)(F + B - 2W) with its B the course's I,
  also at I != W; ZB-V's is 0; with a global check between steps each keeps its one-step bubble.
* DualPipe's README table: its 1F1B and ZB1P rows, (PP - 1)(F + B) and (PP - 1)(F + B - 2W), equal
  the simulator's; its DualPipeV row, (PP/2 - 1)(F&B + B - 3W), equals the most idle rank's idle
  when each overlapped pair F&B is one action that waits for both its inputs, as DeepSeek runs it;
  the course, running a pair's F and B one after the other, idles half that at F&B = F + B.
"""
import pytest

from paired_idle import paired_idle
from reference.pipeline_parallel import build_schedule
from reference.pipeline_parallel.multistep import (dualpipe_readme_bubble, idle_per_step, idle_share,
                                                   paper_bubble, repeat)

V = {"1f1b": 1, "zb-h1": 1, "zb-h2": 1, "zb-v": 2, "dualpipev": 2}
EQUAL = (1.0, 2.0, 1.0)  # F, B = I + W, W per whole stage: F = I = W


def _own_idle(schedule, times):
    """Each rank's idle time between its own first and last compute action."""
    out = []
    for events in schedule.simulate(*times):
        work = [e for e in events if e.action.op in "FBIW"]
        out.append(work[-1].end - work[0].start - sum(e.end - e.start for e in work))
    return out


@pytest.mark.parametrize("pp,m", [(2, 3), (3, 5), (4, 7), (4, 8), (5, 12)])
def test_zb_h2_is_a_parallelogram(pp, m):
    s = build_schedule("zb-h2", pp, m)
    assert s.kind == "zb-h2" and type(s).__name__ == "ZeroBubbleSchedule"
    assert _own_idle(s, EQUAL) == [0.0] * pp
    assert [s.peak_in_flight(r) for r in range(pp)] == [2 * pp - 1] * pp
    # alone, one step still idles its slant, (p - 1) F: ZB-H1's bubble
    assert s.bubble_fraction(*EQUAL) == pytest.approx(build_schedule("zb-h1", pp, m).bubble_fraction(*EQUAL))


def test_zb_h2_with_few_micro_batches_is_still_complete():
    for pp in (1, 2, 3, 4):
        for m in (1, 2, pp, 2 * pp - 2):
            if m >= 1:
                build_schedule("zb-h2", pp, m)  # validated: complete, no deadlock


def test_where_the_idle_sits_per_rank():
    """Idle between a rank's own first and last action, p = 4, m = 8, F = I = W (one unit):
    ZB-H1 3, 2, 1, 0; ZB-V 0 everywhere; DualPipeV 1.5, 1, 0.5, 0 (the notebook's numbers)."""
    own = {k: _own_idle(build_schedule(k, 4, 8, V[k]), EQUAL) for k in ("zb-h1", "zb-v", "dualpipev")}
    assert own == {"zb-h1": [3.0, 2.0, 1.0, 0.0], "zb-v": [0.0] * 4, "dualpipev": [1.5, 1.0, 0.5, 0.0]}


def test_repeat_numbers_the_next_steps_micro_batches_after():
    s = repeat(build_schedule("zb-h1", 2, 2), 3)
    assert (s.m, s.kind) == (6, "zb-h1 x3")
    assert [a.mb for a in s.actions(1) if a.op == "F"] == list(range(6))
    with pytest.raises(ValueError, match="steps must be a positive int"):
        repeat(s, 0)


def test_overlapping_steps_reach_the_papers_bubbles():
    """p = 4, m = 8: the idle per rank and step with steps that overlap equals the paper's table 2
    (its B = the course's I) at F = I = W and at two points with I > W; ZB-V's is 0 at F = I = W."""
    pp, m = 4, 8
    for t_f, t_i, t_w in ((1.0, 1.0, 1.0), (1.0, 1.5, 1.0), (1.0, 1.2, 0.8)):
        for kind in ("1f1b", "zb-h1", "zb-h2"):
            s = build_schedule(kind, pp, m)
            got = idle_per_step(s, t_f, t_i + t_w, t_w)
            assert got == pytest.approx(paper_bubble(kind, pp, t_f, t_i, t_w), abs=1e-9), (kind, t_i, t_w)
    shares = {k: idle_share(build_schedule(k, pp, m, V[k]), *EQUAL) for k in V}
    assert abs(shares["zb-v"]) < 0.01 and shares["zb-h2"] == pytest.approx(0.0, abs=1e-12)
    assert [round(shares[k], 4) for k in ("1f1b", "zb-h1", "dualpipev")] == [0.2727, 0.1111, 0.0588]
    # a global check between steps: each step's own bubble, ZB-H2's and ZB-V's included
    sync = {k: idle_per_step(build_schedule(k, pp, m, V[k]), *EQUAL, overlap=False) for k in V}
    assert sync == {"1f1b": 9.0, "zb-h1": 3.0, "zb-h2": 3.0, "zb-v": 1.5, "dualpipev": 1.5}


def test_dualpipe_readme_table():
    """DualPipe's README, per chunk (F, whole backward B = I + W, W) on PP stages. 1F1B and ZB1P
    (ZB-H1) on PP = p ranks: the simulator's idle per rank equals the row. DualPipeV on PP = 2p
    stages over p ranks: the row, (PP/2 - 1)(F&B + B - 3W), is the idle of the most idle rank when
    each F&B pair is ONE action that waits for both its inputs (DeepSeek's overlapped pair);
    at F = I = W = 1/2 per chunk and F&B = F + B, 3 on every rank. The course runs a pair's F
    and B one after the other, so its F starts before the B's gradient arrives: 1.5, half the
    row's, (p - 1) I per chunk."""
    p, m = 4, 8
    for t_f, t_i, t_w in ((1.0, 1.0, 1.0), (1.0, 1.5, 1.0), (1.0, 1.2, 0.8)):
        t_b = t_i + t_w
        for kind, ours in (("1f1b", "1f1b"), ("zb1p", "zb-h1")):
            s = build_schedule(ours, p, m)
            sim = idle_per_step(s, t_f, t_b, t_w, overlap=False)
            assert sim == pytest.approx(dualpipe_readme_bubble(kind, p, t_f, t_b, t_w, t_f + t_b))
    # DualPipeV: chunk times half a stage's
    sim = idle_per_step(build_schedule("dualpipev", p, m, 2), *EQUAL, overlap=False)
    row = dualpipe_readme_bubble("dualpipev", 2 * p, 0.5, 1.0, 0.5, 0.5 + 1.0)
    assert (sim, row) == (1.5, 3.0)
    for pp, mm in ((2, 4), (3, 8), (4, 8), (4, 12), (6, 12)):
        s = build_schedule("dualpipev", pp, mm, 2)
        for t_fb in (1.0, 1.25, 1.5):  # from a pair that hides half its work to none
            paired = paired_idle(s, 0.5, 0.5, 0.5, t_fb)
            assert max(paired) == dualpipe_readme_bubble("dualpipev", 2 * pp, 0.5, 1.0, 0.5, t_fb), (pp, mm, t_fb)
        assert paired_idle(s, 0.5, 0.5, 0.5, 1.5) == [pp - 1.0] * pp
