"""Homework 06's composed exercise (finish_step): its expected answer is one process's, the
solution earns every case, and each mistake of notebook 06's composition clinic loses the
cases that can see it.

Every wrong answer is the solution notebook's function with one change, scored directly
with `score_exercise` on the 4-rank cases (every clinic mistake shows there; the whole
notebook, with 6 and 8 ranks, is graded in tests/test_course_homework.py).
"""
from __future__ import annotations

import dataclasses
import math

import cloudpickle
import pytest
import torch

from reference.course.homework import parallel_step
from reference.course.homework.parallel_step import (FINISH_STEP, _tp_dim, expect_finish_step,
                                                     make_finish_cases)
from reference.course.homework import HOMEWORK
from reference.course.homework.scoring import ExerciseScore, score_exercise
from reference.tolerance import forward, loss as loss_tolerance
from solution_cells import solution_function

TIMEOUT = 60  # s per launch; a 4-rank launch takes a few seconds on a loaded 2-core machine
pytestmark = pytest.mark.timeout(300)
# The homework's spec (its WRONG_KEEPS applied, as the grader grades it), on 4 ranks
ON_FOUR = dataclasses.replace({s.id: s for s in HOMEWORK["06_3d_parallel"]}["finish_step"], world_sizes=(4,))


def _student(*edits) -> bytes:
    return cloudpickle.dumps(solution_function("06_3d_parallel", "finish_step", *edits))


@pytest.mark.parametrize("world_size", [4, 6, 8])
def test_the_expected_answer_is_one_process_gradient_of_the_whole_batch(monkeypatch, world_size):
    """`expect_finish_step` builds its answer from the ranks' float32 parts; it must be the
    GPT's own gradient of the mean loss over the whole batch, computed in one process (the
    clip applied), its loss and its norm, each rank's slice where the rank holds it. The
    parts and the loss are rounded to float32, each by at most float32's unit roundoff of
    the largest number they hold: the course's fp32 forward bound, at the scale of each
    tensor's largest element (`forward().at_scale`)."""
    made = []
    real = parallel_step._case_model
    monkeypatch.setattr(parallel_step, "_case_model",
                        lambda *args: made.append(real(*args)) or made[-1])
    cases = make_finish_cases(torch.Generator().manual_seed(7), world_size)
    assert len(cases) == len(made) == len(parallel_step.MESHES[world_size])
    for case, (model, idx, tgt) in zip(cases, made):
        dp, tp, pp = case.inputs[0]["dims"]
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, tgt)
        loss.backward()
        whole = {n: p.grad for n, p in model.named_parameters()}  # the tied tensor once
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in whole.values()))
        if model.config.tie_weights and pp > 1:  # the head's copy, on the last stage
            whole["lm_head.weight"] = whole["wte.weight"]
        expected = expect_finish_step(case.inputs)
        held = set()
        for rank, (inp, want) in enumerate(zip(case.inputs, expected)):
            one = float(loss.detach())
            assert loss_tolerance().allows(want["loss"] - one, one), case.name
            dp_reduce = inp["dp_reduce"]
            if dp_reduce:
                assert forward().allows(want["norm"] - norm, norm), case.name
            m = inp["max_norm"]
            coef = 1.0 if m is None else min(1.0, m / (norm + 1e-6))
            t = rank % tp
            for name, g in want["grads"].items():
                full = whole[name] * coef
                dim = _tp_dim(name)
                if inp["layout"][name]["tp"] == "split":
                    full = full.tensor_split(tp, dim=dim)[t]
                held.add(name)
                if dp_reduce:
                    tol = forward().at_scale(float(full.abs().max()))
                    tol.assert_close(g, full, f"{case.name} {name}")
        if not case.inputs[0]["dp_reduce"]:  # each rank its replica's: their mean is one process's
            for rank in range(tp * dp):
                s = rank // (tp * dp)
                mean = {n: sum(expected[(s * dp + d) * tp + rank % tp]["grads"][n] for d in range(dp)) / dp
                        for n in expected[rank]["grads"]}
                for name, g in mean.items():
                    full = whole[name]
                    if case.inputs[rank]["layout"][name]["tp"] == "split":
                        full = full.tensor_split(tp, dim=_tp_dim(name))[rank % tp]
                    tol = forward().at_scale(float(full.abs().max()))
                    tol.assert_close(g, full, f"{case.name} {name}")
        assert held == set(whole), case.name  # every tensor of the model on some rank


def test_the_cases_hold_what_each_mistake_needs_to_show():
    """Over the three world sizes: sequence parallelism with tp > 1, a tied embedding across
    stages, pp > 1, a middle stage, a clip that acts and one that does not, and the
    optimizer averaging dp with dp > 1."""
    seen = set()
    for ws in FINISH_STEP.world_sizes:
        for case in make_finish_cases(torch.Generator().manual_seed(3), ws):
            first = case.inputs[0]
            dp, tp, pp = first["dims"]
            kinds = {v["tp"] for c in case.inputs for v in c["layout"].values()}
            seen |= {"partial"} & kinds
            if any(v["tied"] for c in case.inputs for v in c["layout"].values()):
                seen.add("tied")
            if pp > 2:
                seen.add("middle stage")
            if first["max_norm"] is not None:
                norm = expect_finish_step(case.inputs)[0]["norm"]
                seen.add("clip acts" if first["max_norm"] < norm else "clip idle")
            if not first["dp_reduce"] and dp > 1:
                seen.add("optimizer averages dp")
    assert seen == {"partial", "tied", "middle stage", "clip acts", "clip idle",
                    "optimizer averages dp"}


