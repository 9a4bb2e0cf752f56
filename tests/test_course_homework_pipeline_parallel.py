"""Homework 04's hidden checks take points from wrong schedules, and only from them.

Each wrong answer below is a plausible mistake: 1F1B handed in as GPipe,
receives posted too early, a missing message, sends put off until a deadlock,
one warm-up forward too many (too much memory) or too few (a larger bubble),
the course's own `build_schedule`. The execution check is shown to bite by
tampering with the loss and gradients that correct ranks sent back.
"""
import dataclasses

import cloudpickle
import pytest
import torch

from reference.course.homework import HOMEWORK, score_exercise
from reference.course.homework import pipeline_parallel as hw
from reference.course.homework.scoring import _launch_cases
from reference.pipeline_parallel.schedules import bubble_formula

CHECK_TIMEOUT = 60  # s per launch; each needs a few seconds on a loaded 2-core machine
pytestmark = pytest.mark.timeout(300)

STUDENT = '''
from reference.pipeline_parallel.schedules import Action

def add_messages(order, pp, rank):
    out = []
    for op, mb in order:
        if op == "F":
            if rank > 0:
                out.append(Action("RECV_F", mb, peer=rank - 1))
            out.append(Action("F", mb))
            if rank < pp - 1:
                out.append(Action("SEND_F", mb, peer=rank + 1))
        else:
            if rank < pp - 1:
                out.append(Action("RECV_B", mb, peer=rank + 1))
            out.append(Action("B", mb))
            if rank > 0:
                out.append(Action("SEND_B", mb, peer=rank - 1))
    return out

def gpipe(pp, m, rank):
    return add_messages([("F", i) for i in range(m)] + [("B", i) for i in range(m)], pp, rank)

def one_f_one_b(pp, m, rank, extra=0):
    warmup = max(0, min(pp - rank - 1 + extra, m))
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return add_messages(order, pp, rank)

def as_tuples(pp, m, rank):
    return [tuple(a) for a in gpipe(pp, m, rank)]

def receives_first(pp, m, rank):
    actions = gpipe(pp, m, rank)
    early = [a for a in actions if a.op == "RECV_F"]
    return early + [a for a in actions if a.op != "RECV_F"]

def no_send_b(pp, m, rank):
    return [a for a in gpipe(pp, m, rank) if a.op != "SEND_B"]

def one_too_many(pp, m, rank):
    return one_f_one_b(pp, m, rank, extra=1)

def one_too_few(pp, m, rank):
    return one_f_one_b(pp, m, rank, extra=-1)

def sends_last(pp, m, rank):
    actions = one_f_one_b(pp, m, rank)
    return [a for a in actions if a.op != "SEND_F"] + [a for a in actions if a.op == "SEND_F"]

def course(pp, m, rank):
    from reference.pipeline_parallel import build_schedule
    return build_schedule("1f1b", pp, m).actions(rank)
'''


def _namespace():
    namespace = {"__name__": "student"}  # not importable: pickled by value, like a notebook's
    exec(STUDENT, namespace)
    return namespace


def _student(name):
    return cloudpickle.dumps(_namespace()[name])


def _score(spec, name, **changes):
    """The score as the grader weighs it: the homework's spec (its WRONG_KEEPS)."""
    graded = next(s for s in HOMEWORK["04_pipeline_parallel"] if s.id == spec.id)
    return score_exercise(dataclasses.replace(graded, **changes), _student(name), seed=7,
                          timeout=CHECK_TIMEOUT)


def _loses_half(score) -> bool:
    """Each rule the text states, broken alone, costs at least half the exercise."""
    return score.points < score.max and score.weighted() <= score.weight / 2


def test_registered():
    assert [s.id for s in HOMEWORK["04_pipeline_parallel"][:2]] == [hw.GPIPE.id, hw.ONE_F_ONE_B.id]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_the_course_schedules_pass_the_judges(pp):
    """No process: the course's own lists, as plain data, meet every rule for many m."""
    for m in range(1, 9):
        case = {"pp": pp, "m": m}
        gpipe = {"error": "", "actions": hw.course_gpipe(case)}
        assert hw.judge_gpipe([case], hw.expect_gpipe([case]), [gpipe], 1) == ""
        one_f_one_b = {"error": "", "actions": hw.course_one_f_one_b(case)}
        want = {"bubble": bubble_formula("1f1b", pp, m)}
        assert hw._judge_schedule(case, one_f_one_b, want, hw._one_f_one_b_order) == ""


