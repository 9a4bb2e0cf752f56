"""Homework 00's transfer exercises and written question: right answers earn every point,
the usual mistakes lose the cases they should, with the reason they should.

The solution notebook's answer cells and the mistakes written here are scored directly
with `score_exercise` (no notebook run), as a notebook's functions travel: not importable,
so pickled by value."""
import dataclasses
import math
from pathlib import Path

import cloudpickle
import nbformat
import pytest
from solution_cells import solution_function

from reference.course.homework import homework
from reference.course.homework.collectives import DOUBLING, TREE
from reference.course.homework.collectives_transfer import (
    CROSSOVER, crossover_formula, doubling_messages, tree_messages,
)
from reference.course.homework.questions import QUESTION_RTOL
from reference.course.homework.scoring import score_exercise

TIMEOUT = 60  # s per launch (about 1 s needed); only a hanging answer would wait
# 5 cases (float32 (1,), (7,), (3, 5); float64 (6,); int64 (2, 3)) per world size: the
# tree on 4 and 6 ranks, recursive doubling on 3 and 6; on 6 ranks 2 more, float32 (7,) and
# int64 (2, 3) on the subgroup of ranks 1 .. 5.
CASES_PER_SIZE = 5
SUBGROUP_CASES = 2

ANSWERS = r'''
import math
import torch
import torch.distributed as dist


def star_all_reduce(tensor, group=None):  # right sums, but rank 0 talks to everyone
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, p):
            dist.recv(incoming, group=group, group_src=src)
            tensor += incoming
        for dst in range(1, p):
            dist.send(tensor, group=group, group_dst=dst)
    else:
        dist.send(tensor, group=group, group_dst=0)
        dist.recv(tensor, group=group, group_src=0)
    return tensor


def reduce_only(tensor, group=None):  # up the tree, never back down
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    low = rank & -rank
    span = low if rank else 1 << (p - 1).bit_length()
    incoming = torch.empty_like(tensor)
    for k in range(span.bit_length() - 1):
        if rank + (1 << k) < p:
            dist.recv(incoming, group=group, group_src=rank + (1 << k))
            tensor += incoming
    if rank:
        dist.send(tensor, group=group, group_dst=rank - low)
    return tensor


def _doubling(tensor, group, fold_back=True, extra_peer=None):
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    core = 1 << (p.bit_length() - 1)
    extra_peer = extra_peer or (lambda r: r - core)
    flat, incoming = tensor.view(-1), torch.empty_like(tensor.view(-1))
    helped = [r for r in range(core, p)]
    if rank >= core:
        dist.send(flat, group=group, group_dst=extra_peer(rank))
        if fold_back:
            dist.recv(flat, group=group, group_src=extra_peer(rank))
        return tensor
    mine = [r for r in helped if extra_peer(r) == rank]
    for r in mine:
        dist.recv(incoming, group=group, group_src=r)
        flat.add_(incoming)
    d = 1
    while d < core:
        req = dist.isend(flat, group=group, group_dst=rank ^ d)
        dist.recv(incoming, group=group, group_src=rank ^ d)
        req.wait()
        flat.add_(incoming)
        d *= 2
    if fold_back:
        for r in mine:
            dist.send(flat, group=group, group_dst=r)
    return tensor


def forgets_the_extras(tensor, group=None):  # they hand their tensor in, never get the sum
    return _doubling(tensor, group, fold_back=False)


def folds_onto_the_last(tensor, group=None):  # extra p' + j -> p' - 1 - j: the wrong partner
    core = 1 << (dist.get_world_size(group).bit_length() - 1)
    return _doubling(tensor, group, extra_peer=lambda r: core - 1 - (r - core))


def forgets_the_ring_fraction(world_size, alpha, beta):  # the ring's bytes taken as 2 n
    steps = math.log2(world_size)
    return alpha * (2 * (world_size - 1) - steps) / (beta * (steps - 2))
'''


SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "00_collectives.ipynb"


