"""Homework 04's shared checks: taking hand-written action lists, and running them.

Every exercise of homework 04 that writes a schedule goes the same way:

* inside a rank, `student_lists` calls the student's function for every rank of the
  pipeline while `no_course_schedules` keeps the course's `build_schedule` switched
  off, and `plain_actions` turns each list into plain data
  ``[[op, mb, chunk, peer or -1], ...]`` that a rank may send back;
* `run_lists` runs this rank's list with the course's executor on a tiny untied GPT
  (`model_config`), split into ``pp * virtual`` stages, and sends back the loss and
  the gradients of the stages it holds;
* in the grader, `schedule_of` rebuilds the `Schedule`, `single_process` computes the
  loss and gradients of one process on the full batch, and `judge_run` compares them
  within the course's bounds (reasoned in reference/tolerance.py): `loss()` for the loss,
  `gradient(m)` for a gradient summed over m micro-batches in another order.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from reference.course.homework.guard import NotAllowedError
from reference.pipeline_parallel import schedules as pipeline_schedules
from reference.pipeline_parallel.schedules import Action, Schedule, ScheduleError
from reference.tolerance import Tolerance, gradient, loss as loss_tolerance

__all__ = ["MODEL", "SEQ_LEN", "no_course_schedules", "plain_actions",
           "student_lists", "model_config", "run_lists", "schedule_of", "single_process",
           "judge_run", "differs", "batch_case"]

# Tiny untied GPT (no tied-weight all-reduce: the executor then needs only send/recv).
MODEL = dict(vocab_size=32, block_size=4, n_head=2, n_embd=16, tie_weights=False)
SEQ_LEN = 4


# ------------------------------------------------------------------ inside a rank

@contextlib.contextmanager
def no_course_schedules(exercise: str):
    """While open, the course's `build_schedule` refuses to build a schedule.

    Every built schedule passes through `_compute_groups`, which is looked up when
    called: replacing it catches `build_schedule` however it was imported."""
    original = pipeline_schedules._compute_groups

    def refused(*args, **kwargs):
        raise NotAllowedError(f"build_schedule is not allowed in this exercise ({exercise}): "
                              f"write the action list yourself")

    pipeline_schedules._compute_groups = refused
    try:
        yield
    finally:
        pipeline_schedules._compute_groups = original


def plain_actions(items) -> tuple[list, str]:
    """The student's list as [[op, mb, chunk, peer or -1], ...], and "" (or why it is not one)."""
    if not isinstance(items, (list, tuple)):
        return [], f"a {type(items).__name__}, not a list of actions"
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or not 2 <= len(item) <= 4:
            return [], (f"item #{i} is a {type(item).__name__}, not an Action or a tuple "
                        f"(op, mb, chunk, peer)")
        a = Action(*item)
        fields = (a.mb, a.chunk) + (() if a.peer is None else (a.peer,))
        if not isinstance(a.op, str) or not all(isinstance(x, int) for x in fields):
            return [], f"item #{i} {tuple(item)!r}: op must be a str, mb, chunk and peer ints"
        out.append([a.op, int(a.mb), int(a.chunk), -1 if a.peer is None else int(a.peer)])
    return out, ""


def student_lists(exercise: str, fn, pp: int, m: int, *extra) -> tuple[list, str]:
    """Every rank's list from ``fn(pp, m, *extra, rank)`` (its exceptions propagate:
    NotImplementedError is news), and "" (or why one is not a list of actions)."""
    lists = []
    with no_course_schedules(exercise):
        for rank in range(pp):
            plain, why = plain_actions(fn(pp, m, *extra, rank))
            if why:
                where = ", ".join(f"{k}={v}" for k, v in zip(("pp", "m", "v"), (pp, m, *extra)))
                return [], f"your list for rank {rank} ({where}): {why}"
            lists.append(plain)
    return lists, ""


def model_config(n_layer: int):
    from reference.model import GPTConfig

    return GPTConfig(n_layer=n_layer, **MODEL)


