"""Homework 02's transfer exercises and written question: right answers earn every point,
the usual mistakes lose the cases they should, for the reason they should.

The answers are graded as the grader does it (`score_exercise`), as functions pickled by
value like a notebook's (defined in a namespace no process can import)."""
import dataclasses

import cloudpickle
import pytest
import torch
from solution_cells import subgroup_only

from reference.course.homework import homework
from reference.course.homework.scoring import score_exercise
from reference.course.homework.zero import ZERO1
from reference.course.homework.zero_transfer import (
    CLIP, FSDP_SCHEDULE, ZERO_MAX_PARAMS, course_fsdp_schedule, fits, simulate,
    zero_max_params_formula,
)

TIMEOUT = 60  # s per launch (a few s needed); only a hanging answer would wait

STUDENT = r'''
import math

import torch
import torch.distributed as dist


def clip(grad_shard, numel, max_norm, norm_type=2.0, group=None, padding=False, local=False,
         inf_by_sum=False, out_of_place=False, world_rank=False):
    rank = dist.get_rank() if world_rank else dist.get_rank(group)
    n_real = grad_shard.numel() if padding else max(0, min(grad_shard.numel(), numel - rank * grad_shard.numel()))
    real = grad_shard[:n_real]
    g = real.detach().double()
    if norm_type == math.inf and not inf_by_sum:
        total = g.abs().max() if g.numel() else torch.zeros((), dtype=torch.float64)
        if not local:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        total = total.item()
    else:
        total = g.pow(2).sum()
        if not local:
            dist.all_reduce(total, group=group)
        total = math.sqrt(total.item())
    coef = min(1.0, max_norm / (total + 1e-6))
    if out_of_place:
        grad_shard = grad_shard * coef
    else:
        real.mul_(coef)
    return total


def clip_right(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    return clip(grad_shard, numel, max_norm, norm_type, group)


def clip_counts_padding(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    return clip(grad_shard, numel, max_norm, norm_type, group, padding=True)


def clip_local_norm(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    return clip(grad_shard, numel, max_norm, norm_type, group, local=True)


def clip_inf_by_sum(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    return clip(grad_shard, numel, max_norm, norm_type, group, inf_by_sum=True)


def clip_not_in_place(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    return clip(grad_shard, numel, max_norm, norm_type, group, out_of_place=True)


def clip_course(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    from reference.course.homework.zero_transfer import course_clip_sharded_grad_norm_
    return course_clip_sharded_grad_norm_(grad_shard, numel, max_norm, norm_type, group)


def clip_reference_package(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    import reference.parallel.clip as clip_module
    grad_shard.data_parallel_shard = True
    return float(clip_module.clip_grad_norm_([grad_shard], max_norm, norm_type=norm_type))


def schedule(n_units, max_whole, prefetch=True, keep_last=True, rs_late=False, free_late=False):
    comps = [("forward", u) for u in range(n_units)] + [("backward", u) for u in reversed(range(n_units))]
    actions, whole = [], []
    for j, (op, unit) in enumerate(comps):
        need = []
        for _, u in comps[j:]:
            if len(need) == (max_whole if prefetch else 1):
                break
            if u not in need:
                need.append(u)
        if not keep_last and op == "backward" and unit == n_units - 1 and j == n_units:
            actions += [("free", unit), ("gather", unit)]
        for u in list(whole):
            if u not in need and not free_late:
                actions.append(("free", u))
                whole.remove(u)
        for u in need:
            if u not in whole:
                actions.append(("gather", u))
                whole.append(u)
        actions.append((op, unit))
        if op == "backward" and not rs_late:
            actions.append(("reduce_scatter", unit))
    if rs_late:
        actions += [("reduce_scatter", u) for u in range(n_units)]
    return actions + [("free", u) for u in whole]


def schedule_right(n_units, max_whole):
    return schedule(n_units, max_whole)


def schedule_no_prefetch(n_units, max_whole):
    return schedule(n_units, max_whole, prefetch=False)


def schedule_regathers_last(n_units, max_whole):
    return schedule(n_units, max_whole, keep_last=False)


def schedule_reduces_at_the_end(n_units, max_whole):
    return schedule(n_units, max_whole, rs_late=True)


def schedule_never_frees_early(n_units, max_whole):
    return schedule(n_units, max_whole, free_late=True)


def schedule_backward_in_forward_order(n_units, max_whole):
    """Backward run 0 .. n-1, as forward was: the gradients need n-1 .. 0."""
    actions = schedule(n_units, max_whole)
    backward = [a for a in actions if a[0] == "backward"]
    order = iter(sorted(backward, key=lambda a: a[1]))
    return [next(order) if a[0] == "backward" else a for a in actions]


def schedule_reduces_twice(n_units, max_whole):
    return schedule(n_units, max_whole) + [("reduce_scatter", 0)]


def schedule_keeps_the_last_whole(n_units, max_whole):
    """Forgets to free what is still whole after the last backward."""
    actions = schedule(n_units, max_whole)
    while actions and actions[-1][0] == "free":
        actions.pop()
    return actions


def schedule_frees_after_each_forward(n_units, max_whole):
    """Frees every unit right after its forward, and never gathers the last one again."""
    actions = []
    for op, unit in schedule(n_units, max_whole):
        actions.append((op, unit))
        if (op, unit) == ("forward", n_units - 1):
            actions.append(("free", unit))
    last = max(i for i, a in enumerate(actions) if a == ("free", n_units - 1))
    return actions[:last] + actions[last + 1:]  # its last free would free it twice


def schedule_gathers_twice(n_units, max_whole):
    """Gathers the first unit again before its forward, although it is already whole."""
    actions = schedule(n_units, max_whole)
    first = actions.index(("gather", 0))
    return actions[:first + 1] + [("gather", 0)] + actions[first + 1:]


def schedule_frees_twice(n_units, max_whole):
    """Frees the last unit once more at the end, when it is no longer whole."""
    return schedule(n_units, max_whole) + [("free", 0)]


def max_params(memory_bytes, n, stage, k):
    if stage == 0:
        return memory_bytes // (4 + k)
    return n * (memory_bytes // {1: 4 * n + k, 2: 2 * n + 2 + k, 3: 4 + k}[stage])


def max_params_no_padding(memory_bytes, n, stage, k):
    per = {0: 4 + k, 1: 4 + k / n, 2: 2 + (2 + k) / n, 3: (4 + k) / n}[stage]
    return int(memory_bytes // per)


def _zero1(rank_of):
    """A ZeRO-1 answer whose shard index is ``rank_of(group)``."""
    def zero1(params, optimizer_class, group=None, **kwargs):
        params = list(params)
        n, rank = dist.get_world_size(group), rank_of(group)
        numel = sum(p.numel() for p in params)
        size = -(-numel // n)
        flat = lambda ts: torch.cat([t.reshape(-1) for t in ts] + [ts[0].new_zeros(n * size - numel)])
        shard = torch.nn.Parameter(flat([p.detach() for p in params])[rank * size:(rank + 1) * size].clone())
        inner = optimizer_class([shard], **kwargs)

        @torch.no_grad()
        def step():
            shard.grad = torch.empty_like(shard)
            dist.reduce_scatter_tensor(shard.grad, flat([p.grad for p in params]), op=dist.ReduceOp.AVG,
                                       group=group)
            inner.step()
            full = torch.empty(n * size)
            dist.all_gather_into_tensor(full, shard.detach().clone(), group=group)
            offset = 0
            for p in params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return step, inner
    return zero1


zero1_right = _zero1(lambda group: dist.get_rank(group))
# The world's rank where the group's is meant (modulo the group's size, to stay a shard
# index): right on the whole world only.
zero1_world_rank = _zero1(lambda group: dist.get_rank() % dist.get_world_size(group))


def clip_world_rank(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    """The world's rank where the group's is meant: on a subgroup, another shard's numbers."""
    return clip(grad_shard, numel, max_norm, norm_type, group, world_rank=True)


def zero1_course(params, optimizer_class, group=None, **kwargs):
    from reference.course.homework.zero import course_zero1_optimizer
    return course_zero1_optimizer(params, optimizer_class, group, **kwargs)


def zero1_package(params, optimizer_class, group=None, **kwargs):
    from reference.zero import ZeroOptimizer
    opt = ZeroOptimizer(params, optimizer_class, stage=1, group=group, **kwargs)
    return opt.step, opt
'''