def _solution() -> dict:
    """The solution notebook's setup and answer cells, run as a student's kernel would."""
    namespace = {"__name__": "homework_under_test"}
    for cell in nbformat.read(SOLUTION, 4).cells:
        if cell.get("id") == "setup" or "exercise" in cell.metadata.get("course", {}):
            exec(cell.source, namespace)
    return namespace


def _answers() -> dict:
    namespace = {"__name__": "homework_under_test"}
    exec(ANSWERS, namespace)
    return namespace


def _score(spec, fn, seed=3):
    return score_exercise(spec, cloudpickle.dumps(fn), seed=seed, timeout=TIMEOUT)


def test_homework_00_has_its_warm_up_the_ring_two_transfers_and_a_question():
    assert [s.id for s in homework("00_collectives")] == [
        "ring_all_reduce", "ring_all_gather", "tree_all_reduce", "recursive_doubling_all_reduce",
        "ring_doubling_crossover"]


def test_the_message_tables_are_the_algorithms():
    # The binomial tree on 6 ranks: 0 <- 1, 2 <- 3, 0 <- 2, 4 <- 5, 0 <- 4.
    assert [[peer for peer, _ in tree_messages(r, 6, 1)[0]] for r in range(6)] == [
        [1, 2, 4], [0], [0, 3], [2], [0, 5], [4]]
    # Recursive doubling on 6 ranks: p' = 4; ranks 4 and 5 fold into 0 and 1.
    assert [[peer for peer, _ in doubling_messages(r, 6, 1)[0]] for r in range(6)] == [
        [1, 2, 4], [0, 3, 5], [0, 3], [1, 2], [0], [1]]
    assert [peer for peer, _ in doubling_messages(3, 8, 1)[0]] == [1, 2, 7]


def test_tree_solution_scores_full_marks():
    score = _score(TREE, _solution()["tree_all_reduce"])
    assert score.points == score.max == 2 * CASES_PER_SIZE + SUBGROUP_CASES, score.failures


def test_tree_a_star_has_the_right_sums_and_loses_every_case():
    # On 4 ranks (and 6) rank 0 talks to ranks the tree leaves to others (3; 3 and 5).
    score = _score(dataclasses.replace(TREE, world_sizes=(4,)), _answers()["star_all_reduce"])
    assert score.points == 0, score.failures
    assert "not the binomial tree: rank 0 sent 3 message(s), peers [1, 2, 3]" in score.reason


def test_tree_without_the_way_down_loses_every_case():
    score = _score(dataclasses.replace(TREE, world_sizes=(4,)), _answers()["reduce_only"])
    # A leaf (rank 1) never hears the sum: its tensor is left as it was.
    assert score.points == 0 and "rank 1: the input tensor was not changed" in score.reason


def test_doubling_solution_scores_full_marks():
    score = _score(DOUBLING, _solution()["recursive_doubling_all_reduce"])
    assert score.points == score.max == 2 * CASES_PER_SIZE + SUBGROUP_CASES, score.failures


@pytest.mark.parametrize("name, reason", [
    ("forgets_the_extras", "rank 2: the input tensor was not changed"),  # keeps its own tensor
    ("folds_onto_the_last", "not recursive doubling: rank 0 sent 1 message(s), peers [1]; "
                            "expected peers [1, 2]"),
])
def test_doubling_mistakes_lose_every_case_with_extra_ranks(name, reason):
    # 3 ranks (and 6) have extra ranks (1 and 2 of them): the cases where they matter.
    score = _score(dataclasses.replace(DOUBLING, world_sizes=(3,)), _answers()[name])
    assert score.points == 0, score.failures
    assert reason in score.reason, score.reason


def test_the_tree_is_not_recursive_doubling():
    # On 3 ranks both send the same messages (2 -> 0 and back, 0 <-> 1); on 4 and 6 they differ.
    assert _score(DOUBLING, _solution()["tree_all_reduce"]).points == CASES_PER_SIZE  # 3 ranks