def schedule_of(pp: int, m: int, lists: list, virtual: int = 1) -> Schedule:
    """A `Schedule` from plain lists [[op, mb, chunk, peer or -1], ...] per rank."""
    if len(lists) != pp:
        raise ScheduleError(f"expected the lists of pp={pp} ranks, got {len(lists)}")
    return Schedule(pp, m, {r: [Action(str(op), int(mb), int(c), None if p == -1 else int(p))
                                for op, mb, c, p in lists[r]] for r in range(pp)},
                    virtual=virtual, kind="yours")


def run_lists(lists: list, case: dict, virtual: int = 1) -> dict:
    """In a rank: run this rank's list with the executor when the lists form a valid
    schedule ({"ran": False} otherwise: the grader says why from the same lists)."""
    from reference.model import GPT
    from reference.pipeline_parallel import run_pipeline
    from reference.pipeline_parallel.stage import local_stages, split_stages

    out = {"ran": False, "loss": None, "grads": {}}
    try:
        schedule = schedule_of(case["pp"], case["m"], lists, virtual).validate()
    except ScheduleError:
        return out
    model = GPT.from_config_seed(model_config(case["n_layer"]), seed=case["seed"])
    stages = local_stages(split_stages(model, case["pp"], virtual), case["pp"], dist.get_rank())
    result = run_pipeline(schedule, stages, case["x"], case["y"])
    out.update(ran=True, loss=None if result.loss is None else result.loss.detach().clone(),
               grads={n: p.grad.detach().clone() for s in stages
                      for n, p in s.named_parameters() if p.grad is not None})
    return out


# ------------------------------------------------------------------ in the grader

def batch_case(generator: torch.Generator, pp: int, m: int, n_layer: int, **extra) -> dict:
    """A run's inputs: m micro-batches of 1 or 2 sequences, a seed for the model."""
    mb_size = int(torch.randint(1, 3, (), generator=generator))
    tokens = torch.randint(0, MODEL["vocab_size"], (m * mb_size, SEQ_LEN + 1),
                           generator=generator)  # (B, T + 1)
    return {"pp": pp, "m": m, "n_layer": n_layer, **extra,
            "seed": int(torch.randint(0, 2**31 - 1, (), generator=generator)),
            "x": tokens[:, :-1].contiguous(), "y": tokens[:, 1:].contiguous()}  # (B, T)


def single_process(case: dict) -> dict:
    """The truth: the full batch through the whole model in one process."""
    from reference.model import GPT

    model = GPT.from_config_seed(model_config(case["n_layer"]), seed=case["seed"])
    _, loss = model(case["x"], case["y"])
    loss.backward()
    return {"loss": loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def differs(got, want, tol: Tolerance) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"has shape {tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}"
    if tol.close(got, want):
        return ""
    return f"differs (max abs error {(got.double() - want.double()).abs().max().item():.3g})"


def judge_run(outputs: list, want: dict, micro_batches: int) -> str:
    """"" when the ranks ran their lists and the last one's loss and every rank's
    gradients equal one process's (each parameter on exactly one rank), the gradients
    summed over `micro_batches`."""
    if not all(o["ran"] for o in outputs):
        return f"ranks {[r for r, o in enumerate(outputs) if not o['ran']]} did not run the schedule"
    last = outputs[-1]["loss"]
    if last is None or (why := differs(last, want["loss"], loss_tolerance())):
        return f"run by the executor, the loss {why or 'is missing on the last rank'}"
    seen = {}
    for rank, out in enumerate(outputs):
        for name, grad in out["grads"].items():
            if name not in want["grads"] or name in seen:
                return f"rank {rank} returned a gradient for {name!r} it should not hold"
            seen[name] = rank
            if why := differs(grad, want["grads"][name], gradient(micro_batches)):
                return f"run by the executor, rank {rank}'s gradient of {name} {why}"
    if missing := sorted(set(want["grads"]) - set(seen)):
        return f"no rank computed the gradient of {', '.join(missing[:3])}"
    return ""