def test_plain_tuples_are_accepted_and_garbage_is_explained():
    student = _namespace()
    case = {"pp": 3, "m": 4}
    out = hw.call_gpipe(student["as_tuples"], case)
    assert hw.judge_gpipe([case], hw.expect_gpipe([case]), [out], 1) == ""
    out = hw.call_gpipe(lambda pp, m, rank: [("F", 0), "B0"], case)
    assert "for rank 0 (pp=3, m=4): item #1 is a str, not an Action" in \
        hw.judge_gpipe([case], hw.expect_gpipe([case]), [out], 1)
    out = hw.call_gpipe(lambda pp, m, rank: None, case)
    assert "a NoneType, not a list of actions" in \
        hw.judge_gpipe([case], hw.expect_gpipe([case]), [out], 1)


def test_gpipe_checks_order_messages_and_bubble():
    ok = _score(hw.GPIPE, "gpipe")
    assert ok.points == ok.max == 6 and ok.reason == ""
    # 1F1B computes backwards early; it equals GPipe only when m = 1 or pp = 1.
    wrong_order = _score(hw.GPIPE, "one_f_one_b")
    assert 0 < wrong_order.points < wrong_order.max
    assert all("GPipe runs the forwards" in f for f in wrong_order.failures)
    assert _loses_half(wrong_order)
    # Valid and in GPipe's order, but a middle rank waits for all activations first.
    early = _score(hw.GPIPE, "receives_first")
    assert 0 < early.points < early.max and all("bubble" in f for f in early.failures)
    assert _loses_half(early)
    missing = _score(hw.GPIPE, "no_send_b")
    assert missing.points == 1  # only the pipeline of one stage sends nothing
    assert "invalid schedule: rank 1 never runs SEND_B0" in missing.reason
    assert _loses_half(missing)


def test_one_f_one_b_checks_memory_bubble_deadlock_and_the_builtin():
    on_two = dict(world_sizes=(2,))  # the judge is the same on 4 ranks; one launch is enough
    gpipe = _score(hw.ONE_F_ONE_B, "gpipe", **on_two)
    assert gpipe.points == 1 and "holds the activations of 2 micro-batches" in gpipe.reason
    assert _loses_half(gpipe)
    too_many = _score(hw.ONE_F_ONE_B, "one_too_many", **on_two)
    assert too_many.points == 1  # m = 1: nothing to warm up with
    assert all("1F1B holds at most pp - rank" in f for f in too_many.failures)
    assert _loses_half(too_many)
    too_few = _score(hw.ONE_F_ONE_B, "one_too_few")  # on 2 and 4 ranks: the whole exercise
    assert too_few.points == 2 and all("bubble" in f for f in too_few.failures)  # m = 1 only
    assert _loses_half(too_few)  # one warm-up short loses over half
    deadlock = _score(hw.ONE_F_ONE_B, "sends_last", **on_two)
    assert deadlock.points == 0 and all("invalid schedule: deadlock" in f
                                        for f in deadlock.failures)
    assert _loses_half(deadlock)
    builtin = _score(hw.ONE_F_ONE_B, "course")
    assert builtin.points == 0 and "build_schedule is not allowed" in builtin.reason


def test_the_executed_run_is_compared_with_one_process():
    """Correct ranks pass; a loss or a gradient changed after the run fails the case."""
    cases = hw.make_one_f_one_b_cases(torch.Generator().manual_seed(3), 2)
    outputs = _launch_cases(hw.ONE_F_ONE_B, _student("one_f_one_b"), 2, cases, CHECK_TIMEOUT,
                            None)
    for case in cases:
        expected = hw.expect_one_f_one_b(case.inputs)
        got = outputs[case.name]
        assert all(o["ran"] for o in got)
        assert hw.judge_one_f_one_b(case.inputs, expected, got, 2) == ""

    case = cases[-1]
    expected = hw.expect_one_f_one_b(case.inputs)

    def judged(tamper):
        got = [dict(o, grads=dict(o["grads"])) for o in outputs[case.name]]
        tamper(got)
        return hw.judge_one_f_one_b(case.inputs, expected, got, 2)

    def nudge_grad(got):
        name = next(iter(got[0]["grads"]))
        got[0]["grads"][name] = got[0]["grads"][name] + 1e-3

    assert "rank 0's gradient of" in judged(nudge_grad)
    assert "the loss differs" in judged(lambda got: got[1].update(loss=got[1]["loss"] * 1.001))
    assert "no rank computed the gradient of" in judged(lambda got: got[1]["grads"].popitem())
    assert "should not hold" in judged(lambda got: got[0]["grads"].update(got[1]["grads"]))
