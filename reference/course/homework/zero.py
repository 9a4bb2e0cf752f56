"""Hidden checks of homework 02: one ZeRO stage 1 optimizer, built from an inner optimizer.

Each case is a small MLP (weights from the grader's seed, the same on every rank)
trained for 3 steps, each rank on its own batch of 3 examples per step. The ranks
call the student's ``zero1_optimizer(params, optimizer_class, **kwargs)`` once, then
per step: clear the gradients, local backward, ``step()``. The grader trains the same
model in one process with ``optimizer_class`` on the whole batch (the ranks' batches
concatenated) and compares every parameter on every rank after the 3 steps.

Tolerances, the course's (reasoned in reference/tolerance.py): the parameters after
AdamW's 3 steps within `adamw_weights(3, lr, betas)`: Adam divides each gradient by its
own running magnitude, so the last-bit difference between a mean computed by a
collective and one computed by a single backward, in an element whose gradient is near
zero, can send that element's whole step either way (up to twice the learning rate a
step apart); their mean difference is held to a small share of that. After SGD's, within `sgd_weights` for the gradient
steps the momentum adds up (each gradient moves the weights again at every later step).
The shard's gradient within `gradient(N)`, a mean over the N ranks.

The cases: AdamW with a parameter count that does not divide by the world size
(padding), AdamW with weight decay and other betas, SGD with momentum (the optimizer
class is the caller's), and a one-parameter model on more ranks than it has numbers
(some ranks own only padding). Beyond the values, each rank's inner optimizer must
hold one tensor of S = ceil(Psi / N) numbers and state tensors of S numbers only:
the optimizer state is sharded, which is the point of stage 1. After every step the
shard's gradient (what the inner optimizer stepped on) must be this rank's slice of
the MEAN gradient: AdamW is nearly blind to the gradient's scale, so a reduce-scatter
with SUM instead of AVG would train almost the same parameters, and only this check
tells them apart in every case. Only all-reduce, reduce-scatter and all-gather are
allowed.

The transfer exercises (clip_sharded_grad_norm_, fsdp_schedule) and the written question
(zero_max_params) are checked in `zero_transfer`; FSDP around the student's own Transformer
(wrap_tiny_lm) in `zero_fully_shard`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from reference.course.homework.data_parallel import BATCH, build_mlp, collectives_allowed, full_batch_loss, model_case
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import WARM_UP, Case, ExerciseSpec
from reference.course.homework.subgroup import on_subgroup
from reference.tolerance import Tolerance, adamw_weights, gradient, sgd_weights

__all__ = ["ZERO1", "EXERCISES", "OPTIMIZERS", "weights_tolerance", "course_zero1_optimizer"]

STEPS = 3
OPTIMIZERS = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}
ALLOWED = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
           "_reduce_scatter_base", "all_gather", "all_gather_into_tensor", "all_gather_single",
           "_all_gather_base")
_GROUP_METHODS = ("allreduce", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
                  "allgather", "all_gather_single", "_allgather_base")


def course_zero1_optimizer(params, optimizer_class, group=None, **optimizer_kwargs):
    """The course's answer with the exercise's signature: (step, inner) over this rank's shard."""
    params = list(params)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = sum(p.numel() for p in params)
    size = -(-numel // n)  # S

    def flat(tensors):  # (N S,)
        return torch.cat([t.reshape(-1) for t in tensors] + [tensors[0].new_zeros(n * size - numel)])

    shard = torch.nn.Parameter(flat([p.detach() for p in params])[rank * size:(rank + 1) * size].clone())
    inner = optimizer_class([shard], **optimizer_kwargs)

    @torch.no_grad()
    def step():
        grads = flat([torch.zeros_like(p) if p.grad is None else p.grad for p in params])
        shard.grad = torch.empty_like(shard)
        dist.reduce_scatter_tensor(shard.grad, grads, op=dist.ReduceOp.AVG, group=group)
        inner.step()
        full = torch.empty(n * size, dtype=shard.dtype)
        dist.all_gather_into_tensor(full, shard.detach().clone(), group=group)
        for p, value in zip(params, full[:numel].split([p.numel() for p in params])):
            p.copy_(value.view_as(p))

    return step, inner


def _kwargs(case: dict) -> dict:
    # Saved as plain data: betas travel as a list.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in case["kwargs"].items()}


def weights_tolerance(case: dict, world_size: int) -> Tolerance:
    """How close the parameters after STEPS steps of the case's optimizer must be to one
    process's: the course's bound for AdamW, or for SGD (reference/tolerance.py)."""
    kwargs = _kwargs(case)
    if case["optimizer"] == "AdamW":
        return adamw_weights(STEPS, kwargs["lr"], kwargs.get("betas", (0.9, 0.999)))
    # SGD with momentum mu moves a weight at step k by lr times the buffer, which holds the
    # gradient of step j <= k times mu^(k-j): each gradient is taken 1 + mu + ... times in
    # all, so the steps count as that many gradient steps (1 + 1.9 + 2.71 for mu = 0.9).
    mu = kwargs.get("momentum", 0.0)
    taken = sum(mu ** (k - j) for k in range(STEPS) for j in range(k + 1))
    return sgd_weights(math.ceil(taken), kwargs["lr"], n=world_size)


def _case(generator, world_size, sizes, optimizer, kwargs, bias=True, divisible=None) -> list:
    def numel(sizes):
        return sum(a * b + b * bias for a, b in zip(sizes[:-1], sizes[1:]))

    if divisible is not None:
        # Widen the input by i and the output by j, the smallest (i, j) for which Psi does
        # (or does not) divide by N. Each step of i adds sizes[1] numbers, of j sizes[-2] + 1
        # (with bias): two coprime steps, so some (i, j) < (N, N) reaches every residue.
        sizes = next(s for s in ([sizes[0] + i, *sizes[1:-1], sizes[-1] + j]
                                 for i in range(world_size) for j in range(world_size))
                     if (numel(s) % world_size == 0) == divisible)
    inputs = model_case(generator, world_size, sizes, bias=bias, optimizer=optimizer, kwargs=kwargs)
    for rank_input in inputs:  # STEPS batches per rank, not data_parallel's 2
        rank_input["x"] = torch.randn(STEPS, BATCH, sizes[0], generator=generator)
        rank_input["y"] = torch.randn(STEPS, BATCH, sizes[-1], generator=generator)
    return inputs


def make_cases(generator, world_size) -> list:
    sizes = lambda: [int(v) for v in torch.randint(2, 7, (3,), generator=generator)]  # noqa: E731
    return [
        Case("AdamW, Psi not divisible by N", _case(
            generator, world_size, sizes(), "AdamW", {"lr": 0.01}, divisible=False)),
        Case("AdamW, weight decay", _case(
            generator, world_size, sizes(), "AdamW",
            {"lr": 0.02, "betas": [0.8, 0.95], "weight_decay": 0.1}, divisible=True)),
        Case("SGD with momentum", _case(
            generator, world_size, sizes(), "SGD", {"lr": 0.1, "momentum": 0.9})),
        Case("one number on every rank or fewer", _case(
            generator, world_size, [1, 1], "AdamW", {"lr": 0.05}, bias=False)),
    ]


def call(fn, case: dict) -> dict:
    model = build_mlp(case)
    params = [p for p in model.parameters() if p.requires_grad]
    with collectives_allowed(_GROUP_METHODS):
        returned = fn(params, OPTIMIZERS[case["optimizer"]], **_kwargs(case))
        if not (isinstance(returned, tuple) and len(returned) == 2 and callable(returned[0])
                and isinstance(returned[1], torch.optim.Optimizer)):
            return {"returned": type(returned).__name__}
        step, inner = returned
        shard_grads = []  # after each step: the gradient the inner optimizer stepped on
        for s in range(STEPS):
            for p in params:
                p.grad = None
            full_batch_loss(model, case["x"][s], case["y"][s]).backward()
            step()
            inner_params = [p for group in inner.param_groups for p in group["params"]]
            grad = inner_params[0].grad if len(inner_params) == 1 else None
            shard_grads.append(None if grad is None else grad.detach().clone())
    shard = [int(p.numel()) for group in inner.param_groups for p in group["params"]]
    state = [int(t.numel()) for st in inner.state.values() for t in st.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"returned": "tuple", "inner": type(inner).__name__, "shard": shard, "state": state,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "shard_grads": shard_grads}


def expect(inputs: list) -> dict:
    """The parameters after STEPS steps of one process on the whole batch, and each step's
    whole-batch gradient, flat (Psi,): the mean of the ranks' gradients."""
    case = inputs[0]
    model = build_mlp(case)
    optimizer = OPTIMIZERS[case["optimizer"]](model.parameters(), **_kwargs(case))
    grads = []
    for s in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x = torch.cat([r["x"][s] for r in inputs])
        y = torch.cat([r["y"][s] for r in inputs])
        full_batch_loss(model, x, y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        optimizer.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": grads}


def _shard_grad_error(got, want_flat, rank: int, shard_numel: int, world_size: int) -> str:
    """"" when `got` is rank's slice of the mean gradient (padding: anything), else why not."""
    want = torch.cat([want_flat, want_flat.new_zeros(world_size * shard_numel - want_flat.numel())])
    want = want[rank * shard_numel:(rank + 1) * shard_numel]
    real = max(0, min(shard_numel, want_flat.numel() - rank * shard_numel))  # not padding
    if got is None:
        return "the inner optimizer's shard has no gradient after step() (set shard.grad to the average)"
    if got.shape != want.shape:
        return f"the shard's gradient has shape {tuple(got.shape)}, not ({shard_numel},)"
    if gradient(world_size).close(got[:real], want[:real]):  # a mean over the ranks
        return ""
    ratio = (got[:real].double().norm() / want[:real].double().norm().clamp_min(1e-30)).item()
    scale = (f": it is {ratio:.3g} times the mean, summed instead of averaged?"
             if abs(ratio - world_size) < 0.01 * world_size else "")
    return f"the shard's gradient is not this rank's slice of the mean gradient{scale}"


def judge(inputs, expected, outputs, world_size) -> str:
    grads, expected = expected["grads"], expected["params"]
    psi = sum(t.numel() for t in expected.values())
    shard_numel = math.ceil(psi / world_size)  # S
    want_class = inputs[0]["optimizer"]
    for rank, out in enumerate(outputs):
        if out["returned"] != "tuple":
            return (f"rank {rank} returned {out['returned']}, not (step, inner): a function and "
                    f"the inner torch.optim optimizer")
        if out["inner"] != want_class:
            return f"rank {rank}: the inner optimizer is {out['inner']}, not {want_class} (optimizer_class)"
        if out["shard"] != [shard_numel]:
            return (f"rank {rank}: the inner optimizer holds tensors of {out['shard']} numbers; "
                    f"ZeRO-1 gives it one tensor, this rank's shard of S = ceil({psi} / "
                    f"{world_size}) = {shard_numel}")
        if any(n != shard_numel for n in out["state"]):
            return (f"rank {rank}: optimizer state tensors of {out['state']} numbers; each must "
                    f"cover only the shard ({shard_numel})")
        for step, (got, want) in enumerate(zip(out["shard_grads"], grads)):
            if error := _shard_grad_error(got, want, rank, shard_numel, world_size):
                return f"rank {rank}, step {step + 1}: {error}"
        try:
            weights_tolerance(inputs[0], world_size).assert_weights(out["params"], expected)
        except AssertionError as error:
            return (f"rank {rank}: after {STEPS} steps the parameters differ from one process "
                    f"training on the whole batch ({str(error).lstrip(': ')})")
    return ""


ZERO1 = on_subgroup(ExerciseSpec(
    id="zero1_optimizer", title="a ZeRO-1 optimizer step", difficulty="★☆☆ warm-up",
    weight=WARM_UP,
    world_sizes=(2, 4), make_cases=make_cases, call=call, expect=expect, judge=judge,
    reference=None,  # the course's version, reference.zero.ZeroOptimizer, is a class
    forbidden=tuple(c for c in COLLECTIVES if c not in ALLOWED),
    banned=("reference.course.homework.zero.course_zero1_optimizer", "reference.zero.optimizer",
            "reference.zero.reducer", "reference.zero.shard")), (4,), (0, 3))
HOMEWORK_ID = "02_zero_fsdp"
# The warm-up, two transfers to what the lecture did not build (zero_transfer), the question,
# and fully_shard around the student's own model (zero_fully_shard).
from reference.course.homework.zero_transfer import CLIP, FSDP_SCHEDULE, ZERO_MAX_PARAMS  # noqa: E402
from reference.course.homework.zero_fully_shard import WRAP_TINY_LM  # noqa: E402

# An answer failing any case keeps at most half: a rule broken alone shows only in the
# cases that can show it.
WRONG_KEEPS = 0.5
EXERCISES = (ZERO1, CLIP, FSDP_SCHEDULE, ZERO_MAX_PARAMS, WRAP_TINY_LM)
