"""Homework 07: right answers earn every point, the usual mistakes lose the cases they should,
and the visible checks say which mistake it is.

The right answers here are written independently of the course's (a sweep over the trace's
points instead of merged intervals; a QR decomposition instead of Gram-Schmidt), so that a
shared error would not pass unseen.
"""
import dataclasses
import math
import statistics

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from reference.course.homework import homework
from reference.course.homework.performance import DIAGNOSE, MFU, STEP_BREAKDOWN, mfu_formula
from reference.course.homework.performance_powersgd import POWERSGD
from reference.course.homework.scoring import score_exercise


def _score(spec, fn, seed=7):
    """The score as the grader weighs it: the homework's WRONG_KEEPS on the spec given."""
    graded = next(s for s in homework("07_performance") if s.id == spec.id)
    spec = dataclasses.replace(spec, wrong_keeps=graded.wrong_keeps)
    return score_exercise(spec, cloudpickle.dumps(fn), seed=seed, timeout=60)


def _loses_half(score) -> bool:
    """Each rule the text states, broken alone, costs at least half the exercise."""
    return score.points < score.max and score.weighted() <= score.weight / 2


def test_homework_07_has_a_warm_up_a_diagnosis_a_transfer_and_a_question():
    assert [s.id for s in homework("07_performance")] == ["step_breakdown", "diagnose",
                                                         "powersgd_all_reduce", "mfu"]


# ------------------------------------------------------------------ step_breakdown

def _sweep(merge=True, clip=True, hide=True):
    """step_breakdown by sweeping the points where anything starts or ends; each flag off is
    a usual mistake."""
    def step_breakdown(compute, communication, step):
        lo, hi = step
        comm = [iv for v in communication.values() for iv in v]
        edges = {lo, hi} | {x for a, b in compute + comm for x in (a, b)}
        points = sorted(min(max(x, lo), hi) for x in edges) if clip else sorted(edges)
        out = dict.fromkeys(("compute", "communication", "hidden"), 0.0)
        for a, b in zip(points, points[1:]):
            mid = (a + b) / 2
            computing = any(s <= mid < e for s, e in compute)
            talking = any(s <= mid < e for s, e in comm)
            out["compute"] += (b - a) * computing
            out["hidden"] += (b - a) * (computing and talking and hide)
            out["communication"] += (b - a) * (talking and not (computing and hide))
        if not merge:  # the operators' lengths added up as they come: nested ones twice, none cut
            out["compute"] = sum(b - a for a, b in compute)
        out["idle"] = (hi - lo) - out["compute"] - out["communication"]
        return out
    return step_breakdown


def _cases_with(key):
    """The names of the hidden cases (seed 7, as `_score`) where the step has some `key` time."""
    from reference.course.homework.scoring import _generator
    cases = STEP_BREAKDOWN.make_cases(_generator(7, STEP_BREAKDOWN.id, 1), 1)
    return {c.name for c in cases if STEP_BREAKDOWN.expect(c.inputs)[0][key] > 0}


def test_step_breakdown_right_answer_full_marks():
    score = _score(STEP_BREAKDOWN, _sweep())
    assert score.points == score.max == 7, score.failures


@pytest.mark.parametrize("mistake, lost", [
    # Adding the operators' lengths as they come (neither merged nor cut): wrong where
    # operators nest and where one starts before the step.
    (dict(merge=False), {"nested operators", "crossing the step's ends"}),
    # Not cutting to the step: wrong only where intervals cross its ends.
    (dict(clip=False), {"crossing the step's ends"}),
    # Communication under compute counted as exposed too: wrong wherever something is hidden.
    (dict(hide=False), _cases_with("hidden")),
])
def test_step_breakdown_mistakes_lose_their_cases(mistake, lost):
    score = _score(STEP_BREAKDOWN, _sweep(**mistake))
    assert {f.split(", ", 1)[1].split(":")[0] for f in score.failures} == lost, score.failures
    assert _loses_half(score)


