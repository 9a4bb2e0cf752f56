"""Hidden checks of homework 01: averaging gradients, naively and in buckets from hooks.

Every case is a small MLP (Linear, Tanh, ..., Linear) whose weights come from the
grader's seed, the same on every rank, and a different batch of 3 examples per rank
for each of 2 steps. Between the steps the ranks set every ``p.grad`` to None, as
``optimizer.zero_grad()`` does, and run the next backward: the hooks must work step
after step. The grader computes the full-batch gradient of the mean-squared error in
one process (the ranks' batches concatenated; the batches are equal in size, so it is
the mean of the ranks' gradients) and compares it with every rank's ``p.grad``, with
the course's fp32 tolerance. A frozen parameter must keep ``grad`` None.

The bucketed exercise is also checked through its all-reduces, counted on the process
group itself (so any import of ``all_reduce`` is seen): one per bucket per step, of
the bucket's number of elements, in bucket order, every one launched inside
``backward()``, and, with more than one bucket, the first one launched while some
gradients did not exist yet (communication overlapping backward). Every collective
other than all-reduce is switched off.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from reference.data_parallel import naive_all_reduce_gradients
from reference.data_parallel.buckets import plan_buckets
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import Case, ExerciseSpec

__all__ = ["AVERAGE_GRADIENTS", "BUCKETED", "EXERCISES", "build_mlp", "model_case",
           "full_batch_loss", "collectives_allowed", "TOLERANCE"]

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
STEPS, BATCH = 2, 3  # backward passes per case, examples per rank and step

# The guard switches off every method of the process group, whatever the exercise
# forbids; `collectives_allowed` puts back the ones an exercise may use. They are
# taken here, when the module is imported, before any rank enters the rules.
_GROUP_ORIGINALS = {name: dist.ProcessGroup.__dict__[name] for name in (
    "allreduce", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "allgather", "all_gather_single", "_allgather_base") if name in dist.ProcessGroup.__dict__}


@contextlib.contextmanager
def collectives_allowed(methods, record=None):
    """Inside the rules: the process group's `methods` work again; `record(method, numel)`
    is called before each call, numel being the elements of its input tensor(s)."""
    saved = {m: dist.ProcessGroup.__dict__.get(m) for m in methods}

    def wrap(name, original):
        def counted(self, tensors, *args, **kwargs):
            if record is not None:
                items = tensors if isinstance(tensors, (list, tuple)) else [tensors]
                record(name, sum(t.numel() for t in items if isinstance(t, torch.Tensor)))
            return original(self, tensors, *args, **kwargs)
        return counted

    try:
        for m in methods:
            setattr(dist.ProcessGroup, m, wrap(m, _GROUP_ORIGINALS[m]))
        yield
    finally:
        for m, value in saved.items():
            if value is None:
                delattr(dist.ProcessGroup, m)
            else:
                setattr(dist.ProcessGroup, m, value)


# ------------------------------------------------------------------ models and cases

def build_mlp(case: dict) -> nn.Sequential:
    """The case's MLP: Linear(sizes[0], sizes[1]), Tanh, ..., Linear(sizes[-2], sizes[-1])."""
    sizes, bias = case["sizes"], case.get("bias", True)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(fan_in, fan_out, bias=bias)] + ([nn.Tanh()] if i < len(sizes) - 2 else [])
    model = nn.Sequential(*layers)
    model.load_state_dict(case["state"])
    for name, p in model.named_parameters():
        p.requires_grad_(name not in case["frozen"])
    return model


