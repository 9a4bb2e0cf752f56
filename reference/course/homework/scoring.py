"""Score one exercise: run the student's function on fresh ranks and judge the results here.

The trust boundary is the point of this module. The student's function arrives as
cloudpickle bytes, and is unpickled (which may run code) only inside ranks
started by `reference.runtime.launch(..., safe_results=True)`, so a rank can send
back nothing but tensors, numbers, strings and containers of them. The inputs
come from a seed only the grader knows; each rank reads its own inputs from a
file and deletes it, and all ranks pass a barrier before any student code is
loaded, so no rank can read another's inputs. The expected answers are computed
by `spec.expect` in the grader's own process, from the inputs it generated. The grader
grades several submissions at once in threads of that process, and making cases or expected
answers may use process-wide state (the default random generator: a dropout mask drawn from
a seed), so both run under one lock (`GRADER_STATE`): a grade never depends on what else is
graded beside it. In
the rank, every call of the student's function goes through `spec.call` under the
exercise's rules (`guard`: its forbidden collectives switched off) and its
`Refusal` (`refuse`: the course's own answers, `spec.banned` and the expected
answers of every homework, refuse to run from the student's code).

One launch per world size runs every case of the exercise but those marked ``alone`` (the
subgroup cases), each of which then runs in a launch of its own: one that times out is named
and costs only itself. When the shared launch fails:
  * NotImplementedError: the exercise is not done; no further launches.
  * timeout (a rank waits for a message nobody sends): the remaining world sizes
    are not tried (each would cost a full timeout).
  * NotAllowedError (a forbidden collective, or the course's own answer called):
    every case would do it again; the exercise scores 0 with that reason.
  * any other exception: each case is run alone, so that partial credit is exact.
An exercise is worth `weight(spec)` points, set by its difficulty (`WEIGHTS`: easy 2,
medium 4, hard 6) unless the spec names its own (a warm-up close to the lecture: 1);
its cases share that weight equally, so the score is weight x passed / cases, and each
failed case carries a one-line reason. A homework may set `wrong_keeps` (its module's
WRONG_KEEPS): an answer that fails any case keeps at most that share of the weight, so that an
answer wrong in principle, which most cases cannot show, still loses half (0.5). A `bonus` exercise adds its points to the total
but not to the maximum.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import cloudpickle
import torch
import torch.distributed as dist

from reference.runtime import RankError, RankTimeoutError, launch
from reference.course.homework.guard import COLLECTIVES, exercise_rules
from reference.course.homework.refuse import refusal_for

__all__ = ["GRADER_STATE", "Case", "ExerciseSpec", "ExerciseScore", "score_exercise", "one_line", "WEIGHTS", "WARM_UP",
           "weight"]

# Points of an exercise by its difficulty (its stars), unless its spec sets `weight`.
WEIGHTS = {1: 2, 2: 4, 3: 6}
WARM_UP = 1  # a warm-up close to a lecture cell: worth little
# Held while cases or expected answers are computed in this process: they may seed and draw
# from torch's default generator, which every grading thread shares.
GRADER_STATE = threading.RLock()


@dataclass
class Case:
    """One input per rank, e.g. name "float32 (5,)" and `world_size` tensors. ``alone``: run in
    a launch of its own (a subgroup case: an answer that forgets its group hangs there, and a
    hang must cost that case only, named, while the other cases are graded on their own)."""
    name: str
    inputs: list
    alone: bool = False


@dataclass(frozen=True)
class ExerciseSpec:
    """What the grader needs to know about one exercise.

    make_cases(generator, world_size) -> list[Case]  in the grader (seeded, private)
    call(student_fn, tensor) -> dict of plain data    in a rank, around the student's call
    expect(inputs) -> expected output per rank        in the grader (the hidden checks)
    reference(tensor) -> expected output              in a rank, torch.distributed's own
                                                      collective (the visible checks)
    judge(inputs, expected, outputs, world_size) -> str   "" passes, else why not
    banned: dotted names of `reference` functions, classes or modules whose code the
            student's function must not run (the course's own answer to the exercise
            first, with the exercise's signature; then its close relatives); the
            course's homework and checks code is refused besides (`refuse.Refusal`)
    weight: the exercise's points (None: by its stars, `WEIGHTS`)
    bonus:  optional: its points add to a submission's total, not to the maximum
    subgroup_sizes: the world sizes with cases on a subgroup (`subgroup.on_subgroup`)
    """
    id: str
    title: str
    difficulty: str
    world_sizes: tuple
    make_cases: Callable
    call: Callable
    expect: Callable
    judge: Callable
    reference: Callable
    forbidden: tuple = COLLECTIVES
    banned: tuple = ()
    weight: float | None = None
    bonus: bool = False
    wrong_keeps: float = 1.0  # the share an answer failing any case keeps at most
    subgroup_sizes: tuple = ()


def weight(spec: ExerciseSpec) -> float:
    """The points `spec` is worth: its own weight, else its stars' (`WEIGHTS`)."""
    if spec.weight is not None:
        return spec.weight
    stars = spec.difficulty.count("★")
    if stars not in WEIGHTS:
        raise ValueError(f"{spec.id}: difficulty {spec.difficulty!r} has no stars to weigh")
    return WEIGHTS[stars]


