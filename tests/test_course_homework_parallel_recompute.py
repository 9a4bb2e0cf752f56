"""Homework 06's recompute exercise (activation checkpointing by hand): its expected answer is
fn called directly, the solution earns every case, and each mistake loses the cases that can
see it: the clinic's (masks drawn again without the forward's random state) every case with
dropout, keeping the activations every case, the caller's generator left elsewhere the
caller's case.

The solution notebook's function is scored with `score_exercise` (one launch of one rank per
score); the other answers, the notebook's function with one change, are judged in this
process through the exercise's own call, expect and judge: the same code the rank runs.
"""
from __future__ import annotations


import cloudpickle
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from reference.course.homework import parallel_recompute as pr
from reference.course.homework.guard import exercise_rules
from reference.course.homework.refuse import REFUSED
from reference.course.homework.scoring import score_exercise

from solution_cells import solution_function  # noqa: E402

TIMEOUT = 60  # s per launch of one rank
pytestmark = pytest.mark.timeout(120)
SEEDS = (3, 11, 29)
DROPOUT = [name for name, _, p, _, _ in pr.PLAN if p > 0]
CALLER = next(name for name, *_, draws in pr.PLAN if draws)
CHAIN = next(name for name, _, _, chain, _ in pr.PLAN if chain > 1)


def _student(*edits):
    """The notebook's function with each (old, new) edit, defined as a notebook defines it."""
    return solution_function("06_3d_parallel", "recompute", *edits)


def _failures(fn, seed: int) -> dict:
    """{case name: the judge's reason} for every case of `seed` ("" when it passes)."""
    found = {}
    for case in pr.make_recompute_cases(torch.Generator().manual_seed(seed), 1):
        out = pr.call_recompute(fn, case.inputs[0])
        found[case.name] = pr.judge_recompute(case.inputs, pr.expect_recompute(case.inputs), [out], 1)
    return found


def test_the_expected_answer_is_fn_called_directly():
    """`expect_recompute` is a direct run: the output is the case's functions applied from the
    seed, the gradients those of (y * grad_out).sum(), the draws the generator's next numbers;
    and the cases are such that each mistake can show (dropout really drops, another
    seed draws other masks, the caller's draws depend on what fn drew)."""
    for case in pr.make_recompute_cases(torch.Generator().manual_seed(5), 1):
        inp = case.inputs[0]
        want = pr.expect_recompute(case.inputs)[0]
        fns, leaves = pr._build(inp)
        torch.manual_seed(inp["seed"])
        x = inp["x"].clone().requires_grad_(True)
        y = x
        for f in fns:
            y = f(y)
        assert torch.equal(y.detach(), want["out"]), case.name
        after_forward = torch.rand(pr.DRAWS)
        torch.autograd.backward(y, inp["grad_out"])
        assert torch.equal(x.grad, want["x_grad"]), case.name
        assert set(leaves) == set(want["grads"]) and all(
            torch.equal(t.grad, want["grads"][n]) for n, t in leaves.items()), case.name
        assert torch.equal(after_forward, want["draws"][0]), case.name
        assert torch.equal(torch.rand(pr.DRAWS), want["draws"][1]), case.name
        # Another seed: other masks, so another output, exactly when fn has dropout.
        torch.manual_seed(inp["seed"] + 1)
        with torch.no_grad():
            other = x.detach()
            for f in fns:
                other = f(other)
        assert torch.equal(other, want["out"]) == (inp["p"] == 0), case.name
        assert inp["x"].nbytes > 0 and not torch.equal(want["draws"][0], want["draws"][1])


def test_torch_own_checkpointing_passes_and_without_its_random_state_fails():
    """The judge against torch.utils.checkpoint (not allowed to the student): both of its
    implementations pass every case; preserve_rng_state=False, the clinic's mistake, loses
    exactly the cases with dropout."""
    for use_reentrant in (False, True):
        got = _failures(lambda f, t: checkpoint(f, t, use_reentrant=use_reentrant), seed=SEEDS[0])
        assert not any(got.values()), got
    got = _failures(lambda f, t: checkpoint(f, t, use_reentrant=False, preserve_rng_state=False),
                    seed=SEEDS[0])
    assert sorted(n for n, why in got.items() if why) == sorted(DROPOUT), got
    assert all("differs from a run without checkpointing" in got[n] for n in DROPOUT), got


def test_the_solution_earns_every_case():
    score = score_exercise(pr.RECOMPUTE, cloudpickle.dumps(_student()), seed=SEEDS[1],
                           timeout=TIMEOUT)
    assert (score.points, score.max) == (5, 5), score.failures
    for seed in SEEDS:  # and in this process, on other draws of the cases
        assert not any(_failures(_student(), seed).values())


def test_the_clinic_mistake_loses_every_case_with_dropout():
    """Recomputing without the forward's random state: other masks, other gradients."""
    wrong = _student(("            torch.set_rng_state(ctx.rng)", "            pass"))
    score = score_exercise(pr.RECOMPUTE, cloudpickle.dumps(wrong), seed=SEEDS[1], timeout=TIMEOUT)
    assert score.points == len(pr.PLAN) - len(DROPOUT), score.failures
    assert len(score.failures) == len(DROPOUT) and all(
        any(f.startswith(f"1 ranks, {n}: ") for f in score.failures) for n in DROPOUT), score.failures
    assert all("differs from a run without checkpointing" in f and "(dropout " in f
               for f in score.failures), score.failures


