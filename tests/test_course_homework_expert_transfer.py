"""Homework 05's transfer exercises and written question: the solution notebook's answers
earn every point, the usual mistakes lose the cases they should, and the course's own
answers (the first name each exercise bans) are right.

Every wrong answer is the solution's function with one change (or the lecture-level
answer of exercise 2), scored directly with `score_exercise`
(tests/test_course_homework.py grades the whole notebooks). The third transfer, the bias
balancing of `balanced_step`, has its own file: tests/test_course_homework_expert_bias.py.
"""
from __future__ import annotations

import dataclasses

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from reference.course.homework import homework
from reference.course.homework.expert_balance import (
    GLOBAL_BALANCE_LOSS, global_loss_and_grads, make_global_balance_cases,
)
from reference.course.homework.expert_dedup import (
    DEDUP_ALL_TO_ALL_BYTES, DISPATCH_COMBINE_DEDUP, call_dedup, course_dispatch_combine,
    course_dispatch_combine_dedup, dedup_all_to_all_bytes_formula, expect_dedup, judge_dedup,
    make_dedup_cases,
)
from reference.course.homework.expert_parallel import (
    call_dispatch_combine, expect_dispatch_combine, judge_dispatch_combine, make_dispatch_cases,
)
from reference.course.homework.scoring import score_exercise
from reference.runtime import launch
from reference.tolerance import forward
from solution_cells import solution_function, subgroup_only

TIMEOUT = 60  # s per launch; each needs a few seconds on a loaded 2-core machine
pytestmark = pytest.mark.timeout(300)
IMPORTS = "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"


def _function(exercise: str, *edits):
    """The solution's function with each (old, new) replaced once, defined as a notebook would."""
    return solution_function("05_expert_parallel", exercise, *edits, imports=IMPORTS)


def _score(spec, fn, seed=5, **changes):
    spec = next((s for s in homework("05_expert_parallel") if s.id == spec.id), spec)  # as graded
    return score_exercise(dataclasses.replace(spec, **changes), cloudpickle.dumps(fn), seed=seed,
                          timeout=TIMEOUT)


def test_homework_05_has_its_warm_up_three_transfers_and_a_question():
    ids = [s.id for s in homework("05_expert_parallel")]
    assert ids == ["top_k_routing", "dispatch_combine", "dispatch_combine_dedup",
                   "global_balance_loss", "dedup_all_to_all_bytes", "balanced_step"]


# ------------------------------------------------------------------ the course's answers

def _course_answers(dispatch, dedup):
    """In a plain rank (no rules, no refusal): the course's answers through each exercise's call."""
    rank = dist.get_rank()
    return ({c.name: call_dispatch_combine(course_dispatch_combine, c.inputs[rank]) for c in dispatch},
            {c.name: call_dedup(course_dispatch_combine_dedup, c.inputs[rank]) for c in dedup})


def test_the_course_answers_pass_the_hidden_judges():
    dispatch = make_dispatch_cases(torch.Generator().manual_seed(0), 2)
    dedup = make_dedup_cases(torch.Generator().manual_seed(0), 2)
    results = launch(_course_answers, 2, dispatch, dedup, timeout=TIMEOUT, quiet=True)
    for case in dispatch:
        outs = [r[0][case.name] for r in results]
        assert judge_dispatch_combine(case.inputs, expect_dispatch_combine(case.inputs), outs,
                                      2) == "", case.name
    for case in dedup:
        outs = [r[1][case.name] for r in results]
        assert judge_dedup(case.inputs, expect_dedup(case.inputs), outs, 2) == "", case.name


# ------------------------------------------------------------------ dispatch_combine_dedup

def test_dedup_solution_scores_full_marks():
    score = _score(DISPATCH_COMBINE_DEDUP, _function("dispatch_combine_dedup"))
    # 6 cases on 2 and on 3 ranks, and on 3 two of them again on the subgroup of ranks 1, 2
    assert score.points == score.max == 14, score.failures


def test_one_row_per_assignment_is_over_the_traffic():
    """Exercise 2's answer is right in value but sends a row per assignment: it keeps only
    the cases where no token meets a rank twice (k = 1 always)."""
    score = _score(DISPATCH_COMBINE_DEDUP, _function("dispatch_combine"))
    assert score.points <= 4, score.failures
    assert all("one row per (token, rank) pair" in f for f in score.failures), score.failures
    assert not any("k=1" in f for f in score.failures)


