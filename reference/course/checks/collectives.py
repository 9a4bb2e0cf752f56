"""Visible self-checks of homework 00 (collectives): feedback while you work, never the grade.

    check_ring_all_reduce(ring_all_reduce)   # prints one PASS or FAIL line, with a hint
    check_ring_all_gather(ring_all_gather)
    check_tree_all_reduce(tree_all_reduce)                      # on 3 and 4 ranks
    check_recursive_doubling_all_reduce(recursive_doubling_all_reduce)
    check_ring_doubling_crossover(ring_doubling_crossover)      # the text's worked value, then the kind

A check runs your function on a few ranks with `reference.runtime.launch`, on
inputs of shapes that do and do not divide by the number of ranks, compares each
rank's result with torch.distributed's own collective on the same inputs, and
checks from the recorded messages that your code really is the algorithm asked for (a
ring, the binomial tree, recursive doubling). It prints a
line (`run_check` also returns True or False); a wrong answer, an exception or a hang is
reported, never raised, so the rest of the notebook keeps running.

The grade comes from hidden checks of the same kind with other inputs
(`reference.course.homework`), not from these: while grading, `skip=True` is passed and
the check does nothing.
"""
from __future__ import annotations

import cloudpickle
import torch
import torch.distributed as dist

from reference.course.checks.questions import Worked, check_question
from reference.course.homework.collectives import ALL_GATHER, ALL_REDUCE, CROSSOVER, DOUBLING, TREE
from reference.course.homework.guard import exercise_rules
from reference.course.homework.refuse import refusal_for
from reference.course.checks.runner import NOT_IMPLEMENTED, describe_launch_failure, run_visible, traffic_rows
from reference.course.homework.scoring import ExerciseSpec
from reference.runtime import RankError, launch

__all__ = ["check_ring_all_reduce", "check_ring_all_gather", "check_tree_all_reduce",
           "check_recursive_doubling_all_reduce", "check_ring_doubling_crossover", "run_check",
           "ALL_REDUCE", "ALL_GATHER"]

# (dtype, shape): one shape that divides by 2 and 3, two that do not, one integer case.
VISIBLE_CASES = (("float32", (6,)), ("float32", (5,)), ("float32", (3, 5)), ("int64", (2, 3)))

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("a collective was called: the exercise builds one from dist.send/recv or "
                    "isend/irecv alone (reread the hints under exercise 1)"),
    "timed out": ("some rank waited for a message never sent: two neighbours each in a blocking "
                  "send? Reread exercise 1's hint on posting a send and a receive together"),
    "not a ring": ("a message went to or came from a rank other than the neighbours: reread the "
                   "ring's rule in 'What you will practise' (rank i talks to (i + 1) % p and "
                   "(i - 1) % p only)"),
    "the ring needs at most": ("more data left a rank than the ring sends: reread exercise 1's "
                               "count (2(p - 1) chunks, one per step)"),
    "wrong sum": ("some chunks hold a wrong sum: reread exercise 1's table of which chunk is sent "
                  "and which is added at step s"),
    "wrong values": ("a block of the result holds another rank's tensor: reread exercise 2's "
                     "contract (block r is rank r's tensor)"),
    "not changed": ("the tensor passed in still holds its own values: reread exercise 1's "
                    "contract (the sum is written in place) and its hint on views"),
    "other than its argument": ("a new tensor came back: reread exercise 1's contract (it "
                                "returns `tensor`)"),
    "not the binomial tree": ("the messages are not the tree's edges: reread exercise 3's parent "
                              "and children (a rank's lowest set bit) and the 6-rank example"),
    "not recursive doubling": ("the messages are not doubling's partners: reread exercise 4's "
                               "three steps (the extra ranks p' + j fold into rank j)"),
    "every message of": ("a message carried part of the tensor: reread 'Every message is the "
                         "whole tensor' in exercises 3 and 4"),
    "different bits": ("ranks ended with sums that differ in the last bits: reread the end of "
                       "exercises 3 and 4 (why every rank holds the same bits)"),
    "not in the group": ("a message went to a rank outside the group: reread exercise 1's hint "
                         "on group_dst=/group_src= (ranks within `group`)"),
    "returned": "the return value is not what the contract says: reread the exercise's contract",
}