def test_crossover_formula_and_grading():
    # p = 4: 6 alpha + 1.5 n beta = 2 alpha + 2 n beta  ->  n = 8 alpha / beta.
    assert crossover_formula(4, 1e-5, 1e-9) == pytest.approx(8e4, rel=QUESTION_RTOL)
    # At n* the two times are equal, in the alpha-beta model itself.
    p, a, b = 64, 5e-6, 1 / 50e9
    n = crossover_formula(p, a, b)
    assert 2 * (p - 1) * a + 2 * (p - 1) / p * n * b == pytest.approx(math.log2(p) * (a + n * b),
                                                                        rel=QUESTION_RTOL)
    answers = _answers()
    right = _score(CROSSOVER, _solution()["ring_doubling_crossover"])
    assert right.points == right.max == 7, right.failures
    wrong = _score(CROSSOVER, answers["forgets_the_ring_fraction"])
    assert wrong.points == 0 and "wrong number" in wrong.reason
    # The course's own formula is refused like any course answer.
    refused = _score(CROSSOVER, crossover_formula)
    assert refused.points == 0 and "calls the course's reference implementation" in refused.reason


def test_visible_checks_pass_the_solution_and_explain_a_star(capsys):
    from reference.course.checks.collectives import (
        check_recursive_doubling_all_reduce, check_ring_doubling_crossover, check_tree_all_reduce,
    )
    solution = _solution()
    check_tree_all_reduce(solution["tree_all_reduce"])
    check_recursive_doubling_all_reduce(solution["recursive_doubling_all_reduce"])
    check_tree_all_reduce(_answers()["star_all_reduce"])
    check_ring_doubling_crossover(solution["ring_doubling_crossover"])
    out = capsys.readouterr().out
    assert "PASS tree_all_reduce" in out and "as the binomial tree" in out
    assert "PASS recursive_doubling_all_reduce" in out
    assert "FAIL tree_all_reduce: on 4 ranks" in out and "lowest set bit" in out
    assert "PASS ring_doubling_crossover" in out


def _unrefused(spec, fn, world_size):
    """Each rank runs `fn` on the exercise's cases under its rules (the traffic recorded)
    but without the refusal: the course's own answer, which the grader refuses, judged."""
    import torch
    import torch.distributed as dist

    from reference.course.homework.guard import exercise_rules
    from reference.runtime import launch

    cases = spec.make_cases(torch.Generator().manual_seed(0), world_size)

    def rank_outputs():
        outputs = []
        with exercise_rules(spec.id, spec.forbidden) as traffic:
            for case in cases:
                traffic.clear()
                mine = case.inputs[dist.get_rank()]  # a tensor, or a subgroup case's dict
                out = spec.call(fn, mine.clone() if isinstance(mine, torch.Tensor) else mine)
                out["sends"] = [[p, n] for p, n in traffic.sends]
                out["recvs"] = [[p, n] for p, n in traffic.recvs]
                outputs.append(out)
        return outputs

    per_rank = launch(rank_outputs, world_size, quiet=True)
    return [spec.judge(c.inputs, spec.expect(c.inputs), [r[i] for r in per_rank], world_size)
            for i, c in enumerate(cases)]


@pytest.mark.parametrize("spec, world_size", [(DOUBLING, 6), (homework("00_collectives")[1], 3)],
                         ids=["recursive_doubling_all_reduce", "ring_all_gather"])
def test_the_course_answers_the_grader_refuses_answer_the_exercise(spec, world_size):
    from reference.course.homework.refuse import resolve
    reasons = _unrefused(spec, resolve(spec.banned[0]), world_size)
    assert reasons and all(r == "" for r in reasons), reasons


# ----------------------------------------------------------------- each stated rule, broken alone

def _variant(exercise: str, *edits: tuple):
    """The solution's answer to `exercise` with each (old, new) edit made: one rule broken."""
    return solution_function("00_collectives", exercise, *edits, every=True)


GROUP_RANKS_AS_GLOBAL = (("group_dst=", "dst="), ("group_src=", "src="))