@pytest.mark.parametrize("edits, reason, lost", [
    # Forgetting the cast: float64 tokens come back float32 (or index_add_ refuses them).
    ([("return tokens.new_zeros(tokens.shape).index_add_(0, pair_token, back)",
       "return torch.zeros(tokens.shape).index_add_(0, pair_token, back.float())")],
     "tokens' dtype", 1),
    # Every expert's weight ignored at the destination: wrong wherever weights matter.
    ([("summed[chose] += w * out", "summed[chose] += out")], "wrong output", 6),
])
def test_dedup_mistakes_lose_their_cases(edits, reason, lost):
    score = _score(DISPATCH_COMBINE_DEDUP, _function("dispatch_combine_dedup", *edits),
                   world_sizes=(2,))
    assert score.max - score.points == lost, score.failures
    assert all(reason in f for f in score.failures), score.failures
    assert score.weighted() <= score.weight / 2  # each stated rule, broken alone: half lost


def test_dedup_may_use_only_all_to_all_single():
    def gathered(tokens, expert_idx, weights, experts_per_rank, expert_fn, group=None):
        import torch.distributed as dist
        dist.all_reduce(tokens.new_zeros(1))
        return tokens
    score = _score(DISPATCH_COMBINE_DEDUP, gathered, world_sizes=(2,))
    assert score.points == 0 and "not allowed" in score.reason


# ------------------------------------------------------------------ global_balance_loss

def test_the_expected_loss_is_one_for_uniform_routing_and_its_gradient_is_e_f_over_n():
    for world_size in (2, 3):
        for case in make_global_balance_cases(torch.Generator().manual_seed(1), world_size):
            loss, grads = global_loss_and_grads(case.inputs)
            idx = torch.cat([c["expert_idx"] for c in case.inputs])
            E, n = case.inputs[0]["probs"].shape[1], idx.shape[0]
            f = torch.bincount(idx.reshape(-1), minlength=E).double() / idx.numel()
            for g in grads:  # every row: E f_i / N_total, rounded to the case's dtype
                forward(g.dtype).assert_close(g, (E * f / n).expand_as(g), case.name)
            if "uniform" in case.name:  # a float64 sum of fractions that add up to 1
                assert forward(torch.float64).allows(loss.item() - 1.0, 1.0), loss.item()


def test_global_balance_solution_scores_full_marks():
    score = _score(GLOBAL_BALANCE_LOSS, _function("global_balance_loss"))
    # 5 cases on 2 and on 3 ranks, and on 3 two of them again on the subgroup of ranks 1, 2
    assert score.points == score.max == 12, score.failures


LOCAL_MEAN = '''
import torch
import torch.distributed as dist

def global_balance_loss(probs, expert_idx, group=None):
    """Each rank's own loss (what the lecture computes), averaged over the ranks."""
    E = probs.shape[1]
    f = torch.bincount(expert_idx.reshape(-1), minlength=E).to(probs.dtype) / max(expert_idx.numel(), 1)
    own = E * (f * probs.sum(dim=0) / max(probs.shape[0], 1)).sum()
    total = own.detach().clone()
    dist.all_reduce(total, group=group)
    return own - own.detach() + total / dist.get_world_size(group)
'''


def test_a_mean_of_the_ranks_losses_is_another_number():
    namespace = {"__name__": "student"}
    exec(LOCAL_MEAN, namespace)
    score = _score(GLOBAL_BALANCE_LOSS, namespace["global_balance_loss"])
    # Uniform routing is the one case where every rank's own loss is the global one (1); its
    # gradient still differs (each rank divides by its own token count).
    assert score.points == 0, score.failures
    assert any("the global batch's is" in f for f in score.failures)
    assert all("global batch's is" in f or "gradient" in f for f in score.failures)


@pytest.mark.parametrize("edits, reason", [
    # Everything reduced detached: the value is right, the gradient is gone.
    ([("return E * (f * (mine + others) / n_tokens).sum()",
       "return E * (f * totals[E:2 * E] / n_tokens).sum()")], "no gradient"),
    # The other ranks' sums left out of the value: this rank's P only.
    ([("others = totals[E:2 * E] - mine.detach()", "others = 0")], "global batch's is"),
    # Computed in float32 whatever probs are: the float64 case loses.
    ([("mine = probs.sum(dim=0)", "mine = probs.float().sum(dim=0)"),
      ("minlength=E).to(probs.dtype)", "minlength=E).float()"),
      ("probs.new_tensor([probs.shape[0]])", "mine.new_tensor([probs.shape[0]])")],
     "the dtype of probs"),
])
def test_global_balance_mistakes_lose_their_cases(edits, reason):
    score = _score(GLOBAL_BALANCE_LOSS, _function("global_balance_loss", *edits), world_sizes=(2,))
    assert score.points < score.max and all(reason in f for f in score.failures), score.failures
    assert score.weighted() <= score.weight / 2  # each stated rule, broken alone: half lost
    if reason == "the dtype of probs":
        assert score.max - score.points == 1  # only the float64 case