def _student(name):
    namespace = {"__name__": "student"}  # not importable: pickled by value, like a notebook's
    exec(STUDENT, namespace)
    return cloudpickle.dumps(namespace[name])


def _score(spec, name, world_sizes=None, seed=11):
    spec = {s.id: s for s in homework("02_zero_fsdp")}[spec.id]  # as graded: WRONG_KEEPS
    if world_sizes:
        spec = dataclasses.replace(spec, world_sizes=world_sizes)
    return score_exercise(spec, _student(name), seed=seed, timeout=TIMEOUT)


def test_homework_02_has_its_warm_up_two_transfers_a_question_and_fully_shard():
    assert [s.id for s in homework("02_zero_fsdp")] == [
        "zero1_optimizer", "clip_sharded_grad_norm_", "fsdp_schedule", "zero_max_params", "wrap_tiny_lm"]
    for spec in homework("02_zero_fsdp"):  # the course's own answer is named first
        assert spec.banned and spec.banned[0].startswith("reference.course.homework.zero")


# ------------------------------------------------------------------ clipping

def test_clip_right_answer_scores_full_marks():
    score = _score(CLIP, "clip_right")
    # 5 cases on 2 and on 3 ranks, and on 3 two of them again on the subgroup of ranks 1, 2
    assert score.points == score.max == 12, score.failures