@pytest.mark.parametrize("keep", ["return fn(x)", "a Function that builds fn's graph"])
def test_keeping_the_activations_loses_every_case(keep):
    """The forward keeps fn's activations: every case is a memory case and loses."""
    if keep == "return fn(x)":
        wrong = _student(("    return Checkpointed.apply(x)", "    return fn(x)"))
    else:  # the forward runs fn under grad and returns its graph's output (backward unused)
        wrong = lambda fn, x: fn(x.view_as(x))  # noqa: E731
    for seed in SEEDS:
        got = _failures(wrong, seed)
        assert all("bytes of tensors for backward" in why for why in got.values()), got


@pytest.mark.parametrize("mistake", ["advanced twice", "left where the recomputation put it",
                                     "not advanced by the forward"])
def test_the_caller_generator_left_elsewhere_loses_the_caller_case(mistake):
    """The right masks in backward, but the caller's generator not where one run of fn leaves
    it: the caller's case loses (its next dropout masks would repeat or skip), and when the
    forward is what leaves it so, the two blocks in a row too (the second block is the first's
    caller: it draws other masks); the rest pass."""
    edits = {
        # the forward runs fn a second time: the output is the first run's, the caller's
        # generator is advanced twice
        "advanced twice": [("                return fn(inp)",
                            "                out = fn(inp)\n"
                            "                fn(inp)\n"
                            "                return out")],
        # the caller's state not put back after the recomputation: its next draws repeat
        "left where the recomputation put it": [("            torch.set_rng_state(caller)", "            pass")],
        # the forward leaves no trace in the generator: the caller draws fn's masks again
        "not advanced by the forward": [("            with torch.no_grad():                 #",
                                         "            with torch.no_grad(), torch.random.fork_rng(devices=[]):  #")],
    }[mistake]
    wrong = _student(*edits)
    for seed in SEEDS:
        got = _failures(wrong, seed)
        lost = [n for n, why in got.items() if why]
        if mistake == "left where the recomputation put it":
            assert lost == [CALLER], got
        else:
            assert lost == [CHAIN, CALLER], got
            assert "differs from the 2 blocks run directly" in got[CHAIN], got
        assert "caller's random draws" in got[CALLER], got


def test_a_backward_that_runs_fn_twice_is_named():
    """A second, throwaway run in backward (the masks and the caller's state put right around
    it) is still a second run: every case names it."""
    again = _student(("            torch.autograd.backward(out, grad_out)",
                      "            torch.autograd.backward(out, grad_out)\n"
                      "            with torch.no_grad():\n"
                      "                torch.set_rng_state(ctx.rng)\n"
                      "                fn(inp)\n"
                      "                torch.set_rng_state(caller)"))
    assert all("2 times during backward" in why for why in _failures(again, SEEDS[0]).values())


def test_torch_checkpoint_is_refused_from_the_student_code():
    """torch.utils.checkpoint is banned: called from the student's function, it is refused
    (by the grader's Refusal, as the course's own answers are), so the exercise scores 0."""
    score = score_exercise(pr.RECOMPUTE, cloudpickle.dumps(_student(
        ("    return Checkpointed.apply(x)",
         "    from torch.utils.checkpoint import checkpoint\n"
         "    return checkpoint(fn, x, use_reentrant=False)"))), seed=SEEDS[2], timeout=TIMEOUT)
    assert score.points == 0 and REFUSED in score.reason and "torch.utils.checkpoint" in score.reason, \
        score.failures
    # The grader's own code may still use it: the reference runs outside the student's call.
    case = pr.make_recompute_cases(torch.Generator().manual_seed(1), 1)[0]
    with exercise_rules(pr.RECOMPUTE.id, pr.RECOMPUTE.forbidden):
        out = pr.torch_recompute(case.inputs[0])
    assert pr.judge_recompute(case.inputs, pr.expect_recompute(case.inputs), [out], 1) == ""


def test_the_grade_does_not_depend_on_what_is_graded_beside_it():
    """The grader grades several submissions at once, in threads of its own process, and
    the expected answers draw dropout masks from torch's default generator, which every
    thread shares. Here one thread judges the solution's outputs through the grader's own
    path (`scoring._judge`: expect, then judge) while another grades an untouched exercise
    notebook of the same homework beside it (`score_exercise` with no function: only its
    cases are made, which seeds that generator): the solution keeps every case, every time.
    Without the grader's lock most of the cases with dropout are lost."""
    import threading

    from reference.course.homework import HOMEWORK
    from reference.course.homework.scoring import _judge

    cases = pr.make_recompute_cases(torch.Generator().manual_seed(SEEDS[0]), 1)
    outputs = {c.name: pr.call_recompute(_student(), c.inputs[0]) for c in cases}
    stop, beside = threading.Event(), []

    def untouched_notebook():
        while not stop.is_set():
            for seed in range(3):
                beside.append(score_exercise(pr.RECOMPUTE, None, seed=seed, timeout=TIMEOUT).points)
            for spec in HOMEWORK["06_3d_parallel"]:
                score_exercise(spec, None, seed=0, timeout=TIMEOUT)

    thread = threading.Thread(target=untouched_notebook)
    thread.start()
    try:
        lost = [why for _ in range(8) for c in cases
                if (why := _judge(pr.RECOMPUTE, c, [outputs[c.name]], 1))]
    finally:
        stop.set()
        thread.join()
    assert beside and not any(beside) and lost == [], lost