def test_global_balance_may_use_only_all_reduce():
    def gathered(probs, expert_idx, group=None):
        import torch.distributed as dist
        out = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.zeros(1))
        return probs.sum()
    score = _score(GLOBAL_BALANCE_LOSS, gathered, world_sizes=(2,))
    assert score.points == 0 and "not allowed" in score.reason


# ------------------------------------------------------------------ the written question

def test_the_dedup_bytes_question_is_graded_exactly():
    # 8,192 tokens, each on 4 of 32 ranks: 31/32 of 32,768 rows leave, and as many come back.
    assert dedup_all_to_all_bytes_formula(8192, 7168, 8, 32, 4, 2) == 2 * 31_744 * 7168 * 2
    assert dedup_all_to_all_bytes_formula(1040, 512, 2, 1, 1, 4) == 0  # one rank: nothing leaves
    right = _score(DEDUP_ALL_TO_ALL_BYTES, _function("dedup_all_to_all_bytes"))
    assert right.points == right.max == 9, right.failures

    def one_row_per_assignment(tokens, d_model, k, ep, ranks_per_token, bytes_per_element):
        return 2 * (tokens * k * (ep - 1) // ep) * d_model * bytes_per_element
    assert _score(DEDUP_ALL_TO_ALL_BYTES, one_row_per_assignment).points < 9

    def dispatch_only(tokens, d_model, k, ep, ranks_per_token, bytes_per_element):
        return tokens * ranks_per_token * (ep - 1) // ep * d_model * bytes_per_element
    assert _score(DEDUP_ALL_TO_ALL_BYTES, dispatch_only).points == 1  # right only for ep = 1


def test_visible_checks_print_pass_and_fail(capsys):
    from reference.course.checks.expert_parallel import (
        check_dedup_all_to_all_bytes, check_dispatch_combine_dedup, check_global_balance_loss,
    )
    check_dispatch_combine_dedup(_function("dispatch_combine"), world_sizes=(2,))
    check_global_balance_loss(_function("global_balance_loss"), world_sizes=(2,))
    check_global_balance_loss(_function("global_balance_loss", (
        "return E * (f * (mine + others) / n_tokens).sum()",
        "return E * (f * totals[E:2 * E] / n_tokens).sum()")), world_sizes=(2,))
    check_dedup_all_to_all_bytes(lambda **kw: "a lot")
    out = capsys.readouterr().out
    assert "FAIL dispatch_combine_dedup" in out
    assert "hint: more rows were sent than one per (token, rank) pair" in out
    assert "PASS global_balance_loss" in out
    assert "FAIL global_balance_loss" in out and "hint: the loss has no gradient" in out
    assert "FAIL dedup_all_to_all_bytes" in out and "not a number" in out


# ------------------------------------------------------------------ each stated rule, broken alone

WORLD_RANK = ("dist.get_rank(group)", "dist.get_rank()")


@pytest.mark.parametrize("exercise, size, edits, words", [
    # experts live on group ranks: the world's rank runs them where they do not live
    ("dispatch_combine", 4, (WORLD_RANK,), "subgroup"),
    ("dispatch_combine_dedup", 3, (WORLD_RANK,), "subgroup"),
    # the counts over the group: without group= the all-reduce waits for rank 0, not in it
    ("global_balance_loss", 3, (("dist.all_reduce(totals, group=group)", "dist.all_reduce(totals)"),),
     "timed out"),
    # each assignment's row once, by its expert's rank
    ("dispatch_combine", 2, (("        out = expert_fn(",
                              "        expert_fn(rank * E_l + l, torch.cat([blocks[i] for i in mine]))\n"
                              "        out = expert_fn("),), "processed"),
    # differentiable: the tokens' and the weights' gradients
    ("dispatch_combine", 2, (("returned * row_weights", "returned * row_weights.detach()"),),
     "no gradient reached the weights"),
    # (the dtype, the weights, the loss's gradient and dtype: the mistake tests above)
])
def test_each_stated_rule_broken_alone_costs_half_the_exercise(exercise, size, edits, words):
    """An otherwise right answer that breaks one rule the text states, on a world size that
    shows it, keeps at most half of the exercise as the grader weighs it (WRONG_KEEPS)."""
    spec = dataclasses.replace(next(s for s in homework("05_expert_parallel") if s.id == exercise),
                               world_sizes=(size,))
    if words in ("subgroup", "timed out"):
        spec = subgroup_only(spec)
    score = score_exercise(spec, cloudpickle.dumps(_function(exercise, *edits)), seed=5,
                           timeout=3 if words == "timed out" else TIMEOUT)
    assert score.points < score.max and score.weighted() <= score.weight / 2, score.failures
    assert all(words in f for f in score.failures), score.failures
