"""Hidden checks of homework 03's dropout exercise: masks that agree where the ranks hold
copies and differ where they hold shards.

``make_tp_dropout(seed, tp_group)`` is called on every rank right after
``torch.manual_seed(seed)`` (the same seed everywhere) and returns
``dropout(x, p, sharded)``. The grader calls it on a sequence of tensors, some replicated
(the same x on every rank), some sharded (each rank its own), then judges what only the
masks can show, with no assumption on how the student draws them:

* every output is dropout's: each element 0 or x / (1 - p), within the rtol of
  `reference.tolerance.forward()` (float32 and float64: a scale held in float32 is still
  dropout's) or of `forward(torch.bfloat16)` (bfloat16 rounds x * (1 / (1 - p)) to 8
  significant bits), with no atol (a product's rounding is relative to itself); and each
  rank keeps a fraction of the elements within 6 standard deviations of 1 - p (a false
  alarm about once in 10^9 checks);
* replicated calls drop the same elements on every rank;
* sharded calls are independent: two ranks' masks, two sharded calls of one rank, and a
  sharded mask against a replicated one of the same shape agree on a fraction of the
  elements within 6 standard deviations of p^2 + (1-p)^2, what independent masks give
  (the same stream on two ranks, a stream restarted at every call, or the shards' stream
  seeded like the replicated one agree on every element);
* the default generator ends exactly where the replicated calls alone leave it, and the
  replicated outputs are the same with or without the sharded calls between them: the
  shards draw from a stream of their own;
* the same seed and calls give the same outputs again (what activation checkpointing needs).

Cases on 2 and 3 ranks: float32 with p = 0.1, bfloat16 with p = 0.5 starting with a
sharded call, float64 with tensors of several shapes, and p = 0 (nothing dropped).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import forward
from reference.tensor_parallel.rng import TensorParallelRNG

__all__ = ["TP_DROPOUT", "course_make_tp_dropout", "SIGMAS"]

SIGMAS = 6


def course_make_tp_dropout(seed, tp_group):
    """The course's answer: the default stream for replicas, TensorParallelRNG's for shards."""
    rng = TensorParallelRNG(seed, dist.get_rank(tp_group))

    def dropout(x, p, sharded):
        if not sharded:
            return F.dropout(x, p, training=True)
        with rng.fork():
            return F.dropout(x, p, training=True)
    return dropout


def make_dropout_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def values(shape, dtype):
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        return ((1 + torch.rand(shape, generator=generator, dtype=torch.float64)) * sign).to(dtype)

    big, seed = (32, 64), int(torch.randint(0, 2**31, (), generator=generator))
    plan = (("float32, p = 0.1", torch.float32, 0.1, [(False, big), (True, big), (True, big),
                                                      (False, big), (True, big)]),
            ("bfloat16, p = 0.5, a sharded call first", torch.bfloat16, 0.5,
             [(True, big), (False, big), (True, big), (False, big)]),
            ("float64, p = 0.3, several shapes", torch.float64, 0.3,
             [(True, (16, 64)), (False, (48, 40)), (True, (48, 40)), (True, (16, 64))]),
            ("p = 0: nothing dropped", torch.float32, 0.0, [(False, big), (True, big), (False, big)]))
    cases = []
    for n, (what, dtype, p, calls) in enumerate(plan):
        shared = [values(shape, dtype) for _, shape in calls]  # replicated: the same everywhere
        inputs = []
        for _ in range(world_size):
            xs = [values(shape, dtype) if sharded else x for (sharded, shape), x in zip(calls, shared)]
            inputs.append({"seed": seed + n, "p": p, "xs": xs, "sharded": [s for s, _ in calls]})
        cases.append(Case(what, inputs))
    return cases


def call_dropout(fn, case: dict) -> dict:
    def run(keep):
        torch.manual_seed(case["seed"])
        dropout = fn(case["seed"], dist.group.WORLD)
        outs = []
        for x, sharded in zip(case["xs"], case["sharded"]):
            if keep(sharded):
                out = dropout(x.clone(), case["p"], sharded)
                outs.append(out.detach().clone() if type(out) is torch.Tensor else None)
        return outs, torch.get_rng_state()

    everything, state = run(lambda s: True)
    again, _ = run(lambda s: True)
    replicated, state_replicated = run(lambda s: not s)
    mine = [o for o, s in zip(everything, case["sharded"]) if not s]
    same = lambda a, b: a is not None and b is not None and torch.equal(a, b)  # noqa: E731
    return {"outs": everything,
            "reproducible": all(same(a, b) for a, b in zip(everything, again)),
            "state_kept": torch.equal(state, state_replicated),
            "replicated_kept": all(same(a, b) for a, b in zip(mine, replicated))}


def expect_dropout(inputs: list) -> list:
    return [None] * len(inputs)  # judged by properties of the masks, not against values


def _agreement(a: torch.Tensor, b: torch.Tensor, p: float) -> str:
    """"" when masks a and b agree as often as independent ones, else how often they do."""
    n = a.numel()
    rate = (a == b).double().mean().item()
    want = p * p + (1 - p) * (1 - p)
    return "" if abs(rate - want) <= SIGMAS * math.sqrt(want * (1 - want) / n) else f"{rate:.0%}"


def _valid(out, x, p, dtype) -> str:
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
        return "not a tensor of x's shape and dtype"
    kept = out != 0
    rtol = forward(torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32).rtol
    if not torch.allclose(out[kept].double(), x[kept].double() / (1 - p), rtol=rtol, atol=0.0):
        return "values that are neither 0 nor x / (1 - p)"
    return ""


def judge_dropout(inputs, expected, outputs, world_size) -> str:
    p, flags = inputs[0]["p"], inputs[0]["sharded"]
    dtype = str(inputs[0]["xs"][0].dtype).split(".")[-1]
    masks = []
    for rank, (out, inp) in enumerate(zip(outputs, inputs)):
        for i, (o, x) in enumerate(zip(out["outs"], inp["xs"])):
            if why := _valid(o, x, p, dtype):
                return f"rank {rank}, call {i}: {why}"
        masks.append([o != 0 for o in out["outs"]])
        kept = torch.cat([m.reshape(-1) for m in masks[-1]]).double()
        bound = SIGMAS * math.sqrt(p * (1 - p) / kept.numel())
        if abs(kept.mean().item() - (1 - p)) > bound:
            return f"rank {rank} keeps {kept.mean().item():.1%} of the elements, not {1 - p:.0%} (p = {p})"
    for i, sharded in enumerate(flags):
        if not sharded and any(not torch.equal(m[i], masks[0][i]) for m in masks):
            return (f"call {i} (replicated): the ranks dropped different elements; copies must "
                    f"draw the same mask")
    for rank, out in enumerate(outputs):
        if not (out["state_kept"] and out["replicated_kept"]):
            return (f"rank {rank}: the sharded calls moved the default generator (the replicated "
                    f"calls draw other masks with them than without them)")
    if p > 0:
        for i, sharded in enumerate(flags):
            if sharded and (rate := _agreement(masks[0][i], masks[1][i], p)):
                return f"call {i} (sharded): ranks 0 and 1 agree on {rate} of the elements"
        for rank, mine in enumerate(masks):
            for i in range(len(flags)):
                for j in range(i):
                    if (flags[i] and mine[i].shape == mine[j].shape
                            and (rate := _agreement(mine[i], mine[j], p))):
                        return (f"rank {rank}: sharded call {i} agrees with "
                                f"{'sharded' if flags[j] else 'replicated'} call {j} on {rate} "
                                f"of the elements")
    for rank, out in enumerate(outputs):
        if not out["reproducible"]:
            return f"rank {rank}: the same seed and calls gave other masks the second time"
    return ""


def _properties_only(_):
    raise TypeError("judged by the masks' properties in the calling process")


TP_DROPOUT = ExerciseSpec(
    id="make_tp_dropout", title="Dropout under tensor parallelism: one stream for copies, one per shard",
    difficulty="★★☆ medium", world_sizes=(2, 3), make_cases=make_dropout_cases, call=call_dropout,
    expect=expect_dropout, judge=judge_dropout, reference=_properties_only,
    forbidden=COLLECTIVES,
    banned=("reference.course.homework.tensor_parallel_dropout.course_make_tp_dropout",
            "reference.tensor_parallel.rng"))