@pytest.mark.parametrize("name, lost, reason", [
    # Every case but "max_norm not reached" (Psi divides by N there) has padding; the two on
    # the subgroup (Psi not divisible; one number) too.
    ("clip_counts_padding", 6, "the padding was counted"),
    # Each rank clips by its own shard's norm: wrong everywhere.
    ("clip_local_norm", 7, "norm"),
    # The inf-norm is a max: a sum of squares is the 2-norm.
    ("clip_inf_by_sum", 1, "norm"),
    # The scaled copy is thrown away: wrong wherever the clip acts (all but one case).
    ("clip_not_in_place", 6, "left unchanged"),
])
def test_clip_mistakes_lose_their_cases(name, lost, reason):
    score = _score(CLIP, name, world_sizes=(3,))
    assert score.max - score.points == lost, score.failures
    assert all(reason in line for line in score.failures), score.failures
    assert score.weighted() <= score.weight / 2  # each stated rule, broken alone: half lost


@pytest.mark.parametrize("name", ["clip_course", "clip_reference_package"])
def test_clip_refuses_the_course_answers(name):
    score = _score(CLIP, name, world_sizes=(2,))
    assert score.points == 0 and "calls the course's reference implementation" in score.reason


# ------------------------------------------------------------------ the FSDP schedule

@pytest.mark.parametrize("n, k", [(n, k) for n in range(1, 8) for k in range(1, 6)])
def test_the_course_schedule_is_valid_and_holds_at_most_max_whole(n, k):
    actions = course_fsdp_schedule(n, k)
    assert simulate(actions, n, k) == ""
    assert sum(op == "gather" for op, _ in actions) == n + sum(u < n - k for u in range(n))
    whole, peak = set(), 0
    for op, unit in actions:
        whole = whole | {unit} if op == "gather" else whole - {unit} if op == "free" else whole
        peak = max(peak, len(whole))
    assert peak == min(k, n)


def test_the_schedule_of_the_lecture_picture():
    # Three blocks, two whole at most: block 1 is fetched while block 0 computes, and
    # blocks 2 and 1 stay whole from the end of forward into backward.
    assert course_fsdp_schedule(3, 2) == [
        ("gather", 0), ("gather", 1), ("forward", 0), ("free", 0), ("gather", 2), ("forward", 1),
        ("forward", 2), ("backward", 2), ("reduce_scatter", 2), ("free", 2), ("gather", 0),
        ("backward", 1), ("reduce_scatter", 1), ("free", 1), ("backward", 0), ("reduce_scatter", 0),
        ("free", 0)]


def test_schedule_right_answer_scores_full_marks():
    score = _score(FSDP_SCHEDULE, "schedule_right")
    assert score.points == score.max == 7, score.failures


@pytest.mark.parametrize("name, points, reason", [
    # Without prefetch only max_whole 1 is right (1 case of 7); n_units=1 too (nothing to fetch).
    ("schedule_no_prefetch", 2, "prefetch"),
    # Freeing the last unit after its forward and gathering it again for its backward: one
    # gather more than needed, in every case.
    ("schedule_regathers_last", 0, "gathers where"),
    # Gradients reduce-scattered only at the end: wrong wherever a backward follows another
    # (all but the one-unit case).
    ("schedule_reduces_at_the_end", 1, "not reduce-scattered yet"),
    # Nothing freed until the end: over max_whole wherever n_units > max_whole (all but the
    # one-unit case and n_units=2, max_whole=4).
    ("schedule_never_frees_early", 2, "units whole at once"),
])
def test_schedule_mistakes_lose_their_cases(name, points, reason):
    score = _score(FSDP_SCHEDULE, name)
    assert score.points == points, score.failures
    assert all(reason in line for line in score.failures), score.failures
    assert score.weighted() <= score.weight / 2  # each stated rule, broken alone: half lost