def _rank_check(spec: ExerciseSpec, fn_bytes: bytes, cases) -> dict:
    """In each rank: this rank's inputs, torch's answer, and what the student's function gave."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1234 + rank)  # every rank its own values
    inputs, expected = {}, {}
    for dtype, shape in cases:
        name = f"{dtype} {shape}"
        if dtype == "int64":
            inputs[name] = torch.randint(-100, 100, shape, generator=generator)
        else:
            inputs[name] = torch.randn(shape, generator=generator)
        expected[name] = spec.reference(inputs[name])  # before the rules forbid it
    outputs = {}
    refusal = refusal_for(spec)  # the course's own answers refuse to run, as in the grader
    with exercise_rules(spec.id, spec.forbidden) as traffic:
        fn = cloudpickle.loads(fn_bytes)
        for name, tensor in inputs.items():
            traffic.clear()
            out = refusal.run(spec.call, fn, tensor.clone())
            out["sends"], out["recvs"] = traffic_rows(traffic.sends), traffic_rows(traffic.recvs)
            outputs[name] = out
    return {"inputs": inputs, "expected": expected, "outputs": outputs}


def _failure(spec: ExerciseSpec, fn, world_sizes, cases, timeout) -> str:
    """"" when every world size and case passes, else the first failure, on one line."""
    fn_bytes = cloudpickle.dumps(fn)
    for world_size in world_sizes:
        try:
            # Not quiet: what the student's code prints shows, as "[rank r] ..." lines.
            ranks = launch(_rank_check, world_size, spec, fn_bytes, cases, timeout=timeout)
        except RankError as err:
            return describe_launch_failure(err, world_size, timeout,
                                           "a recv waiting for a send that never comes?")
        for name in ranks[0]["inputs"]:
            reason = spec.judge([r["inputs"][name] for r in ranks],
                                [r["expected"][name] for r in ranks],
                                [r["outputs"][name] for r in ranks], world_size)
            if reason:
                return f"on {world_size} ranks, {name}: {reason}"
    return ""


def run_check(spec: ExerciseSpec, fn, world_sizes=(2, 3), cases=VISIBLE_CASES,
              timeout: float = 30.0, skip: bool = False, algorithm: str = "a ring") -> bool | None:
    """Check `fn` as the answer to `spec`; print one line; True/False (None when skipped)."""
    sizes = " and ".join(str(w) for w in world_sizes)
    shapes = ", ".join(f"{d} {s}" for d, s in cases)
    return run_visible(spec, fn, lambda: _failure(spec, fn, tuple(world_sizes), cases, timeout),
                       f"equals torch.distributed's result on {sizes} ranks ({shapes}), as "
                       f"{algorithm}", _HINTS, skip)


# The check_* functions print and return None, so a notebook cell shows only their line.

def check_ring_all_reduce(fn, world_sizes=(2, 3), timeout: float = 30.0,
                          skip: bool = False) -> None:
    """Visible check of exercise ring_all_reduce (compares with dist.all_reduce)."""
    run_check(ALL_REDUCE, fn, world_sizes, timeout=timeout, skip=skip)


def check_ring_all_gather(fn, world_sizes=(2, 3), timeout: float = 30.0,
                          skip: bool = False) -> None:
    """Visible check of exercise ring_all_gather (compares with dist.all_gather_into_tensor)."""
    run_check(ALL_GATHER, fn, world_sizes, timeout=timeout, skip=skip)


def check_tree_all_reduce(fn, world_sizes=(3, 4), timeout: float = 30.0,
                          skip: bool = False) -> None:
    """Visible check of exercise tree_all_reduce (compares with dist.all_reduce)."""
    run_check(TREE, fn, world_sizes, timeout=timeout, skip=skip, algorithm="the binomial tree")


def check_recursive_doubling_all_reduce(fn, world_sizes=(3, 4), timeout: float = 30.0,
                                        skip: bool = False) -> None:
    """Visible check of exercise recursive_doubling_all_reduce (compares with dist.all_reduce)."""
    run_check(DOUBLING, fn, world_sizes, timeout=timeout, skip=skip,
              algorithm="recursive doubling")


def check_ring_doubling_crossover(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question ring_doubling_crossover: the text's worked value
    (4 ranks, alpha 10 us, beta 1 ns a byte: 80,000 bytes), then a finite number."""
    return check_question(CROSSOVER, fn, {"world_size": 8, "alpha": 5e-6, "beta": 1 / 50e9}, "real", skip,
                   worked=(Worked({"world_size": 4, "alpha": 1e-5, "beta": 1e-9}, 80_000.0),))