def _number(value: float):
    """2.0 -> 2, 1.3333 -> 1.33: points as a person reads them."""
    value = round(value, 2)
    return int(value) if value == int(value) else value


@dataclass
class ExerciseScore:
    """`points` of `max` are the cases passed of the cases run; `weighted()` is the grade."""
    id: str
    points: int
    max: int
    reason: str = ""
    failures: list = field(default_factory=list)  # one line per failed case
    weight: float = 1.0
    bonus: bool = False
    wrong_keeps: float = 1.0

    def weighted(self) -> float:
        """The exercise's points: its weight times the share of its cases passed, at most
        `wrong_keeps` of it when any case failed."""
        if not self.max:
            return 0
        share = self.points / self.max
        return _number(self.weight * (share if share == 1 else min(share, self.wrong_keeps)))

    def as_dict(self) -> dict:
        return {"id": self.id, "points": self.weighted(), "max": _number(self.weight),
                "bonus": self.bonus, "cases_passed": self.points, "cases": self.max,
                "reason": self.reason, "failures": list(self.failures)}


def one_line(text: str, limit: int = 200) -> str:
    """Text from an untrusted source, made fit for one line of a report."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _generator(seed: int, exercise: str, world_size: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{exercise}/{world_size}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _rank_entry(spec: ExerciseSpec, fn_bytes: bytes, input_dir: str) -> dict:
    """Runs in each rank: take this rank's inputs, hide them, then run the student's code."""
    rank = dist.get_rank()
    path = os.path.join(input_dir, f"rank{rank}.pt")
    cases = torch.load(path, weights_only=True)  # {case name: this rank's tensor}
    os.remove(path)
    dist.barrier()  # every rank has taken and deleted its file: nothing left to read
    os.chdir(input_dir)
    results = {}
    refusal = refusal_for(spec)  # before the rules: it imports the modules it reads
    # The rules go in first: names the student's code imports resolve to the guarded ones.
    with exercise_rules(spec.id, spec.forbidden) as traffic:
        fn = cloudpickle.loads(fn_bytes)
        for name, tensor in cases.items():
            traffic.clear()
            out = refusal.run(spec.call, fn, tensor)
            out["sends"] = [[-1 if p is None else int(p), int(n)] for p, n in traffic.sends]
            out["recvs"] = [[-1 if p is None else int(p), int(n)] for p, n in traffic.recvs]
            results[name] = out
    return results


def _launch_cases(spec, fn_bytes, world_size, cases, timeout, cleanup):
    """{case name: per-rank outputs} for `cases` run in one launch."""
    input_dir = tempfile.mkdtemp(prefix="grade-inputs-")
    try:
        for rank in range(world_size):
            torch.save({c.name: c.inputs[rank] for c in cases},
                       os.path.join(input_dir, f"rank{rank}.pt"))
        results = launch(_rank_entry, world_size, spec, fn_bytes, input_dir, timeout=timeout,
                         quiet=True, safe_results=True)
    finally:
        shutil.rmtree(input_dir, ignore_errors=True)
        if cleanup is not None:
            cleanup()
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise RankError("a rank returned something other than the results of its cases")
    return {c.name: [r.get(c.name) for r in results] for c in cases}


def _judge(spec, case, outputs, world_size) -> str:
    if any(not isinstance(o, dict) for o in outputs):
        return "a rank returned no result for this case"
    try:
        with GRADER_STATE:
            expected = spec.expect(case.inputs)
        return spec.judge(case.inputs, expected, outputs, world_size)
    except Exception as exc:  # noqa: BLE001 - malformed outputs from a rank fail the case
        return f"malformed result ({one_line(type(exc).__name__ + ': ' + str(exc), 120)})"


def _error_text(err: RankError) -> str:
    summary = (getattr(err, "failures", None) or {}).get(err.rank)
    return one_line(summary or str(err).splitlines()[0])


def _timeout_text(timeout, world_size):
    return (f"timed out after {timeout:g} s on {world_size} ranks (a rank waits for a message "
            f"that is never sent?)")


def score_exercise(spec: ExerciseSpec, fn_bytes: bytes | None, seed: int, timeout: float,
                   missing: str = "not defined by the notebook",
                   cleanup: Callable[[], None] | None = None) -> ExerciseScore:
    """Points for `spec` earned by the pickled function `fn_bytes` (None: `missing` says why).

    `cleanup` runs after every launch (the grader kills processes a rank left behind)."""
    with GRADER_STATE:
        plan = [(ws, spec.make_cases(_generator(seed, spec.id, ws), ws)) for ws in spec.world_sizes]
    lost: list[tuple[int, str, str]] = []  # (world size, case name, reason)
    stop = None if fn_bytes is not None else missing
    for world_size, every_case in plan:
        if stop:
            lost += [(world_size, c.name, stop) for c in every_case]
            continue
        stop = _score_together(spec, fn_bytes, world_size, [c for c in every_case if not c.alone],
                               timeout, cleanup, lost)
        for case in (c for c in every_case if c.alone):  # after the others: each on its own
            if stop:
                lost.append((world_size, case.name, stop))
                continue
            try:
                out = _launch_cases(spec, fn_bytes, world_size, [case], timeout, cleanup)
                why = _judge(spec, case, out[case.name], world_size)
            except RankTimeoutError:  # this case alone: the rest of the exercise goes on
                why = (f"timed out after {timeout:g} s on {world_size} ranks, this case alone (a "
                       f"collective without group=group waits for a rank outside the group?)")
            except RankError as err:
                text = _error_text(err)
                why = f"raised {text}"
                if text.startswith("NotImplementedError"):
                    stop = why = "not implemented (raises NotImplementedError)"
                elif text.startswith("NotAllowedError"):
                    stop = why = text
            if why:
                lost.append((world_size, case.name, why))
    total = sum(len(cases) for _, cases in plan)
    return ExerciseScore(id=spec.id, points=total - len(lost), max=total,
                         reason=summarize(lost, total),
                         failures=[f"{ws} ranks, {name}: {why}" for ws, name, why in lost],
                         weight=weight(spec), bonus=spec.bonus, wrong_keeps=spec.wrong_keeps)


def _score_together(spec, fn_bytes, world_size, cases, timeout, cleanup, lost) -> str | None:
    """Run ``cases`` in one launch (each alone if one raises), appending (world size, case,
    reason) to ``lost`` for each that fails; returns why every later case would fail too
    (not implemented, not allowed, a hang), or None."""
    if not cases:
        return None
    stop = None
    try:
        outputs = _launch_cases(spec, fn_bytes, world_size, cases, timeout, cleanup)
        lost += [(world_size, c.name, why) for c in cases
                 if (why := _judge(spec, c, outputs[c.name], world_size))]
        return None
    except RankTimeoutError:
        stop = _timeout_text(timeout, world_size)
    except RankError as err:
        text = _error_text(err)
        if text.startswith("NotImplementedError"):
            stop = "not implemented (raises NotImplementedError)"
        elif text.startswith("NotAllowedError"):
            stop = text  # a forbidden collective: every case would call it again
        elif len(cases) == 1:
            lost.append((world_size, cases[0].name, f"raised {text}"))
            return None
    if stop:
        lost += [(world_size, c.name, stop) for c in cases]
        return stop
    # Some case raised: run each alone to find which.
    for case in cases:
        try:
            out = _launch_cases(spec, fn_bytes, world_size, [case], timeout, cleanup)
            why = _judge(spec, case, out[case.name], world_size)
        except RankTimeoutError:
            why = stop = _timeout_text(timeout, world_size)
        except RankError as err:
            why = f"raised {_error_text(err)}"
        if why:
            lost.append((world_size, case.name, why))
        if stop:
            lost += [(world_size, c.name, stop) for c in cases[cases.index(case) + 1:]]
            return stop
    return None


def summarize(lost: list, total: int, limit: int = 300) -> str:
    """One line: each kind of reason once (its first instance), with the cases it cost.

    Reasons that differ only in their numbers (ranks, errors, counts) are one kind."""
    if not lost:
        return ""
    groups: dict[str, tuple[str, list[str]]] = {}
    for ws, name, why in lost:
        kind = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", why)
        groups.setdefault(kind, (why, []))[1].append(f"{ws} ranks {name}")
    if len(groups) == 1 and len(lost) == total:
        return one_line(lost[0][2], limit)  # one reason for every case: no list needed
    parts = [f"{why} [{len(cases)} case{'s' * (len(cases) > 1)}: {', '.join(cases[:2])}"
             f"{', …' if len(cases) > 2 else ''}]" for why, cases in groups.values()]
    return one_line("; ".join(parts), limit)