def full_batch_loss(model, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def model_case(generator, world_size, sizes, frozen=(), bias=True, **extra) -> list:
    """Per-rank inputs: the same weights, each rank its own (STEPS, BATCH, ...) data."""
    shapes = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        shapes[f"{2 * i}.weight"] = (fan_out, fan_in)
        if bias:
            shapes[f"{2 * i}.bias"] = (fan_out,)
    state = {k: torch.randn(s, generator=generator) * 0.5 for k, s in shapes.items()}
    common = {"sizes": list(sizes), "bias": bias, "frozen": list(frozen), "state": state, **extra}
    return [{**common, "x": torch.randn(STEPS, BATCH, sizes[0], generator=generator),
             "y": torch.randn(STEPS, BATCH, sizes[-1], generator=generator)}
            for _ in range(world_size)]


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


def judge_grads(expected: dict, outputs: list) -> str:
    for rank, out in enumerate(outputs):
        for step, (got, want) in enumerate(zip(out["grads"], expected["grads"])):
            extra = sorted(set(got) - set(want))
            if extra:
                return f"rank {rank}, step {step}: frozen parameter(s) {extra} got a gradient"
            for name, g in want.items():
                if name not in got:
                    return f"rank {rank}, step {step}: {name}.grad is None after the averaging"
                if got[name].shape != g.shape:
                    return f"rank {rank}, step {step}: {name}.grad has shape {tuple(got[name].shape)}"
                if not torch.allclose(got[name], g, **TOLERANCE):
                    local = "" if not torch.allclose(got[name] / len(outputs), g, **TOLERANCE) else (
                        " (it is the sum over ranks: divide by the world size)")
                    error = (got[name] - g).abs().max().item()
                    return (f"rank {rank}, step {step}: {name}.grad is not the full-batch gradient "
                            f"(max abs error {error:.3g}){local}")
    return ""


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
    return judge_grads(expected, outputs)


# ------------------------------------------------------------------ exercise 2: buckets

def make_bucket_cases(generator, world_size) -> list:
    cases = []
    for name, frozen in (("one parameter per bucket", ()), ("cap not a multiple of 4 bytes", ()),
                         ("everything in one bucket", ()), ("frozen first layer", ("0.weight",))):
        sizes = _random_sizes(generator)
        numels = [a * b + b for a, b in zip(sizes[:-1], sizes[1:])]  # per layer, weight + bias
        cap = {"one parameter per bucket": 4,
               "everything in one bucket": 4 * sum(numels) + int(torch.randint(0, 64, (1,), generator=generator))}
        # Between the last layer's size and the whole: 2 to 4 buckets, odd bytes.
        cap_bytes = cap.get(name, 4 * (numels[-1] + int(torch.randint(0, 8, (1,), generator=generator))) + 2)
        cases.append(Case(name, model_case(generator, world_size, sizes, frozen=frozen,
                                           bucket_bytes=cap_bytes)))
    return cases


def call_bucketed(fn, case: dict) -> dict:
    model = build_mlp(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    calls, phase = [], ["before"]

    def record(method, numel):
        missing = sum(p.grad is None for p in trainable)  # gradients not produced yet
        calls.append([phase[0], numel, missing])

    with collectives_allowed(("allreduce",), record):
        finish = fn(model, case["bucket_bytes"])
        if not callable(finish):
            return {"grads": [], "calls": [], "finish_type": type(finish).__name__}

        def backward_then_finish(loss):
            phase[0] = "backward"
            loss.backward()
            phase[0] = "finish"
            finish()
            phase[0] = "after"

        grads = _run_steps(backward_then_finish, case, model)
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
            return (f"rank {rank}: all-reduce {late[0]} was launched during {out['calls'][late[0]][0]}, "
                    f"not inside backward() (launch each bucket from a gradient hook)")
        if len(buckets) > 1 and out["calls"][0][2] == 0:
            return (f"rank {rank}: the first all-reduce started only once every gradient existed "
                    f"(launch a bucket as soon as its own gradients are ready)")
    return judge_grads(expected, outputs)


AVERAGE_GRADIENTS = ExerciseSpec(
    id="average_gradients", title="average the gradients after backward", difficulty="★☆☆ easy",
    world_sizes=(2, 4), make_cases=make_average_cases, call=call_average,
    expect=expect_grads, judge=judge_average,
    reference=naive_all_reduce_gradients,  # the course's own answer, same contract
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"))
BUCKETED = ExerciseSpec(
    id="bucketed_all_reduce", title="bucketed all-reduce launched from gradient hooks",
    difficulty="★★★ hard", world_sizes=(2, 4), make_cases=make_bucket_cases, call=call_bucketed,
    expect=expect_grads, judge=judge_bucketed,
    reference=None,  # no built-in has this contract (reference.data_parallel.DDP wraps the module)
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"))
HOMEWORK_ID = "01_data_parallel"
EXERCISES = (AVERAGE_GRADIENTS, BUCKETED)