@pytest.mark.parametrize("exercise, sizes, edits, words", [
    # peers named by group rank but passed as global ranks: right on the whole world only
    ("ring_all_reduce", (4,), GROUP_RANKS_AS_GLOBAL, "subgroup"),
    ("ring_all_gather", (4,), GROUP_RANKS_AS_GLOBAL, "subgroup"),
    ("tree_all_reduce", (6,), GROUP_RANKS_AS_GLOBAL, "subgroup"),
    ("recursive_doubling_all_reduce", (6,), GROUP_RANKS_AS_GLOBAL, "subgroup"),
    # in place, and returning its argument
    ("ring_all_reduce", (3,), (("chunks = tensor.view(-1)", "tensor = tensor.clone()\n    chunks = tensor.view(-1)"),),
     "the input tensor was not changed"),
    ("ring_all_reduce", (3,), (("    return tensor\n", "    return tensor.clone()\n"),),
     "returned a tensor other than its argument"),
    # no more data than the ring sends: each chunk sent with its neighbour's
    ("ring_all_reduce", (3,), (("exchange(chunks[(rank - step) % p], incoming)",
                                "exchange(chunks[(rank - step) % p], incoming)\n"
                                "        exchange(chunks[(rank - step) % p], torch.empty_like(incoming))"),),
     "the ring needs at most"),
    # all-gather: a new tensor, the input left alone, blocks in rank order
    ("ring_all_gather", (3,), (("gathered[rank].copy_(tensor)", "gathered[rank].copy_(tensor)\n    tensor.zero_()"),),
     "changed its input tensor"),
    ("ring_all_gather", (3,), (("return gathered.flatten(0, 1)", "return gathered.roll(1, 0).flatten(0, 1)"),),
     "wrong values in the block"),
    # the tree: whole tensors only; the same bits everywhere (each rank sums on its own)
    ("tree_all_reduce", (4,), (("dist.send(flat, group=group, group_dst=parent)",
                                "dist.send(flat, group=group, group_dst=parent)\n"
                                "        dist.send(flat[:1], group=group, group_dst=parent)"),
                               ("flat.add_(incoming)", "flat.add_(incoming)\n"
                                "        dist.recv(incoming[:1], group=group, group_src=child)")),
     "every message of the binomial tree is the whole tensor"),
    # doubling: an extra rank gets back the sum of the others and adds its own tensor again:
    # (s - x) + x, the right sum to rounding, but not the bits the core ranks hold
    ("recursive_doubling_all_reduce", (6,), (
        ("        dist.recv(flat, group=group, group_src=rank - core)",
         "        others = torch.empty_like(flat)\n"
         "        dist.recv(others, group=group, group_src=rank - core)\n"
         "        flat.add_(others)"),
        ("        flat.add_(incoming)\n    distance = 1",
         "        flat.add_(incoming)\n        extra = incoming.clone()\n    distance = 1"),
        ("dist.send(flat, group=group, group_dst=rank + core)",
         "dist.send(flat - extra, group=group, group_dst=rank + core)")),
     "different bits"),
])
def test_each_stated_rule_broken_alone_costs_half_the_exercise(exercise, sizes, edits, words):
    """An otherwise right answer that breaks one rule the text states, on world sizes that show
    it, keeps at most half of the exercise as the grader weighs it (WRONG_KEEPS)."""
    spec = dataclasses.replace(next(s for s in homework("00_collectives") if s.id == exercise),
                               world_sizes=sizes)
    if words == "subgroup":  # one case on the subgroup: one launch (a rank that raises in a
        # launch of several cases makes the grader run each again alone)
        spec = dataclasses.replace(spec, make_cases=lambda g, w, make=spec.make_cases: [
            c for c in make(g, w) if "subgroup" in c.name][:1])
    score = _score(spec, _variant(exercise, *edits))
    assert score.points < score.max and score.weighted() <= score.weight / 2, score.failures
    assert any(words in f for f in score.failures), score.failures
