"""Homework 01's transfer exercises and written question: the solution earns every point,
the usual mistakes lose the cases they should, with the reason they should.

The solution notebook's answer cells and the mistakes written here are scored directly
with `score_exercise` (no notebook run), as a notebook's functions travel: not importable,
so pickled by value."""
import dataclasses
from pathlib import Path

import cloudpickle
import nbformat
import pytest
from solution_cells import solution_function, subgroup_only

from reference.course.homework import homework
from reference.course.homework.data_parallel import ACCUMULATE, DDP_BYTES, INT8
from reference.course.homework.data_parallel_transfer import ddp_bytes_formula
from reference.course.homework.scoring import score_exercise

TIMEOUT = 60  # s per launch (a few needed); only a hanging answer would wait
SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "01_data_parallel.ipynb"
# accumulate_gradients: 5 cases (equal micro-batches; uneven sizes; different sample counts;
# a rank with none; float64 with a frozen layer) on 2 and 3 ranks.
# int8_all_reduce: 6 cases (float32 (1,), (7,), (3, 5); float64 (6,); zeros; one rank
# 100 times smaller) on 2 and 3 ranks. On 3 ranks each has 2 more on the subgroup of ranks 1, 2
# (different sample counts and a rank with none; float32 (7,) and one rank 100 times smaller).

MISTAKES = r'''
import torch
import torch.distributed as dist


def mean_of_rank_means(module, micro_batches, group=None):
    """The lecture's recipe: each micro-batch's mean loss / K, then the mean over ranks."""
    k, loss_sum = len(micro_batches), 0.0
    for x, y in micro_batches:
        loss = torch.nn.functional.mse_loss(module(x), y) / k
        loss.backward()
        loss_sum += loss.item()
    for p in module.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)
    total = torch.tensor([loss_sum], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return total.item() / dist.get_world_size(group)


def one_backward_for_all(module, micro_batches, group=None):
    """The right numbers, from one backward over the micro-batches put together."""
    params = [p for p in module.parameters() if p.requires_grad]
    loss_sum, count = 0.0, 0
    if micro_batches:
        x = torch.cat([x for x, _ in micro_batches])
        y = torch.cat([y for _, y in micro_batches])
        loss = ((module(x) - y) ** 2).mean(dim=-1).sum()
        loss.backward()
        loss_sum, count = loss.item(), x.shape[0]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params] + [torch.tensor([loss_sum, count], dtype=params[0].dtype)])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad = (flat[offset:offset + p.numel()] / flat[-1]).view_as(p).clone()
        offset += p.numel()
    return (flat[-2] / flat[-1]).item()


def syncs_every_micro_batch(module, micro_batches, group=None):
    """The right sums, with an all-reduce after each micro-batch's backward."""
    params = [p for p in module.parameters() if p.requires_grad]
    loss_sum, count = 0.0, 0
    for x, y in micro_batches:
        loss = ((module(x) - y) ** 2).mean(dim=-1).sum()
        loss.backward()
        dist.all_reduce(torch.ones(1), group=group)  # "are we all here?": not needed, and too early
        loss_sum, count = loss_sum + loss.item(), count + x.shape[0]
    flat = torch.cat([p.grad.reshape(-1) for p in params]
                     + [torch.tensor([loss_sum, count], dtype=params[0].dtype)])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad = (flat[offset:offset + p.numel()] / flat[-1]).view_as(p).clone()
        offset += p.numel()
    return (flat[-2] / flat[-1]).item()


def _int8(grad, residual, group, feedback=True, shared_scale=True, levels=None, payload=torch.int8):
    p = dist.get_world_size(group)
    levels = levels or 127 // p
    v = grad + residual if feedback else grad.clone()
    top = v.abs().max().reshape(1)
    if shared_scale:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    scale = top[0] / levels if top[0] > 0 else torch.ones((), dtype=v.dtype)
    q = torch.round(v / scale).to(payload)
    sent = q.to(v.dtype) * scale
    dist.all_reduce(q, group=group)
    return q.to(v.dtype) * scale / p, v - sent


def no_feedback(grad, residual, group=None):  # the residual is returned, never added back
    return _int8(grad, residual, group, feedback=False)


def own_scale(grad, residual, group=None):  # each rank its own max: the sum mixes scales
    return _int8(grad, residual, group, shared_scale=False)


def float_payload(grad, residual, group=None):  # right numbers, but 4 or 8 bytes per value
    return _int8(grad, residual, group, payload=grad.dtype)


def forgets_no_sync(n_params, world_size, bytes_per_element, accumulation_steps, no_sync):
    return accumulation_steps * 2 * (world_size - 1) * -(-n_params // world_size) * bytes_per_element
'''