def test_the_solution_earns_every_case_on_four_ranks():
    score = score_exercise(ON_FOUR, _student(), seed=11, timeout=TIMEOUT)
    assert (score.points, score.max) == (4, 4), score.failures


CLINIC = {
    "SP not summed over tp": ([("            dist.all_reduce(g, group=tp_group)\n", "            pass\n")],
                              "(partial) differs"),
    "tied copies drift": ([('            dist.all_reduce(g, group=groups["embedding"])', "            pass")],
                          "tied) differs"),
    "loss averaged over pp": ([("    dist.all_reduce(value, group=pp_group)\n",
                                "    dist.all_reduce(value, group=pp_group)\n"
                                "    value /= dist.get_world_size(pp_group)\n")], "ratio 0.5"),
    "replicated counted tp times": ([('        if layout[name]["tp"] != "split" and not first_tp:',
                                      "        if False:")], "norm "),
    "dp averaged twice with ZeRO": ([("    if not dp_reduce:\n        return",
                                      "    if not dp_reduce:\n"
                                      "        for g in grads.values():\n"
                                      "            g /= dp\n"
                                      "        return")], "0.5 times one process's"),
}


@pytest.mark.parametrize("mistake", list(CLINIC))
def test_each_clinic_mistake_loses_the_cases_that_show_it(mistake):
    edits, symptom = CLINIC[mistake]
    score = score_exercise(ON_FOUR, _student(*edits), seed=11, timeout=TIMEOUT)
    assert 0 < score.points < score.max, (mistake, score.failures)
    assert all(symptom in f for f in score.failures), (mistake, score.failures)
    assert score.weighted() <= score.weight / 2, score.as_dict()  # wrong: at least half lost


# Plausible wrong answers beyond the clinic's, one line each: each fails only the cases that
# can show it (a norm summed over dp: those with dp > 1), and still loses half the exercise.
WRONG = {
    "norm summed over the dp replicas too": [("    dist.all_reduce(total, group=pp_group)\n",
                                              "    dist.all_reduce(total, group=pp_group)\n"
                                              "    dist.all_reduce(total, group=dp_group)\n")],
    "SP-partial tensors counted tp times": [('        if layout[name]["tp"] != "split" and not first_tp:',
                                             '        if layout[name]["tp"] == "replicated" and not first_tp:')],
    "clip coefficient not capped at 1": [("        coef = min(1.0, max_norm / (norm + 1e-6))",
                                          "        coef = max_norm / (norm + 1e-6)")],
    "tied embedding counted on both stages": [('        if layout[name]["tied"] and not first_stage:\n'
                                               '            continue\n', "")],
    "loss not averaged over dp": [("    mean_loss = value.item() / dp", "    mean_loss = value.item()")],
}


@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_plausible_wrong_answer_loses_at_least_half(mistake):
    score = score_exercise(ON_FOUR, _student(*WRONG[mistake]), seed=11, timeout=TIMEOUT)
    assert 0 < score.max - score.points, (mistake, score.failures)
    assert score.weighted() <= score.weight / 2, (mistake, score.as_dict())


def test_homeworks_03_and_06_keep_at_most_half_for_any_failed_case():
    """An answer that fails one case of seven keeps half of the weight, not six sevenths; a
    right answer keeps all of it; the other homeworks keep the share of their cases passed."""
    for hw in ("03_tensor_parallel", "06_3d_parallel"):
        assert all(spec.wrong_keeps == 0.5 for spec in HOMEWORK[hw]), hw
    assert ExerciseScore("x", points=6, max=7, weight=6, wrong_keeps=0.5).weighted() == 3
    assert ExerciseScore("x", points=2, max=7, weight=6, wrong_keeps=0.5).weighted() == 1.71
    assert ExerciseScore("x", points=7, max=7, weight=6, wrong_keeps=0.5).weighted() == 6
    assert ExerciseScore("x", points=6, max=7, weight=6).weighted() == 5.14


def test_replacing_a_gradient_tensor_is_refused():
    """The optimizer holds the tensors: a function that rebinds `grads[name]` loses."""
    score = score_exercise(ON_FOUR, _student(
        ("            dist.all_reduce(g, group=dp_group)\n            g /= dp\n",
         "            dist.all_reduce(g, group=dp_group)\n"
         "        for name in list(grads):\n"
         "            grads[name] = grads[name] / dp\n")), seed=11, timeout=TIMEOUT)
    assert score.points < score.max and any("replaced" in f for f in score.failures), score.failures