def test_the_example_in_the_exercise_text():
    got = _sweep()([[0, 4], [1, 2], [6, 8]], {"all_reduce": [[3, 7]]}, [0, 10])
    assert got == {"compute": 6, "communication": 2, "hidden": 2, "idle": 2}


# ------------------------------------------------------------------ diagnose

def _diagnose(comm_first=False, slow_by_waiting=False, crossover=lambda n, a, b: n * a / b):
    def diagnose(profile):
        ranks, n = profile["ranks"], profile["world_size"]
        steps = [r["compute"] + sum(r["communication"].values()) + r["idle"] for r in ranks]
        share = sum(sum(r["communication"].values()) / s for r, s in zip(ranks, steps)) / len(ranks)

        def by_communication():
            calls = sum(r["calls"]["all_reduce"] for r in ranks)
            size = sum(r["bytes"]["all_reduce"] for r in ranks) / calls
            cut = crossover(n, profile["alpha"], profile["beta"])
            return ("latency", cut) if size < cut else ("bandwidth", None)

        if comm_first and share > 0.3:
            return by_communication()
        compute = [r["compute"] for r in ranks]
        if max(compute) > 1.25 * statistics.median(compute):
            waits = [sum(r["communication"].values()) for r in ranks]
            return "straggler", (waits.index(max(waits)) if slow_by_waiting else compute.index(max(compute)))
        p, m, t = profile["pp"], profile["microbatches"], profile["target_bubble"]
        if p > 1 and (p - 1) / (m + p - 1) > t:
            return "bubble", math.ceil((p - 1) * (1 - t) / t)     # no target sits on a whole number
        return by_communication() if share > 0.3 else ("healthy", None)
    return diagnose


def test_diagnose_right_answer_full_marks():
    score = _score(DIAGNOSE, _diagnose())
    assert score.points == score.max == 12, score.failures


@pytest.mark.parametrize("mistake, lost", [
    # The share first: a straggler's and a bubble's waiting pass for communication problems.
    (dict(comm_first=True), 4),
    # The straggler taken as the rank that communicates most: it is the one that waits least.
    (dict(slow_by_waiting=True), 2),
    # The crossover from the latency term alone, 2(N-1) alpha / beta: every latency case's fix
    # but on 2 ranks, where 2(N - 1) = N.
    (dict(crossover=lambda n, a, b: 2 * (n - 1) * a / b), 5),
    # beta read as a bandwidth (N alpha beta, beta in bytes per second): every latency case is
    # taken for a bandwidth one. Half the cases, half the exercise's points.
    (dict(crossover=lambda n, a, b: n * a * b), 6),
])
def test_diagnose_mistakes_lose_their_cases(mistake, lost):
    score = _score(DIAGNOSE, _diagnose(**mistake))
    assert score.max - score.points == lost, score.failures
    assert _loses_half(score)


# ------------------------------------------------------------------ powersgd_all_reduce

def _powersgd(feedback=True, average_q=True, reduce_p=True, whole=False):
    def powersgd_all_reduce(grad, q, error):
        n = dist.get_world_size()
        m = grad + error if feedback else grad
        if whole:  # the whole gradient all-reduced, compressed afterwards: right numbers, n m on the wire
            m = m.clone()
            dist.all_reduce(m)
            m /= n
            p, r = torch.linalg.qr(m @ q)
            p = p * torch.sign(torch.diagonal(r))
            new_q = m.T @ p
            approx = p @ new_q.T
            return approx, new_q, grad + error - approx
        p = m @ q
        if reduce_p:
            dist.all_reduce(p)
        p, r = torch.linalg.qr(p)
        p = p * torch.sign(torch.diagonal(r))   # the Q of P = QR with R's diagonal positive
        new_q = m.T @ p
        dist.all_reduce(new_q)
        if average_q:
            new_q /= n
        approx = p @ new_q.T
        return approx, new_q, m - approx
    return powersgd_all_reduce


