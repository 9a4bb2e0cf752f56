"""Hidden checks of homework 01: averaging gradients, naively and in buckets from hooks.

(Accumulation over ranks with unequal samples, the int8 all-reduce with error feedback and
the written question, the homework's transfers, are checked as `data_parallel_transfer` says;
their specs are built here.)

Every case is a small MLP (Linear, Tanh, ..., Linear) whose weights come from the
grader's seed, the same on every rank, and a different batch of 3 examples per rank
for each of 2 steps. Between the steps the ranks set every ``p.grad`` to None, as
``optimizer.zero_grad()`` does, and run the next backward: the hooks must work step
after step. The grader computes the full-batch gradient of the mean-squared error in
one process (the ranks' batches concatenated; the batches are equal in size, so it is
the mean of the ranks' gradients) and compares it with every rank's ``p.grad``, within
the course's bound for a gradient summed over n ranks (and micro-batches) in another
order, `reference.tolerance.gradient(n)`. A frozen parameter must keep ``grad`` None.

The bucketed exercise goes where the lecture's buckets did not: gradient accumulation.
Each step runs ``accumulation_steps`` (K = 1, 2 or 3) micro-batches, each loss divided by
K and backward, then ``finish()``; the buckets must wait for the K-th backward of the
step (a parameter's post-accumulate-grad hook fires in every one of them). The gradient
after ``finish()`` is the full-batch gradient of every rank's every micro-batch. It is
also checked through its all-reduces, counted on the process group itself (so any import
of ``all_reduce`` is seen): one per bucket per step, of the bucket's number of elements,
in bucket order, every one launched inside the step's LAST ``backward()`` (none while
accumulating, none in ``finish()``), and, with more than one bucket, the first one
launched while some gradients of that backward were not complete yet (communication
overlapping backward). The lecture's buckets, which launch in the first backward of a
step, lose every case with K > 1. Every collective other than all-reduce is switched off.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from reference.data_parallel import naive_all_reduce_gradients
from reference.data_parallel.buckets import plan_buckets
from reference.course.homework.data_parallel_cases import (
    BATCH, STEPS, build_mlp, collectives_allowed, full_batch_loss, judge_grads, model_case,
)
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import WARM_UP, Case, ExerciseSpec
from reference.course.homework.subgroup import on_subgroup
from reference.tolerance import gradient

__all__ = ["AVERAGE_GRADIENTS", "BUCKETED", "ACCUMULATE", "INT8", "DDP_BYTES", "EXERCISES",
           "build_mlp", "model_case", "full_batch_loss", "collectives_allowed", "judge_grads",
           "course_bucketed_all_reduce", "STEPS", "BATCH"]

def _random_sizes(generator) -> list:
    return [int(v) for v in torch.randint(2, 8, (4,), generator=generator)]


def _run_steps(fn_call, case: dict, model: nn.Module) -> list:
    """Each step: clear the gradients, local backward, `fn_call(loss)`; the gradients after."""
    grads = []
    for step in range(STEPS):
        for p in model.parameters():
            p.grad = None
        fn_call(full_batch_loss(model, case["x"][step], case["y"][step]))
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    return grads


def expect_grads(inputs: list) -> dict:
    """Per step, the full-batch gradient of every trainable parameter, and the buckets."""
    model = build_mlp(inputs[0])
    grads = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        x = torch.cat([r["x"][step] for r in inputs])
        y = torch.cat([r["y"][step] for r in inputs])
        full_batch_loss(model, x, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    buckets = []
    if "bucket_bytes" in inputs[0]:
        buckets = [b.numel for b in plan_buckets(model.named_parameters(), inputs[0]["bucket_bytes"])]
    return {"grads": grads, "buckets": buckets}


# ------------------------------------------------------------------ exercise 1: naive

def make_average_cases(generator, world_size) -> list:
    return [Case("MLP", model_case(generator, world_size, _random_sizes(generator))),
            Case("frozen first layer", model_case(generator, world_size, _random_sizes(generator),
                                                  frozen=("0.weight", "0.bias")))]


def call_average(fn, case: dict) -> dict:
    model = build_mlp(case)

    def backward_then_average(loss):
        loss.backward()
        fn(model)

    with collectives_allowed(("allreduce",)):
        return {"grads": _run_steps(backward_then_average, case, model)}


def judge_average(inputs, expected, outputs, world_size) -> str:
    return judge_grads(expected, outputs, gradient(world_size))  # summed over the ranks


# ------------------------------------------------------------------ exercise 2: buckets

def make_bucket_cases(generator, world_size) -> list:
    cases = []
    for name, frozen, micro in (("one parameter per bucket, no accumulation", (), 1),
                                ("cap not a multiple of 4 bytes, 2 micro-batches", (), 2),
                                ("everything in one bucket, 3 micro-batches", (), 3),
                                ("frozen first layer, 2 micro-batches", ("0.weight",), 2),
                                ("2 to 4 buckets, 3 micro-batches", (), 3)):
        sizes = _random_sizes(generator)
        numels = [a * b + b for a, b in zip(sizes[:-1], sizes[1:])]  # per layer, weight + bias
        cap = {"one": 4, "everything": 4 * sum(numels) + int(torch.randint(0, 64, (1,), generator=generator))}
        # Between the last layer's size and the whole: 2 to 4 buckets, odd bytes.
        cap_bytes = cap.get(name.split()[0],
                            4 * (numels[-1] + int(torch.randint(0, 8, (1,), generator=generator))) + 2)
        inputs = model_case(generator, world_size, sizes, frozen=frozen, bucket_bytes=cap_bytes,
                            micro=micro)
        for rank_input in inputs:  # (STEPS, K, BATCH, ...): K micro-batches per step
            rank_input["x"] = torch.randn(STEPS, micro, BATCH, sizes[0], generator=generator)
            rank_input["y"] = torch.randn(STEPS, micro, BATCH, sizes[-1], generator=generator)
        cases.append(Case(name, inputs))
    return cases


def call_bucketed(fn, case: dict) -> dict:
    model = build_mlp(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    micro = case["micro"]
    calls, phase, done = [], ["before"], set()

    def record(method, numel, dtype):
        missing = sum(id(p) not in done for p in trainable)  # not complete in this backward
        calls.append([phase[0], numel, missing])

    for p in trainable:  # registered first: they run before the student's hooks
        p.register_post_accumulate_grad_hook(lambda param: done.add(id(param)))
    with collectives_allowed(("allreduce",), record):
        finish = fn(model, case["bucket_bytes"], accumulation_steps=micro)
        if not callable(finish):
            return {"grads": [], "calls": [], "finish_type": type(finish).__name__}
        grads = []
        for step in range(STEPS):
            for p in model.parameters():
                p.grad = None
            for j in range(micro):
                phase[0] = "backward" if j == micro - 1 else f"accumulation backward {j + 1} of {micro}"
                done.clear()
                (full_batch_loss(model, case["x"][step][j], case["y"][step][j]) / micro).backward()
            phase[0] = "finish"
            finish()
            phase[0] = "after"
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                          if p.grad is not None})
    return {"grads": grads, "calls": calls, "finish_type": "function"}


def judge_bucketed(inputs, expected, outputs, world_size) -> str:
    if outputs[0]["finish_type"] != "function":
        return (f"returned {outputs[0]['finish_type']}, not a function to call after backward "
                f"(finish())")
    buckets = expected["buckets"]
    for rank, out in enumerate(outputs):
        numels = [n for _, n, _ in out["calls"]]
        if numels != buckets * STEPS:
            return (f"rank {rank}: all-reduce sizes {numels[:8]} over {STEPS} steps; the buckets "
                    f"hold {buckets} elements, so expected one all-reduce each, per step, in "
                    f"bucket order")
        late = [i for i, (phase, _, _) in enumerate(out["calls"]) if phase != "backward"]
        if late:
            where = out["calls"][late[0]][0]
            why = ("its gradients did not yet hold every micro-batch of the step"
                   if where.startswith("accumulation") else
                   "not inside the step's last backward() (launch each bucket from a gradient hook)")
            return f"rank {rank}: all-reduce {late[0]} was launched during {where}: {why}"
        if len(buckets) > 1 and out["calls"][0][2] == 0:
            return (f"rank {rank}: the first all-reduce started only once every gradient existed "
                    f"(launch a bucket as soon as its own gradients are ready)")
    # summed over every rank's every micro-batch
    return judge_grads(expected, outputs, gradient(world_size * inputs[0]["micro"]))


def course_bucketed_all_reduce(module, bucket_bytes, accumulation_steps=1, group=None):
    """The course's answer, the exercise's signature: `plan_buckets`' buckets, each one async
    all-reduce launched in bucket order from post-accumulate-grad hooks once a parameter's
    hook has fired `accumulation_steps` times in the step; finish() waits."""
    world_size = dist.get_world_size(group)
    buckets = plan_buckets(module.named_parameters(), bucket_bytes)
    ready, launched, fired = [0] * len(buckets), [], {}

    def hook(index):
        def ready_one(param):
            fired[param] = fired.get(param, 0) + 1
            if fired[param] < accumulation_steps:  # more micro-batches to add to its grad
                return
            ready[index] += 1
            while len(launched) < len(buckets) and ready[len(launched)] == len(buckets[len(launched)].params):
                bucket = buckets[len(launched)]
                flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])
                launched.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
        return ready_one

    for bucket in buckets:
        for p in bucket.params:
            p.register_post_accumulate_grad_hook(hook(bucket.index))

    @torch.no_grad()
    def finish():
        for bucket, flat, work in launched:
            work.wait()
            flat.div_(world_size)
            for p, offset, numel in zip(bucket.params, bucket.offsets, bucket.numels):
                p.grad.copy_(flat[offset:offset + numel].view_as(p))
        ready[:] = [0] * len(buckets)
        launched.clear()
        fired.clear()
    return finish


AVERAGE_GRADIENTS = on_subgroup(ExerciseSpec(
    id="average_gradients", title="average the gradients after backward", difficulty="★☆☆ warm-up",
    weight=WARM_UP,
    world_sizes=(2, 4), make_cases=make_average_cases, call=call_average,
    expect=expect_grads, judge=judge_average,
    reference=naive_all_reduce_gradients,  # the course's own answer, same contract
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.data_parallel.ddp.naive_all_reduce_gradients", "reference.data_parallel")),
    (4,), (0, 1))
BUCKETED = on_subgroup(ExerciseSpec(
    id="bucketed_all_reduce", title="bucketed all-reduce from gradient hooks, under accumulation",
    difficulty="★★★ hard", world_sizes=(2, 4), make_cases=make_bucket_cases, call=call_bucketed,
    expect=expect_grads, judge=judge_bucketed,
    reference=None,  # no built-in has this contract (reference.data_parallel.DDP wraps the module)
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.data_parallel.course_bucketed_all_reduce",
            "reference.data_parallel")), (4,), (1, 4))

# The transfers and the written question (data_parallel_transfer).
from reference.course.homework.data_parallel_transfer import (  # noqa: E402 - after what it uses
    DDP_BYTES, call_accumulate, call_int8, course_accumulate_gradients, course_int8_all_reduce,
    expect_accumulate, expect_int8, judge_accumulate, judge_int8, make_accumulate_cases,
    make_int8_cases,
)

ACCUMULATE = on_subgroup(ExerciseSpec(
    id="accumulate_gradients", title="gradient accumulation over ranks with different sample counts",
    difficulty="★★☆ medium", world_sizes=(2, 3), make_cases=make_accumulate_cases,
    call=call_accumulate, expect=expect_accumulate, judge=judge_accumulate,
    reference=course_accumulate_gradients,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.data_parallel_transfer.course_accumulate_gradients",
            "reference.data_parallel")), (3,), (2, 3))
INT8 = on_subgroup(ExerciseSpec(
    id="int8_all_reduce", title="int8 gradient all-reduce with error feedback",
    difficulty="★★★ hard", world_sizes=(2, 3), make_cases=make_int8_cases, call=call_int8,
    expect=expect_int8, judge=judge_int8, reference=course_int8_all_reduce,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.data_parallel_transfer.course_int8_all_reduce",
            "reference.data_parallel.compression", "reference.zero.adam8bit")), (3,), (1, 5))
HOMEWORK_ID = "01_data_parallel"
# The warm-up, the lecture's buckets built by hand, two transfers (accumulation over unequal
# ranks; compression with error feedback) and the written question.
# An answer failing any case keeps at most half: a rule broken alone shows only in the
# cases that can show it.
WRONG_KEEPS = 0.5
EXERCISES = (AVERAGE_GRADIENTS, BUCKETED, ACCUMULATE, INT8, DDP_BYTES)