def _solution() -> dict:
    """The solution notebook's setup and answer cells, run as a student's kernel would."""
    namespace = {"__name__": "homework_under_test"}
    for cell in nbformat.read(SOLUTION, 4).cells:
        if cell.get("id") == "setup" or "exercise" in cell.metadata.get("course", {}):
            exec(cell.source, namespace)
    return namespace


def _mistakes() -> dict:
    namespace = {"__name__": "homework_under_test"}
    exec(MISTAKES, namespace)
    return namespace


def _score(spec, fn, seed=7):
    return score_exercise(spec, cloudpickle.dumps(fn), seed=seed, timeout=TIMEOUT)


def test_homework_01_has_its_warm_up_buckets_two_transfers_and_a_question():
    assert [s.id for s in homework("01_data_parallel")] == [
        "average_gradients", "bucketed_all_reduce", "accumulate_gradients", "int8_all_reduce",
        "ddp_bytes_per_step"]


def test_the_cases_hold_what_the_exercise_promises():
    import torch
    for ws in (2, 3):
        cases = {c.name: c.inputs for c in ACCUMULATE.make_cases(torch.Generator().manual_seed(1), ws)
                 if "subgroup" not in c.name}
        counts = {name: [sum(len(x) for x, _ in rank["batches"][0]) for rank in per_rank]
                  for name, per_rank in cases.items()}
        assert len(set(counts["equal micro-batches"])) == 1
        assert counts["a rank with no micro-batch"][-1] == 0 < sum(counts["a rank with no micro-batch"])
        assert cases["float64, frozen first layer"][0]["dtype"] == "float64"
        sizes = [len(x) for x, _ in cases["micro-batches of different sizes"][0]["batches"][0]]
        assert sizes[0] < sizes[1]


def test_accumulate_solution_scores_full_marks():
    score = _score(ACCUMULATE, _solution()["accumulate_gradients"])
    assert score.points == score.max == 12, score.failures  # 2 of them on the subgroup 1, 2


def test_accumulate_mean_of_means_is_right_only_for_equal_micro_batches():
    score = _score(ACCUMULATE, _mistakes()["mean_of_rank_means"])
    assert score.points == 2, score.failures  # "equal micro-batches", on 2 and 3 ranks
    assert all("equal micro-batches" not in line for line in score.failures)


def test_accumulate_one_backward_for_everything_loses_every_case():
    score = _score(ACCUMULATE, _mistakes()["one_backward_for_all"])
    assert score.points == 0 and "backward passes for 2 micro-batches" in score.reason, score.failures


def test_accumulate_communicating_before_the_last_backward_is_seen():
    # Only where every rank runs as many micro-batches: elsewhere this answer would hang.
    def equal_only(generator, world_size):
        return [c for c in ACCUMULATE.make_cases(generator, world_size)
                if c.name == "equal micro-batches"]
    spec = dataclasses.replace(ACCUMULATE, make_cases=equal_only, world_sizes=(2,))
    score = _score(spec, _mistakes()["syncs_every_micro_batch"])
    assert score.points == 0 and "an all-reduce before the last micro-batch's backward" in score.reason


def test_int8_solution_scores_full_marks():
    score = _score(INT8, _solution()["int8_all_reduce"])
    assert score.points == score.max == 14, score.failures  # 2 of them on the subgroup 1, 2


@pytest.mark.parametrize("name, points, reason", [
    # Step 0 has no residual yet: wrong from step 1, but for the zeros (2 ranks, 3 ranks).
    ("no_feedback", 2, "step 1: wrong mean"),
    ("own_scale", 2, "step 0: wrong mean"),
    ("float_payload", 0, "expected the"),
])
def test_int8_mistakes_lose_their_cases(name, points, reason):
    score = _score(INT8, _mistakes()[name])
    assert score.points == points, score.failures
    assert reason in score.reason, score.reason


def test_ddp_bytes_is_graded_exactly():
    # 1,000 on 3 ranks: chunks of ceil(1000 / 3) = 334; 8 micro-batches without no_sync.
    assert ddp_bytes_formula(1_000, 3, 4, 8, False) == 8 * 2 * 2 * 334 * 4
    assert ddp_bytes_formula(1_000, 1, 2, 4, True) == 0
    right = _score(DDP_BYTES, _solution()["ddp_bytes_per_step"])
    assert right.points == right.max == 9, right.failures
    wrong = _score(DDP_BYTES, _mistakes()["forgets_no_sync"])
    assert 0 < wrong.points < 9 and "wrong number" in wrong.reason


