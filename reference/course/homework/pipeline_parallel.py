"""Hidden checks of homework 04: GPipe's and 1F1B's action lists, written by hand.

The student writes `fn(pp, m, rank)`, the list of `Action`s (or plain tuples
``(op, mb, chunk, peer)``) that pipeline rank `rank` runs for `m` micro-batches.
Inside a rank the check calls it for every rank of the pipeline (the course's
`build_schedule` is switched off meanwhile: the list must be the student's own)
and sends back the lists as plain data. Here, in the grader, they are rebuilt
into a `Schedule` and judged:

* the course's checker: every list complete, every message matched, no deadlock;
* the order of computation: GPipe runs the m forwards, in order, before any
  backward; 1F1B keeps at most ``pp - rank`` micro-batches in flight on rank `rank`;
* the simulated timeline (a forward takes 1, a backward 2, messages are free) has
  the textbook bubble (p - 1) / (m + p - 1): a message posted too late, or a
  schedule that pipelines less, makes it larger;
* 1F1B only: the ranks also *run* their lists with the course's executor on a
  tiny GPT (pp = 2 and 4 ranks, untied weights, layers that do not always divide
  by pp); the loss and every parameter's gradient must equal those of one
  process on the full batch (rtol=1e-5, atol=1e-6, the course's fp32 tolerance).

Cases: GPipe on one rank for pipelines of 1 to 5 stages; 1F1B on 2 and 4 ranks;
both with m = 1, m < pp, m = pp and m > pp, some m not a multiple of pp.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from reference.pipeline_parallel import schedules as pipeline_schedules
from reference.pipeline_parallel.schedules import Action, Schedule, ScheduleError, bubble_formula
from reference.course.homework.guard import NotAllowedError
from reference.course.homework.scoring import Case, ExerciseSpec, one_line

__all__ = ["GPIPE", "ONE_F_ONE_B", "EXERCISES", "TOLERANCE", "plain_actions", "schedule_from",
           "no_course_schedules", "model_config"]

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
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


def _student_lists(exercise: str, fn, pp: int, m: int) -> tuple[list, str]:
    """Every rank's list from `fn` (its exceptions propagate: NotImplementedError is news)."""
    lists = []
    with no_course_schedules(exercise):
        for rank in range(pp):
            plain, why = plain_actions(fn(pp, m, rank))
            if why:
                return [], f"your list for rank {rank} (pp={pp}, m={m}): {why}"
            lists.append(plain)
    return lists, ""


def call_gpipe(fn, case: dict) -> dict:
    lists, error = _student_lists("gpipe_actions", fn, case["pp"], case["m"])
    return {"actions": lists, "error": error}


def model_config(n_layer: int):
    from reference.model import GPTConfig

    return GPTConfig(n_layer=n_layer, **MODEL)


def call_one_f_one_b(fn, case: dict) -> dict:
    """Build the schedule from the student's lists and, when it is valid, run it here."""
    from reference.model import GPT
    from reference.pipeline_parallel.executor import run_pipeline
    from reference.pipeline_parallel.stage import local_stages, split_stages

    pp, m = case["pp"], case["m"]
    lists, error = _student_lists("one_f_one_b_actions", fn, pp, m)
    out = {"actions": lists, "error": error, "ran": False, "loss": None, "grads": {}}
    if error:
        return out
    try:
        schedule = schedule_from(pp, m, lists).validate()
    except ScheduleError:
        return out  # the grader validates the same lists itself and says why
    rank = dist.get_rank()
    model = GPT.from_config_seed(model_config(case["n_layer"]), seed=case["seed"])
    stages = local_stages(split_stages(model, pp), pp, rank)
    result = run_pipeline(schedule, stages, case["x"], case["y"])
    out.update(ran=True, loss=None if result.loss is None else result.loss.detach().clone(),
               grads={n: p.grad.detach().clone() for s in stages
                      for n, p in s.named_parameters() if p.grad is not None})
    return out


def course_actions(case: dict, kind: str) -> list:
    """The course's own lists for the case, as plain data."""
    s = pipeline_schedules.build_schedule(kind, case["pp"], case["m"])
    return [plain_actions(s.actions(r))[0] for r in range(case["pp"])]


def course_gpipe(case: dict) -> list:
    return course_actions(case, "gpipe")


def course_one_f_one_b(case: dict) -> list:
    return course_actions(case, "1f1b")


# ------------------------------------------------------------------ in the grader

def schedule_from(pp: int, m: int, lists: list) -> Schedule:
    """A `Schedule` from plain lists [[op, mb, chunk, peer or -1], ...] per rank."""
    if len(lists) != pp:
        raise ScheduleError(f"expected the lists of pp={pp} ranks, got {len(lists)}")
    return Schedule(pp, m, {r: [Action(str(op), int(mb), int(c), None if p == -1 else int(p))
                                for op, mb, c, p in lists[r]] for r in range(pp)},
                    kind="yours")


def _compute_order(schedule: Schedule, rank: int) -> str:
    return " ".join(f"{a.op}{a.mb}" for a in schedule.actions(rank) if not a.is_comm)


def _judge_schedule(case: dict, out: dict, expected: dict, order_rule) -> str:
    """The checks both exercises share: valid, ordered as the schedule says, smallest bubble."""
    pp, m = case["pp"], case["m"]
    if out["error"]:
        return one_line(out["error"])
    try:
        schedule = schedule_from(pp, m, out["actions"]).validate()
    except ScheduleError as err:
        return "invalid schedule: " + one_line(err, 180)
    for rank in range(pp):
        if why := order_rule(schedule, rank):
            return f"rank {rank}: {why}"
    bubble = schedule.bubble_fraction()
    if bubble > expected["bubble"] + 1e-9:
        return (f"bubble {bubble:.3f} in the simulated timeline, more than (p-1)/(m+p-1) = "
                f"{expected['bubble']:.3f}: some rank waits for a message posted later than "
                f"needed, or the ranks pipeline less than they could")
    return ""


