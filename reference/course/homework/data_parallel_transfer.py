"""Hidden checks of homework 01's transfer exercises and its written question.

* ``accumulate_gradients(module, micro_batches, group=None)``: gradient accumulation when
  the ranks hold different numbers of samples. Each rank runs one forward and backward per
  micro-batch (a list of ``(x, y)``, possibly empty on a rank, of uneven sizes), and
  communicates only once, after its last backward: the gradient of the mean squared error
  over **every sample of every rank** (the large-batch gradient, which weighs each rank by
  its samples, not each rank alike) on every rank, and that loss returned as a float.
  Cases on 2 and 3 ranks, 2 steps each (the gradients set to None between them): equal
  micro-batches; micro-batches of different sizes; ranks with different sample counts; a
  rank with no micro-batch at all; a float64 model with a frozen first layer. Checked: the
  gradients and the loss, within the course's fp32 bounds (reference/tolerance.py:
  `gradient(n)` for a gradient summed over the n micro-batches of every rank in another
  order, `loss()` for the loss; the float64 case too: a loss summed in float32 on the
  way is still the step's loss), one backward per micro-batch
  (counted by post-accumulate-grad hooks), no all-reduce before the last backward, and at
  most the trainable elements plus two numbers all-reduced per step.
* ``int8_all_reduce(grad, residual, group=None)``: the mean of the ranks' gradients sent
  as int8, with error feedback. With p ranks and L = 127 // p levels (so that the sum of p
  values in [-L, L] fits in an int8), v = grad + residual, m = the largest |v| on any rank
  (an all-reduce with op MAX), scale = m / L (1 when m is 0), q = round(v / scale) as
  int8; the int8 all-reduce sums q exactly; returns (sum(q) * scale / p, v - q * scale).
  Three steps per case, each step's residual the one returned by the step before, on 2
  and 3 ranks: float32 (1,), (7,), (3, 5); float64 (6,); zeros on every rank; one rank's
  gradients 100 times smaller than the others' (they reach the mean only through the
  residual). Checked: the mean and the residual within `reference.tolerance.forward()`,
  the float64 case too (the same operations, which another order of multiplication, or
  a scale held in float32, changes in the last bits), the
  inputs left unchanged, and the traffic: exactly the n values as int8, and at most one
  other number.
* ``ddp_bytes_per_step(n_params, world_size, bytes_per_element, accumulation_steps,
  no_sync)``: the written question, graded exactly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from reference.course.homework.data_parallel_cases import (
    build_mlp, collectives_allowed, judge_grads, model_case,
)
from reference.course.homework.questions import question
from reference.course.homework.scoring import Case
from reference.tolerance import forward, gradient, loss as loss_tolerance

__all__ = ["course_accumulate_gradients", "course_int8_all_reduce", "ddp_bytes_formula",
           "make_accumulate_cases", "call_accumulate", "expect_accumulate", "judge_accumulate",
           "make_int8_cases", "call_int8", "expect_int8", "judge_int8", "DDP_BYTES", "EF_STEPS"]

STEPS = 2      # optimizer steps per accumulation case
EF_STEPS = 3   # steps per error-feedback case: the residual carried twice


# ------------------------------------------------------------------ accumulate_gradients

def course_accumulate_gradients(module, micro_batches, group=None):
    """The course's answer (the exercise's signature): sums locally, one flat all-reduce."""
    params = [p for p in module.parameters() if p.requires_grad]
    loss_sum, count = 0.0, 0
    for x, y in micro_batches:
        out = module(x)
        loss = nn.functional.mse_loss(out, y, reduction="sum") / out.shape[-1]
        loss.backward()
        loss_sum, count = loss_sum + loss.item(), count + x.shape[0]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params] + [torch.tensor([loss_sum, count], dtype=params[0].dtype)])
    dist.all_reduce(flat, group=group)
    total = flat[-1]
    offset = 0
    for p in params:
        p.grad = (flat[offset:offset + p.numel()] / total).view_as(p).clone()
        offset += p.numel()
    return (flat[-2] / total).item()


def _batches(generator, sizes, counts, dtype):
    """[(x, y)] of the given sizes: x (b, sizes[0]), y (b, sizes[-1])."""
    return [(torch.randn(b, sizes[0], generator=generator, dtype=torch.float64).to(dtype),
             torch.randn(b, sizes[-1], generator=generator, dtype=torch.float64).to(dtype))
            for b in counts]


def make_accumulate_cases(generator, world_size) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    plans = {  # case -> micro-batch sizes of rank r (the same at each step)
        "equal micro-batches": lambda r, b=draw(2, 4): [b, b],
        "micro-batches of different sizes": lambda r, a=draw(1, 2), b=draw(4, 6): [a, b],
        "ranks with different sample counts": lambda r: [draw(1, 4) for _ in range(r + 1)],
        "a rank with no micro-batch": lambda r: [] if r == world_size - 1 else [draw(1, 3), draw(2, 5)],
        "float64, frozen first layer": lambda r: [draw(1, 5) for _ in range(2 - r % 2)],
    }
    cases = []
    for name, plan in plans.items():
        dtype = "float64" if name.startswith("float64") else "float32"
        frozen = ("0.weight", "0.bias") if "frozen" in name else ()
        sizes = [draw(2, 6) for _ in range(4)]
        per_rank = model_case(generator, world_size, sizes, frozen=frozen)
        for r, case in enumerate(per_rank):
            del case["x"], case["y"]
            counts = plan(r)
            case.update(dtype=dtype, batches=[_batches(generator, sizes, counts, getattr(torch, dtype))
                                              for _ in range(STEPS)])
        cases.append(Case(name, per_rank))
    return cases


def _model(case: dict) -> nn.Module:
    return build_mlp(case).to(getattr(torch, case["dtype"]))


def call_accumulate(fn, case: dict) -> dict:
    model = _model(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    seen = {"accumulated": 0, "calls": []}

    def count(param):  # one call per parameter per backward
        seen["accumulated"] += 1

    def record(method, numel, dtype):
        seen["calls"].append([numel, seen["accumulated"]])

    for p in trainable:
        p.register_post_accumulate_grad_hook(count)
    steps = []
    with collectives_allowed(("allreduce",), record):
        for batches in case["batches"]:
            for p in model.parameters():
                p.grad = None
            seen.update(accumulated=0, calls=[])
            loss = fn(model, [(x.clone(), y.clone()) for x, y in batches])
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                loss = loss.item()
            ok = isinstance(loss, (int, float)) and not isinstance(loss, bool)
            steps.append({"grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                    if p.grad is not None},
                          "loss": float(loss) if ok else None, "loss_type": type(loss).__name__,
                          "accumulated": seen["accumulated"], "calls": list(seen["calls"])})
    return {"steps": steps, "trainable": len(trainable),
            "elements": sum(p.numel() for p in trainable)}


def expect_accumulate(inputs: list) -> dict:
    model = _model(inputs[0])
    grads, losses = [], []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        pairs = [pair for case in inputs for pair in case["batches"][step]]
        x, y = torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
        loss = nn.functional.mse_loss(model(x), y)  # the mean over every sample of every rank
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        losses.append(loss.item())
    return {"grads": grads, "losses": losses}


def judge_accumulate(inputs, expected, outputs, world_size) -> str:
    for rank, out in enumerate(outputs):
        per_backward, elements = out["trainable"], out["elements"]
        for step, got in enumerate(out["steps"]):
            where = f"rank {rank}, step {step}"
            n_micro = len(inputs[rank]["batches"][step])
            if got["accumulated"] != n_micro * per_backward:
                return (f"{where}: {got['accumulated'] / per_backward:g} backward passes for "
                        f"{n_micro} micro-batches (one forward and backward per micro-batch)")
            if any(done < n_micro * per_backward for _, done in got["calls"]):
                return (f"{where}: an all-reduce before the last micro-batch's backward "
                        f"(accumulate locally; communicate once, at the end)")
            sent = sum(n for n, _ in got["calls"])
            if sent > elements + 2:
                return (f"{where}: all-reduced {sent} elements; the gradients and two numbers are "
                        f"{elements + 2}")
            if got["loss"] is None:
                return f"{where}: returned {got['loss_type']}, not the step's loss (a float)"
            want = expected["losses"][step]
            if not loss_tolerance().allows(got["loss"] - want, want):  # NaN never is
                return f"{where}: returned loss {got['loss']:.6g}, the mean over all samples is {want:.6g}"
    # the gradient sums every micro-batch of every rank: the most of any step
    n = max(sum(len(case["batches"][step]) for case in inputs) for step in range(STEPS))
    return judge_grads(expected, [{"grads": [s["grads"] for s in out["steps"]]} for out in outputs],
                       gradient(n))


# ------------------------------------------------------------------ int8_all_reduce

def course_int8_all_reduce(grad, residual, group=None):
    """The course's answer (the exercise's signature)."""
    p = dist.get_world_size(group)
    levels = 127 // p
    v = grad + residual
    m = v.abs().max().reshape(1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    scale = m[0] / levels if m[0] > 0 else torch.ones((), dtype=v.dtype)
    q = torch.round(v / scale).to(torch.int8)
    new_residual = v - q.to(v.dtype) * scale
    dist.all_reduce(q, group=group)
    return q.to(v.dtype) * scale / p, new_residual


def make_int8_cases(generator, world_size) -> list[Case]:
    def grads(shape, dtype, factor=1.0):
        return (torch.randn(EF_STEPS, *shape, generator=generator, dtype=torch.float64)
                * factor).to(dtype)

    specs = [("float32 (1,)", (1,), torch.float32), ("float32 (7,)", (7,), torch.float32),
             ("float32 (3, 5)", (3, 5), torch.float32), ("float64 (6,)", (6,), torch.float64)]
    cases = [Case(name, [{"grads": grads(shape, dtype)} for _ in range(world_size)])
             for name, shape, dtype in specs]
    cases.append(Case("zeros (4,) on every rank",
                      [{"grads": torch.zeros(EF_STEPS, 4)} for _ in range(world_size)]))
    cases.append(Case("rank 0 100 times smaller (8,)",
                      [{"grads": grads((8,), torch.float32, 0.01 if r == 0 else 1.0)}
                       for r in range(world_size)]))
    return cases


def call_int8(fn, case: dict) -> dict:
    calls = []

    def record(method, numel, dtype):
        calls.append([str(dtype).replace("torch.", ""), numel])

    steps = []
    residual = torch.zeros_like(case["grads"][0])
    with collectives_allowed(("allreduce",), record):
        for grad in case["grads"]:
            calls.clear()
            g, r = grad.clone(), residual.clone()
            out = fn(g, r)
            ok = (isinstance(out, (tuple, list)) and len(out) == 2
                  and all(type(t) is torch.Tensor for t in out))
            steps.append({"error": "" if ok else f"returned {type(out).__name__}, not (mean, residual)",
                          "mean": out[0].detach().clone() if ok else None,
                          "residual": out[1].detach().clone() if ok else None,
                          "changed": not (torch.equal(g, grad) and torch.equal(r, residual)),
                          "calls": list(calls)})
            if not ok:
                break
            residual = out[1].detach().clone()
    return {"steps": steps}


def expect_int8(inputs: list) -> list:
    """Per rank, per step: the mean and the residual, the residual carried from step to step."""
    p, levels = len(inputs), 127 // len(inputs)
    residuals = [torch.zeros_like(case["grads"][0]) for case in inputs]
    out = [[] for _ in inputs]
    for step in range(EF_STEPS):
        v = [case["grads"][step] + res for case, res in zip(inputs, residuals)]
        m = max(t.abs().max() for t in v)
        scale = m / levels if m > 0 else torch.ones((), dtype=v[0].dtype)
        q = [torch.round(t / scale) for t in v]
        mean = torch.stack(q).sum(0) * scale / p
        residuals = [t - qt * scale for t, qt in zip(v, q)]
        for rank in range(p):
            out[rank].append({"mean": mean, "residual": residuals[rank]})
    return out


def judge_int8(inputs, expected, outputs, world_size) -> str:
    numel = inputs[0]["grads"][0].numel()
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        for step, (got, w) in enumerate(zip(out["steps"], want)):
            where = f"rank {rank}, step {step}"
            if got["error"]:
                return f"{where}: {got['error']}"
            if got["changed"]:
                return f"{where}: changed grad or residual in place (return new tensors)"
            payload = sum(n for dtype, n in got["calls"] if dtype == "int8")
            other = [c for c in got["calls"] if c[0] != "int8"]
            if payload != numel or sum(n for _, n in other) > 1:
                return (f"{where}: all-reduced {got['calls']} ([dtype, elements] each); expected the "
                        f"{numel} quantized values as int8 and one number (the max)")
            for name in ("mean", "residual"):
                g, e = got[name], w[name]
                if g.shape != e.shape or g.dtype != e.dtype:
                    return (f"{where}: the {name} is {g.dtype} {tuple(g.shape)}, expected "
                            f"{e.dtype} {tuple(e.shape)}")
                if not forward().close(g, e):
                    error = (g.double() - e.double()).abs().max().item()
                    return f"{where}: wrong {name} (max abs error {error:.3g})"
    return ""


# ------------------------------------------------------------------ the written question

def ddp_bytes_formula(n_params, world_size, bytes_per_element, accumulation_steps, no_sync) -> int:
    """One ring all-reduce of the flat gradients per synchronised backward: 2 (p - 1) chunks
    of ceil(n / p) elements; with no_sync one per step, without it one per micro-batch."""
    syncs = 1 if no_sync else accumulation_steps
    return syncs * 2 * (world_size - 1) * -(-n_params // world_size) * bytes_per_element


DDP_BYTES = question(
    "ddp_bytes_per_step", "Bytes a rank sends for its gradients per optimizer step",
    ddp_bytes_formula,
    {"n_params": (124_439_808, 1_200, 350_000_017, 6_700_000_000, 1_000_003),
     "world_size": (1, 2, 3, 8, 64), "bytes_per_element": (2, 4),
     "accumulation_steps": (1, 4, 16), "no_sync": (True, False)},
    fixed=({"n_params": 1_000, "world_size": 3, "bytes_per_element": 4, "accumulation_steps": 8,
            "no_sync": False},
           {"n_params": 1_000_003, "world_size": 8, "bytes_per_element": 2,
            "accumulation_steps": 4, "no_sync": True},
           {"n_params": 1_000, "world_size": 1, "bytes_per_element": 2, "accumulation_steps": 4,
            "no_sync": True}),
    banned=("reference.course.homework.data_parallel_transfer.ddp_bytes_formula",
            "reference.comms.ring.ring_sent_bytes", "reference.comms.cost"))