def test_visible_checks_pass_the_solution_and_explain_a_mistake(capsys):
    from reference.course.checks.data_parallel import (
        check_accumulate_gradients, check_ddp_bytes_per_step, check_int8_all_reduce,
    )
    solution = _solution()
    check_accumulate_gradients(solution["accumulate_gradients"])
    check_int8_all_reduce(solution["int8_all_reduce"])
    check_ddp_bytes_per_step(solution["ddp_bytes_per_step"])
    check_int8_all_reduce(_mistakes()["float_payload"])
    out = capsys.readouterr().out
    assert "PASS accumulate_gradients" in out and "PASS int8_all_reduce" in out
    assert "PASS ddp_bytes_per_step" in out
    assert "FAIL int8_all_reduce" in out and "as a torch.int8 tensor" in out


@pytest.mark.parametrize("spec, world_size", [(ACCUMULATE, 3), (INT8, 3),
                                              (homework("01_data_parallel")[1], 2)],
                         ids=lambda v: getattr(v, "id", str(v)))
def test_the_course_answers_the_grader_refuses_answer_the_exercise(spec, world_size):
    """The course's own answer (banned[0]), run under the exercise's rules but without the
    refusal, passes every case: it is the answer the grader refuses, not another one."""
    import torch
    import torch.distributed as dist

    from reference.course.homework.guard import exercise_rules
    from reference.course.homework.refuse import resolve
    from reference.runtime import launch

    cases = spec.make_cases(torch.Generator().manual_seed(0), world_size)
    course = resolve(spec.banned[0])

    def rank_outputs():
        with exercise_rules(spec.id, spec.forbidden):
            return [spec.call(course, c.inputs[dist.get_rank()]) for c in cases]

    per_rank = launch(rank_outputs, world_size, quiet=True)
    reasons = [spec.judge(c.inputs, spec.expect(c.inputs), [r[i] for r in per_rank], world_size)
               for i, c in enumerate(cases)]
    assert reasons and all(r == "" for r in reasons), reasons


# ------------------------------------------------------------------ each stated rule, broken alone

def _variant(exercise: str, *edits: tuple):
    """The solution's answer to `exercise` with each (old, new) edit made: one rule broken."""
    return solution_function("01_data_parallel", exercise, *edits, every=True)


WORLD_SIZE_NOT_THE_GROUPS = ("dist.get_world_size(group)", "dist.get_world_size()")


@pytest.mark.parametrize("exercise, size, edits, words", [
    # the mean over the group's ranks, not over the world's
    ("average_gradients", 4, (WORLD_SIZE_NOT_THE_GROUPS,), "subgroup"),
    ("bucketed_all_reduce", 4, (WORLD_SIZE_NOT_THE_GROUPS,), "subgroup"),
    ("int8_all_reduce", 3, (WORLD_SIZE_NOT_THE_GROUPS,), "subgroup"),
    # the all-reduce over the group: without group= it waits for rank 0, which is not in it
    ("accumulate_gradients", 3, (("dist.all_reduce(flat, group=group)", "dist.all_reduce(flat)"),),
     "timed out"),
    # frozen parameters keep grad None
    ("average_gradients", 2, (("        if p.grad is None:  # frozen: nothing to average, and every rank skips it alike\n"
                               "            continue",
                               "        if p.grad is None:\n            p.grad = torch.zeros_like(p)"),),
     "got a gradient"),
    # at most the gradients and two more numbers all-reduced
    ("accumulate_gradients", 2, (("dist.all_reduce(flat, group=group)",
                                  "dist.all_reduce(flat, group=group)\n"
                                  "    dist.all_reduce(torch.zeros(3, dtype=flat.dtype), group=group)"),),
     "the gradients and two numbers"),
    # grad and residual left unchanged
    ("int8_all_reduce", 2, (("v = grad + residual", "v = grad.add_(residual)"),), "changed grad or residual"),
    # (the values sent as int8: float_payload in test_int8_mistakes_lose_their_cases)
])
def test_each_stated_rule_broken_alone_costs_half_the_exercise(exercise, size, edits, words):
    """An otherwise right answer that breaks one rule the text states, on a world size that
    shows it, keeps at most half of the exercise as the grader weighs it (WRONG_KEEPS)."""
    spec = dataclasses.replace(next(s for s in homework("01_data_parallel") if s.id == exercise),
                               world_sizes=(size,))
    if words in ("subgroup", "timed out"):
        spec = subgroup_only(spec)
    fn = _variant(exercise, *edits)
    score = score_exercise(spec, cloudpickle.dumps(fn), seed=7,
                           timeout=3 if words == "timed out" else TIMEOUT)
    assert score.points < score.max and score.weighted() <= score.weight / 2, score.failures
    assert all(words in f for f in score.failures), score.failures
