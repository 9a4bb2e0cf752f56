"""Homework 05's hidden checks take points from wrong answers, and say why.

Every wrong answer is the solution notebook's own function with one change, scored
directly with `score_exercise` (tests/test_course_homework.py grades the notebooks).
"""
from __future__ import annotations

from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch
import torch.distributed as dist

from reference.course.checks.expert_parallel import check_top_k_routing
from reference.course.homework.expert_parallel import (DISPATCH_COMBINE, TOP_K_ROUTING,
                                                all_to_all_single_allowed, make_routing_cases,
                                                reference_routing)
from reference.course.homework.guard import COLLECTIVES, NotAllowedError, exercise_rules
from reference.course.homework.scoring import score_exercise

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "05_expert_parallel.ipynb"
TIMEOUT = 30  # s per launch; each needs about one
pytestmark = pytest.mark.timeout(300)


def _source(exercise: str) -> str:
    nb = nbformat.read(SOLUTION, as_version=4)
    return next(c.source for c in nb.cells
                if c.cell_type == "code" and c.metadata.get("course", {}).get("exercise") == exercise)


def _variant(exercise: str, *edits) -> str:
    """The solution's source with each (old, new) replaced once; old must be there."""
    source = _source(exercise)
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new, 1)
    return source


def _student(exercise: str, source: str) -> bytes:
    namespace = {"__name__": "student"}  # not importable: pickled by value, like a notebook's
    exec("import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"
         + source, namespace)
    return cloudpickle.dumps(namespace[exercise])


def _score(spec, *edits):
    return score_exercise(spec, _student(spec.id, _variant(spec.id, *edits)), seed=1,
                          timeout=TIMEOUT)


# ------------------------------------------------------------------ top_k_routing


def test_the_hidden_routing_cases_drop_and_the_reference_is_the_router():
    cases = make_routing_cases(torch.Generator().manual_seed(0), 1)
    dropped = [int((~reference_routing(**c.inputs[0])["kept"]).sum()) for c in cases]
    assert sum(d > 0 for d in dropped) >= 3 and 0 in dropped  # capacity bites, and sometimes not
    for case in cases:
        logits = case.inputs[0]["logits"]
        gaps = logits.sort(dim=1).values.diff(dim=1)
        assert gaps.min() > 0.05, case.name  # no tie can decide a choice


def test_solution_scores_full_marks_on_routing():
    full = score_exercise(TOP_K_ROUTING, _student("top_k_routing", _source("top_k_routing")),
                          seed=1, timeout=TIMEOUT)
    assert (full.points, full.reason) == (full.max, "") and full.max == 7


def test_routing_in_position_order_loses_the_cases_that_drop():
    score = _score(TOP_K_ROUTING, ("expert_idx.t().reshape(-1)", "expert_idx.reshape(-1)"),
                   (".view(k, T).t()", ".view(T, k)"))
    assert 0 < score.points < score.max
    assert "first choice in position order" in score.reason


def test_switch_weights_must_stay_raw():
    score = _score(TOP_K_ROUTING, ("if k > 1:", "if True:"))
    assert score.points == score.max - 1 and "Switch" in score.reason


def test_ignoring_capacity_and_zeroing_dropped_weights_lose_points():
    unlimited = _score(TOP_K_ROUTING, ("kept = (slot < capacity)", "kept = (slot < T)"))
    assert 0 < unlimited.points < unlimited.max and "its capacity is" in unlimited.reason
    zeroed = _score(TOP_K_ROUTING, ("return expert_idx, weights, kept",
                                    "return expert_idx, weights * kept, kept"))
    assert 0 < zeroed.points < zeroed.max and "dropped assignments changed" in zeroed.reason


def test_routing_may_not_communicate():
    score = _score(TOP_K_ROUTING, ("T, E = logits.shape", "T, E = logits.shape\n    dist.all_reduce(logits)"))
    assert score.points == 0 and "all_reduce is not allowed" in score.reason


