"""The hidden checks of homework 01 and 02 take points from wrong answers, with the right reason.

Each wrong answer is the solution with one mistake, scored directly with
`score_exercise` (no notebook run): forgetting to divide by the world size, one
all-reduce per parameter instead of per bucket, all-reducing after backward instead
of from hooks, a forbidden collective, and for ZeRO-1 an optimizer over all the
parameters instead of the shard, and a sum where a mean is needed.
"""
from __future__ import annotations

import cloudpickle
import pytest

from reference.course.homework import score_exercise
from reference.course.homework.data_parallel import AVERAGE_GRADIENTS, BUCKETED
from reference.course.homework.zero import ZERO1

TIMEOUT = 30  # s per launch; a launch needs about 1 s

COMMON = """
import torch
import torch.distributed as dist
"""

AVERAGE = COMMON + """
def average_gradients(module, group=None):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(DIVISOR or dist.get_world_size(group))
"""

BUCKETS = COMMON + """
def bucketed_all_reduce(module, bucket_bytes, accumulation_steps=1, group=None):
    world_size = dist.get_world_size(group)
    buckets, nbytes = [], 0
    for p in reversed([p for p in module.parameters() if p.requires_grad]):
        size = p.numel() * p.element_size()
        if not buckets or nbytes + size > CAP(bucket_bytes):
            buckets.append([])
            nbytes = 0
        buckets[-1].append(p)
        nbytes += size
    state = {"fired": {}, "ready": [0] * len(buckets), "next": 0, "launched": []}

    def launch_ready():
        while state["next"] < len(buckets) and state["ready"][state["next"]] == len(buckets[state["next"]]):
            bucket = buckets[state["next"]]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            state["launched"].append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
            state["next"] += 1

    def make_hook(i):
        def hook(param):
            state["fired"][param] = state["fired"].get(param, 0) + 1
            if state["fired"][param] < (1 if EVERY_BACKWARD else accumulation_steps):
                return
            state["ready"][i] += 1
            if not LATE:
                launch_ready()
        return hook

    for i, bucket in enumerate(buckets):
        for p in bucket:
            p.register_post_accumulate_grad_hook(make_hook(i))

    @torch.no_grad()
    def finish():
        if LATE:
            launch_ready()
        for bucket, flat, work in state["launched"]:
            work.wait()
            flat.div_(world_size)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        state.update(fired={}, ready=[0] * len(buckets), next=0, launched=[])
    return finish
"""

ZERO = COMMON + """
def zero1_optimizer(params, optimizer_class, group=None, **optimizer_kwargs):
    params = list(params)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = sum(p.numel() for p in params)
    s = -(-numel // n)
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts] + [ts[0].new_zeros(n * s - numel)])
    with torch.no_grad():
        start = flat([p.detach() for p in params])
    shard = torch.nn.Parameter((start if WHOLE else start[rank * s:(rank + 1) * s]).clone())
    inner = optimizer_class([shard], **optimizer_kwargs)

    @torch.no_grad()
    def step():
        grads = flat([p.grad for p in params])
        if WHOLE:  # plain data parallelism: all-reduce, every rank updates everything
            dist.all_reduce(grads, op=OP, group=group)
            shard.grad = grads / n
            inner.step()
            full = shard.detach()
        else:
            shard.grad = torch.empty_like(shard)
            dist.reduce_scatter_tensor(shard.grad, grads, op=OP, group=group)
            inner.step()
            full = torch.empty(n * s)
            dist.all_gather_into_tensor(full, shard.detach().clone(), group=group)
        offset = 0
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    return step, inner
"""


def _student(source: str, name: str, **constants) -> bytes:
    namespace = {"__name__": "student"}  # not importable: pickled by value, like a notebook's
    exec(source, namespace)
    namespace.update(constants)
    return cloudpickle.dumps(namespace[name])


def _score(spec, source, **constants):
    return score_exercise(spec, _student(source, spec.id, **constants), seed=7, timeout=TIMEOUT)


def test_average_gradients_full_marks_and_the_missing_division():
    right = _score(AVERAGE_GRADIENTS, AVERAGE, DIVISOR=None)
    assert right.points == right.max > 0, right.failures
    summed = _score(AVERAGE_GRADIENTS, AVERAGE, DIVISOR=1)
    assert summed.points == 0 and "divide by the world size" in summed.reason


def test_average_gradients_may_not_use_another_collective():
    source = AVERAGE.replace("dist.all_reduce(p.grad, group=group)",
                             "dist.broadcast(p.grad, src=0, group=group)")
    score = _score(AVERAGE_GRADIENTS, source, DIVISOR=None)
    assert score.points == 0 and "broadcast is not allowed" in score.reason


RIGHT = {"CAP": lambda b: b, "LATE": False, "EVERY_BACKWARD": False}


@pytest.mark.parametrize("mistake, constants, points, reason", [
    ("none", RIGHT, "all", ""),
    # One bucket per parameter: right gradients, wrong number of all-reduces, except in
    # the case where the cap already gives one parameter per bucket.
    ("per parameter", {**RIGHT, "CAP": lambda b: 1}, "one case per size", "all-reduce sizes"),
    ("after backward", {**RIGHT, "LATE": True}, 0, "not inside the step's last backward"),
    # The lecture's buckets: launched in every backward, so in the first of K micro-batches:
    # right only in the case without accumulation.
    ("every backward", {**RIGHT, "EVERY_BACKWARD": True}, "one case per size",
     "did not yet hold every micro-batch"),
])
def test_bucketed_checks_count_size_and_timing(mistake, constants, points, reason):
    score = _score(BUCKETED, BUCKETS, **constants)
    if points == "all":
        assert score.points == score.max > 0, score.failures
        return
    expected = len(BUCKETED.world_sizes) if points == "one case per size" else points
    assert score.points == expected, score.failures
    assert reason in score.reason
    if mistake == "every backward":  # the lecture's buckets lose most of the exercise
        assert score.weighted() <= score.weight / 2


def test_bucketed_gradients_must_be_the_mean():
    source = BUCKETS.replace("flat.div_(world_size)", "pass")
    score = _score(BUCKETED, source, **RIGHT)
    assert score.points == 0 and "divide by the world size" in score.reason


def test_zero1_full_marks_and_wrong_answers_lose_points():
    import torch.distributed as dist

    right = _score(ZERO1, ZERO, WHOLE=False, OP=dist.ReduceOp.AVG)
    assert right.points == right.max > 0, right.failures
    # Unsharded optimizer: right parameters, but state for every number on every rank.
    whole = _score(ZERO1, ZERO, WHOLE=True, OP=dist.ReduceOp.SUM)
    assert whole.points == 0 and "this rank's shard" in whole.reason
    # A sum instead of a mean: SGD moves N times too far, but AdamW, nearly blind to the
    # gradient's scale, trains almost the same parameters (it used to keep 6 of 8 cases).
    # The shard's gradient, checked after every step, tells them apart in every case.
    summed = _score(ZERO1, ZERO, WHOLE=False, OP=dist.ReduceOp.SUM)
    assert summed.weighted() <= summed.weight / 2, summed.failures
    assert summed.points == 0 and "summed instead of averaged" in summed.reason, summed.reason