# ------------------------------------------------------------------ the written question

def test_zero_max_params_formula_is_the_largest_that_fits():
    for memory in (1_000, 999_999_937, 80_000_000_000):
        for n in (1, 2, 3, 8, 64):
            for stage in range(4):
                for k in (12, 4):
                    psi = zero_max_params_formula(memory, n, stage, k)
                    assert fits(psi, memory, n, stage, k) and not fits(psi + 1, memory, n, stage, k)
    assert zero_max_params_formula(1_000, 3, 2, 12) == 150  # S = 1000 // (2*3 + 2 + 12) = 50


def test_zero_max_params_is_graded_exactly():
    right = _score(ZERO_MAX_PARAMS, "max_params")
    assert right.points == right.max == 8, right.failures
    # The paper's formula without padding overestimates wherever N does not divide Psi.
    wrong = _score(ZERO_MAX_PARAMS, "max_params_no_padding")
    assert wrong.points < right.max - 1, wrong.failures


# ------------------------------------------------------------------ the warm-up's banned list

def test_zero1_right_answer_still_scores_and_the_course_versions_are_refused():
    right = _score(ZERO1, "zero1_right", world_sizes=(2,))
    assert right.points == right.max == 4, right.failures
    for name in ("zero1_course", "zero1_package"):
        refused = _score(ZERO1, name, world_sizes=(2,))
        assert refused.points == 0 and "calls the course's reference implementation" in refused.reason


def test_visible_checks_print_pass_and_fail(capsys):
    from reference.course.checks.zero import (
        check_clip_sharded_grad_norm_, check_fsdp_schedule, check_zero_max_params)
    namespace = {"__name__": "student"}
    exec(STUDENT, namespace)
    check_clip_sharded_grad_norm_(namespace["clip_counts_padding"])
    check_fsdp_schedule(namespace["schedule_right"])
    check_fsdp_schedule(namespace["schedule_no_prefetch"])
    check_zero_max_params(lambda **kw: 1.0)
    out = capsys.readouterr().out
    assert "FAIL clip_sharded_grad_norm_" in out and "numel" in out
    assert "PASS fsdp_schedule" in out and "FAIL fsdp_schedule" in out
    assert "FAIL zero_max_params" in out and "whole number" in out


# ------------------------------------------------------------------ each stated rule, broken alone

@pytest.mark.parametrize("exercise, name, sizes, words", [
    # ranks within the group: the world's rank takes another rank's shard there
    ("zero1_optimizer", "zero1_world_rank", (4,), "subgroup"),
    ("clip_sharded_grad_norm_", "clip_world_rank", (3,), "subgroup"),
    # the schedule's rules (simulate) that test_schedule_mistakes_lose_their_cases leaves out
    # (at most max_whole whole, prefetch, reduce-scatter right after the backward, no more
    # gathers than needed): the computations in order; a unit whole when it computes, gathered
    # only when not whole, freed only when whole; a gradient reduce-scattered once; nothing
    # whole at the end. (The clip's rules: test_clip_mistakes_lose_their_cases.)
    ("fsdp_schedule", "schedule_backward_in_forward_order", (1,), "the next computation is"),
    ("fsdp_schedule", "schedule_frees_after_each_forward", (1,), "is not whole"),
    ("fsdp_schedule", "schedule_gathers_twice", (1,), "is already whole"),
    ("fsdp_schedule", "schedule_frees_twice", (1,), "is not whole"),
    ("fsdp_schedule", "schedule_reduces_twice", (1,), "reduce-scatter once per unit"),
    ("fsdp_schedule", "schedule_keeps_the_last_whole", (1,), "still whole at the end"),
])
def test_each_stated_rule_broken_alone_costs_half_the_exercise(exercise, name, sizes, words):
    """An otherwise right answer that breaks one rule the text states keeps at most half of
    the exercise as the grader weighs it (WRONG_KEEPS)."""
    spec = dataclasses.replace(next(s for s in homework("02_zero_fsdp") if s.id == exercise),
                               world_sizes=sizes)
    if words == "subgroup":
        spec = subgroup_only(spec)
    score = score_exercise(spec, _student(name), seed=11, timeout=TIMEOUT)
    assert score.points < score.max and score.weighted() <= score.weight / 2, score.failures
    assert all(words in f for f in score.failures), score.failures