def test_visible_routing_check_prints_fail_with_a_hint(capsys):
    namespace = {"__name__": "student"}
    exec("import torch, torch.nn.functional as F\n" + _variant("top_k_routing", ("if k > 1:", "if True:")),
         namespace)
    check_top_k_routing(namespace["top_k_routing"])
    out = capsys.readouterr().out
    assert out.startswith("FAIL top_k_routing:") and "Switch" in out and "hint:" in out


# ------------------------------------------------------------------ dispatch_combine


def test_solution_scores_full_marks_on_dispatch():
    full = score_exercise(DISPATCH_COMBINE, _student("dispatch_combine", _source("dispatch_combine")),
                          seed=1, timeout=TIMEOUT)
    # 5 cases on 2 and on 4 ranks, and on 4 two of them again on the subgroup of ranks 1, 2, 3
    assert (full.points, full.reason) == (full.max, "") and full.max == 12


def test_forgetting_the_weights_fails_every_case():
    score = _score(DISPATCH_COMBINE, ("returned * row_weights", "returned"))
    assert score.points == 0 and "wrong output" in score.reason


def test_running_an_expert_twice_is_seen():
    score = _score(DISPATCH_COMBINE, (
        "        out = expert_fn(",
        "        expert_fn(rank * E_l + l, torch.cat([blocks[i] for i in mine]))\n"
        "        out = expert_fn("))
    assert score.points == 0 and "processed" in score.reason


def test_computing_locally_is_seen():
    local = (
        "    out = tokens.new_zeros(tokens.shape)\n"
        "    for t in range(N):\n"
        "        for j in range(k):\n"
        "            if expert_idx[t, j] >= 0:\n"
        "                e = int(expert_idx[t, j])\n"
        "                out[t] += weights[t, j] * expert_fn(e, tokens[t:t + 1])[0]\n"
        "    return out\n"
        "    # 1.")
    score = _score(DISPATCH_COMBINE, ("    # 1.", local))
    assert score.points == 0 and "ran on rank" in score.reason and "lives on rank" in score.reason


def test_dispatch_may_use_no_other_collective():
    score = _score(DISPATCH_COMBINE, (
        "dist.all_to_all_single(recv_counts, counts, group=group)",
        "dist.all_to_all(list(recv_counts.chunk(P)), list(counts.chunk(P)), group=group)"))
    assert score.points == 0 and "all_to_all is not allowed" in score.reason


def test_all_to_all_single_is_let_through_only_inside_the_call():
    pg = dist.ProcessGroup
    before = pg.__dict__.get("all_to_all_single")
    for forbidden in (COLLECTIVES, DISPATCH_COMBINE.forbidden):
        with exercise_rules("dispatch_combine", forbidden):
            ruled = pg.__dict__.get("all_to_all_single")
            log = []
            with all_to_all_single_allowed(log):
                recorded = pg.__dict__["all_to_all_single"]
                assert recorded not in (ruled, before) and recorded.__name__ == "recorded"
            assert pg.__dict__.get("all_to_all_single") is ruled
            with pytest.raises(NotAllowedError):  # the other collectives stay switched off
                dist.all_gather_into_tensor(torch.zeros(2), torch.zeros(1))
        assert pg.__dict__.get("all_to_all_single") is before


def test_sending_rows_many_times_over_is_seen():
    # Every row sent 8 times (blocks stay in destination order), then one copy kept.
    score = _score(DISPATCH_COMBINE, (
        "received = AllToAll.apply(rows, recv_splits, send_splits, group)",
        "received = AllToAll.apply(rows.repeat_interleave(8, dim=0), [8 * n for n in recv_splits],\n"
        "                              [8 * n for n in send_splits], group)[::8]"))
    assert 0 < score.max - score.points and "through all_to_all_single" in score.reason


