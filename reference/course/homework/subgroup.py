"""Cases on a subgroup: an exercise that takes `group=` graded where group and global ranks differ.

An exercise whose function takes `group=None` promises to work on any process group, not
only the whole world: the ranks of a subgroup are numbered 0 .. size - 1 within it
(`dist.get_rank(group)`), point-to-point peers are named by group rank (`group_dst=`,
`group_src=`) or turned into global ranks (`dist.get_global_rank(group, r)`), and a
collective called without `group=` runs over every rank instead. On the whole world
these coincide, so the cases of the whole world cannot tell a right answer from one that
confuses the two numberings or forgets the group.

`on_subgroup(spec, sizes, pick)` is `spec` with more cases: on each world size w in
`sizes`, the cases `spec` makes for w - 1 ranks (those `pick` names, by position), run on
the subgroup of global ranks 1 .. w - 1 (group rank i is global rank i + 1; rank 0 stays
out). Each runs in a launch of its own (``Case.alone``), after the world's cases: an answer
that forgets its group hangs there, and the grader names that case and grades the others
on their own. In a rank, every rank creates the group (`new_group` is
collective over the world), rank 0 returns at once, and the members run `spec.call`
with the student's function bound to `group=` the subgroup. In the grader, the members'
point-to-point peers (recorded as global ranks) must be members; they are then turned into
group ranks, and `spec.expect` and `spec.judge` see a world of w - 1 ranks, so the
exercise's own rules hold within the group. Inputs of the whole world pass through
unchanged, so the visible checks, which call the spec's functions directly, are unaffected.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from reference.course.homework.scoring import Case, ExerciseSpec

__all__ = ["on_subgroup", "MEMBERS"]

MEMBERS = "subgroup_members"  # the key of a subgroup case's per-rank input


def _is_subgroup(value) -> bool:
    return isinstance(value, dict) and MEMBERS in value


def _peers_in_group(outputs: list, members: list) -> str:
    """"" when every member's messages went to and came from members of the group."""
    for i, g in enumerate(members):
        for kind, log in (("sent to", outputs[g].get("sends", ())),
                          ("received from", outputs[g].get("recvs", ()))):
            for peer, _ in log:
                if peer != -1 and peer not in members:
                    return (f"group rank {i} (global rank {g}) {kind} global rank {peer}, which "
                            f"is not in the group {members}: name peers by group rank "
                            f"(group_dst=, group_src=) or turn them into global ranks "
                            f"(dist.get_global_rank(group, r))")
    return ""


def _within_group(out: dict, members: list) -> dict:
    """A member's output with its peers turned from global ranks into group ranks."""
    index = {g: i for i, g in enumerate(members)}
    out = dict(out)
    for key in ("sends", "recvs"):
        if key in out:
            out[key] = [[index.get(peer, peer), n] for peer, n in out[key]]
    return out


def on_subgroup(spec: ExerciseSpec, sizes: tuple, pick: tuple) -> ExerciseSpec:
    """`spec` with, on each world size in `sizes`, the cases at positions `pick` of the
    cases it makes for world - 1 ranks, run on the subgroup of global ranks 1 .. world - 1."""
    inner_cases, inner_call, inner_expect, inner_judge = (spec.make_cases, spec.call,
                                                          spec.expect, spec.judge)

    def make_cases(generator: torch.Generator, world_size: int) -> list[Case]:
        cases = inner_cases(generator, world_size)
        if world_size not in sizes:
            return cases
        members = list(range(1, world_size))
        drawn = inner_cases(generator, len(members))
        for case in (drawn[i] for i in pick):
            inputs = [{MEMBERS: members}] + [{MEMBERS: members, "input": x} for x in case.inputs]
            cases.append(Case(f"{case.name}, on the subgroup of global ranks {members} "
                              f"(group rank i is global rank i + 1)", inputs, alone=True))
        return cases

    def call(fn, case):
        if not _is_subgroup(case):
            return inner_call(fn, case)
        group = dist.new_group(case[MEMBERS])  # every rank, members or not, in the same order
        if "input" not in case:
            return {"member": False}
        return inner_call(functools.partial(fn, group=group), case["input"])

    def expect(inputs: list):
        if not _is_subgroup(inputs[0]):
            return inner_expect(inputs)
        members = inputs[0][MEMBERS]
        return inner_expect([inputs[g]["input"] for g in members])

    def judge(inputs: list, expected, outputs: list, world_size: int) -> str:
        if not _is_subgroup(inputs[0]):
            return inner_judge(inputs, expected, outputs, world_size)
        members = inputs[0][MEMBERS]
        if why := _peers_in_group(outputs, members):
            return why
        why = inner_judge([inputs[g]["input"] for g in members], expected,
                          [_within_group(outputs[g], members) for g in members], len(members))
        return f"{why} (ranks counted within the group)" if why else ""

    return dataclasses.replace(spec, make_cases=make_cases, call=call, expect=expect, judge=judge,
                               subgroup_sizes=tuple(sizes))