def test_powersgd_right_answer_full_marks():
    from reference.course.homework.performance_powersgd import SHAPES

    score = _score(POWERSGD, _powersgd())
    # every shape on each of the spec's world sizes
    assert score.points == score.max == len(SHAPES) * len(POWERSGD.world_sizes), score.failures


@pytest.mark.parametrize("mistake, lost, reason", [
    # No error feedback: right only on the first step, where the error is zero (1 of 4 cases).
    (dict(feedback=False), 3, "wrong"),
    (dict(average_q=False), 4, "wrong approx"),      # the sum of Q: N times too large
    (dict(reduce_p=False), 4, "wrong"),              # each rank its own span
    (dict(whole=True), 4, "all-reduced"),            # the right numbers, but n m of them sent
])
def test_powersgd_mistakes_lose_their_cases(mistake, lost, reason):
    # On 2 ranks only (the right answer above is scored on 2 and 3): each mistake shows there.
    score = _score(dataclasses.replace(POWERSGD, world_sizes=(2,)), _powersgd(**mistake))
    assert score.max - score.points == lost and reason in score.reason, score.failures
    assert _loses_half(score)


def test_powersgd_may_only_all_reduce():
    def gathered(grad, q, error):
        parts = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, grad)
        return grad, q, error
    score = _score(dataclasses.replace(POWERSGD, world_sizes=(2,)), gathered)
    assert score.points == 0 and "not allowed" in score.reason


# ------------------------------------------------------------------ mfu

def test_mfu_is_graded_exactly():
    # The notebook's example: GPT-3 1.3B, 1M tokens in 1.5 s on 64 GPUs of 312 TFLOP/s: 31.9 %.
    example = mfu_formula(1_315_723_264, 24, 2048, 2048, 1_048_576, 1.5, 64, 312e12)
    assert example == pytest.approx(1_048_576 * (6 * 1_315_723_264 + 12 * 24 * 2048 * 2048) / (1.5 * 64 * 312e12))
    assert round(example, 3) == 0.319

    def right(n_params, n_layer, seq_len, n_embd, tokens_per_step, step_seconds, n_gpus, peak_flops):
        return tokens_per_step * (6 * n_params + 12 * n_layer * seq_len * n_embd) / (
            step_seconds * n_gpus * peak_flops)
    assert (s := _score(MFU, right)).points == s.max == 7, s.failures

    def percent(**kw):
        return 100 * right(**kw)

    def no_attention(n_params, n_layer, seq_len, n_embd, tokens_per_step, step_seconds, n_gpus, peak_flops):
        return tokens_per_step * 6 * n_params / (step_seconds * n_gpus * peak_flops)
    assert _score(MFU, percent).points == 0
    assert _score(MFU, no_attention).points == 0


# ------------------------------------------------------------------ the visible checks

def test_visible_checks_print_pass_and_fail(capsys):
    from reference.course.checks.performance import (check_diagnose, check_mfu, check_powersgd_all_reduce,
                                                     check_step_breakdown)
    check_step_breakdown(_sweep())
    check_step_breakdown(_sweep(merge=False))
    check_diagnose(_diagnose(comm_first=True))
    check_powersgd_all_reduce(_powersgd(whole=True))
    check_mfu(lambda **kw: "31 %")   # a string is not a number
    check_mfu(lambda **kw: 0.31)     # a number of the right kind, not the text's worked value
    out = capsys.readouterr().out
    assert "PASS step_breakdown" in out
    assert "FAIL step_breakdown" in out and "merge the compute intervals" in out
    assert "FAIL diagnose" in out and "compare the ranks' compute first" in out
    assert "FAIL powersgd_all_reduce" in out and "never the whole gradient" in out
    assert "FAIL mfu: returned a str, not a number" in out
    assert "FAIL mfu: gives 0.31 on the text's worked example" in out and "0.4674" in out