def _gpipe_order(schedule: Schedule, rank: int) -> str:
    m = schedule.m
    ops = [(a.op, a.mb) for a in schedule.actions(rank) if not a.is_comm]
    if ops[:m] != [("F", i) for i in range(m)]:
        return (f"GPipe runs the forwards F0..F{m - 1} in order before any backward; yours "
                f"computes {_compute_order(schedule, rank)}")
    return ""


def _one_f_one_b_order(schedule: Schedule, rank: int) -> str:
    pp = schedule.pp
    peak = schedule.peak_in_flight(rank)
    if peak > pp - rank:
        return (f"holds the activations of {peak} micro-batches at once; 1F1B holds at most "
                f"pp - rank = {pp - rank} (yours computes {_compute_order(schedule, rank)})")
    return ""


def expect_gpipe(inputs: list) -> list:
    case = inputs[0]
    return [{"bubble": bubble_formula("gpipe", case["pp"], case["m"])}] * len(inputs)


def judge_gpipe(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    return _judge_schedule(inputs[0], outputs[0], expected[0], _gpipe_order)


def expect_one_f_one_b(inputs: list) -> list:
    """The single-process truth: the full batch through the whole model."""
    from reference.model import GPT

    case = inputs[0]
    model = GPT.from_config_seed(model_config(case["n_layer"]), seed=case["seed"])
    _, loss = model(case["x"], case["y"])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return [{"bubble": bubble_formula("1f1b", case["pp"], case["m"]), "loss": loss.detach(),
             "grads": grads}] * len(inputs)


def _differs(got, want) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"has shape {tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}"
    if torch.allclose(got, want, **TOLERANCE):
        return ""
    return f"differs (max abs error {(got.double() - want.double()).abs().max().item():.3g})"


def judge_one_f_one_b(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    case, want = inputs[0], expected[0]
    # The list each rank ran is its own; the ranks' copies of the others' are not needed.
    mine = dict(outputs[0], actions=[o["actions"][r] if len(o["actions"]) > r else []
                                     for r, o in enumerate(outputs)])
    if why := _judge_schedule(case, mine, want, _one_f_one_b_order):
        return why
    if not all(o["ran"] for o in outputs):
        return f"ranks {[r for r, o in enumerate(outputs) if not o['ran']]} did not run the schedule"
    last = outputs[-1]["loss"]
    if last is None or (why := _differs(last, want["loss"])):
        return f"run by the executor, the loss {why or 'is missing on the last rank'}"
    seen = {}
    for rank, out in enumerate(outputs):
        for name, grad in out["grads"].items():
            if name not in want["grads"] or name in seen:
                return f"rank {rank} returned a gradient for {name!r} it should not hold"
            seen[name] = rank
            if why := _differs(grad, want["grads"][name]):
                return f"run by the executor, rank {rank}'s gradient of {name} {why}"
    if missing := sorted(set(want["grads"]) - set(seen)):
        return f"no rank computed the gradient of {', '.join(missing[:3])}"
    return ""


# ------------------------------------------------------------------ cases

def make_gpipe_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    # a pipeline of one, m = 1, m < pp, m = pp, m > pp (a multiple of pp or not)
    sizes = [(1, draw(1, 4)), (2, 1), (3, 2), (4, 4), (4, draw(5, 9)), (5, draw(2, 11))]
    return [Case(f"pp={pp} m={m}", [{"pp": pp, "m": m}] * world_size) for pp, m in sizes]


def make_one_f_one_b_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    """pp = world_size; m = 1, below pp, pp and above; micro-batches of 1 or 2 sequences."""
    pp = world_size
    cases = []
    for m in sorted({1, max(pp - 1, 2), pp, pp + 1, 2 * pp + 1}):
        mb_size = int(torch.randint(1, 3, (), generator=generator))
        n_layer = pp + int(torch.randint(0, 2, (), generator=generator))  # uneven split or not
        tokens = torch.randint(0, MODEL["vocab_size"], (m * mb_size, SEQ_LEN + 1),
                               generator=generator)  # (B, T + 1)
        case = {"pp": pp, "m": m, "n_layer": n_layer,
                "seed": int(torch.randint(0, 2**31 - 1, (), generator=generator)),
                "x": tokens[:, :-1].contiguous(), "y": tokens[:, 1:].contiguous()}  # (B, T)
        cases.append(Case(f"pp={pp} m={m} ({n_layer} layers)", [case] * world_size))
    return cases


GPIPE = ExerciseSpec(
    id="gpipe_actions", title="GPipe's action list for one rank", difficulty="★☆☆ easy",
    world_sizes=(1,), make_cases=make_gpipe_cases, call=call_gpipe, expect=expect_gpipe,
    judge=judge_gpipe, reference=course_gpipe)
ONE_F_ONE_B = ExerciseSpec(
    id="one_f_one_b_actions", title="1F1B's action list for one rank, run by the executor",
    difficulty="★★☆ medium", world_sizes=(2, 4), make_cases=make_one_f_one_b_cases,
    call=call_one_f_one_b, expect=expect_one_f_one_b, judge=judge_one_f_one_b,
    reference=course_one_f_one_b)
HOMEWORK_ID = "04_pipeline_parallel"
EXERCISES = (GPIPE, ONE_F_ONE_B)