def test_the_lecture_forward_only_dispatch_loses_every_case():
    """all_to_all_single called directly: right values, but no gradient reaches the tokens."""
    score = _score(DISPATCH_COMBINE, (
        "received = AllToAll.apply(rows, recv_splits, send_splits, group)",
        "received = rows.new_empty((sum(recv_splits), rows.shape[1]))\n"
        "    dist.all_to_all_single(received, rows, recv_splits, send_splits, group=group)"), (
        "returned = AllToAll.apply(torch.cat(blocks), send_splits, recv_splits, group)  # (n, C)",
        "returned = torch.empty_like(rows)\n"
        "    dist.all_to_all_single(returned, torch.cat(blocks), send_splits, recv_splits, group=group)"))
    assert score.points == 0, score.failures
    assert all("no gradient reached the tokens" in f for f in score.failures), score.failures


def test_a_backward_that_does_not_swap_the_splits_is_seen():
    score = _score(DISPATCH_COMBINE, (
        "dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)",
        "dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)\n"
        "        back = back.flip(0)"))
    assert score.points < score.max and "wrong gradient of the tokens" in score.reason


# ------------------------------------------------------------------ float32 against the float64 reference


def _float32_answer(case: dict) -> dict:
    """A right answer computed in float32 in one process: the per-assignment sum, backward
    from the case's grad_out (what a correct distributed answer computes, up to order)."""
    from reference.course.homework.expert_parallel import _combined
    x = case["tokens"].clone().requires_grad_()
    w = case["weights"].clone().requires_grad_()
    out = _combined(x, case["expert_idx"], w)
    if out.requires_grad:
        out.backward(case["grad_out"])
    zeros = torch.zeros_like
    return {"out": out.detach(), "grad_tokens": zeros(x) if x.grad is None else x.grad,
            "grad_weights": zeros(w) if w.grad is None else w.grad}


def _outputs(inputs: list, answers: list) -> list:
    """What the ranks would report for these answers: every expert run on its own rank on
    the rows that chose it, no traffic recorded (the judges' traffic checks are upper
    bounds), and the answers' values and gradients."""
    P, epr = len(inputs), inputs[0]["experts_per_rank"]
    chosen = torch.bincount(torch.cat([c["expert_idx"].reshape(-1) for c in inputs]) + 1,
                            minlength=epr * P + 1)[1:]
    return [{"returned": a["out"], "returned_type": "Tensor", "all_to_all": [],
             "forward_calls": 0, "grad_tokens": a["grad_tokens"], "grad_weights": a["grad_weights"],
             "ran": [[e, int(chosen[e])] for e in range(r * epr, (r + 1) * epr) if chosen[e]]}
            for r, a in enumerate(answers)]


def test_a_right_float32_answer_passes_every_seed_and_a_wrong_weight_does_not():
    """The judge compares float32 answers with a float64 reference, so its tolerance must hold
    float32's rounding of sin's argument x (e + 1): over 40 seeds of the hidden cases a right
    float32 answer passes the judge on every case (with rtol 1e-5 / atol 1e-6 alone, the token
    gradient of 12-expert cases was out by up to 6x that tolerance here, and a grader's
    machine failed the solution on one case), while weights off by 1% fail every case that
    keeps an assignment."""
    from reference.course.homework.expert_parallel import (
        expect_dispatch_combine_backward, judge_dispatch_combine_backward, make_dispatch_cases)
    failed, cases, caught, with_kept = [], 0, 0, 0
    for world_size in (2, 4):
        for seed in range(40):
            for case in make_dispatch_cases(torch.Generator().manual_seed(seed), world_size):
                expected = expect_dispatch_combine_backward(case.inputs)
                answers = [_float32_answer(c) for c in case.inputs]
                why = judge_dispatch_combine_backward(
                    case.inputs, expected, _outputs(case.inputs, answers), world_size)
                cases += 1
                if why:
                    failed.append((world_size, seed, case.name, why))
                if any((c["expert_idx"] >= 0).any() for c in case.inputs):
                    with_kept += 1
                    wrong = [_float32_answer(dict(c, weights=c["weights"] * 1.01))
                             for c in case.inputs]
                    caught += bool(judge_dispatch_combine_backward(
                        case.inputs, expected, _outputs(case.inputs, wrong), world_size))
    assert not failed, failed[:3]
    assert cases == 400 and caught == with_kept > 0
