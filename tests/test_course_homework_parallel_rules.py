"""Homework 06: each rule the text states, broken alone, costs at least half the exercise.

Every wrong answer here is the solution notebook's function with one edit that breaks one
rule of the exercise's text and nothing else, scored by the grader's own scoring
(`score_exercise`, the homework's spec with its WRONG_KEEPS) on the one world size whose
cases show the mistake: it keeps at most half of the exercise's points. What the text allows
(any order of the groups, empty pieces, a float32 sum, a 0-d tensor, a broadcast from a
global rank) keeps all of them. The answers to one exercise that raise nothing share one
launch (`_together`); each refused or raising answer has its own.

The rules tested elsewhere, each by a wrong answer that loses a case (an answer that loses
any case keeps at most half, WRONG_KEEPS = 0.5: tests/test_course_homework_parallel_step.py,
test_homeworks_03_and_06_keep_at_most_half_for_any_failed_case):

* mesh_groups, the layout (tp innermost, pp outermost; ep innermost inside dp):
  test_course_homework_parallel.py, test_tp_outermost_loses_every_case_with_tp_above_one and
  test_ep_outermost_inside_dp_loses_the_expert_cases.
* parameters_per_rank, the tied copy on the last stage, the vocabulary padded to a multiple
  of tp, the extra blocks on the later stages, and the calculator's stage_params refused
  (an answer through it scores 0): test_course_homework_parallel.py, test_forgetting_the_tied_
  copy_..., test_unpadded_vocabulary_..., test_extra_layers_on_the_first_stages_... and
  test_a_one_call_answer_through_the_course_calculator_scores_zero.
* global_grad_norm, each number counted once (dp rank 0 alone, replicated numbers on every
  tp rank, a shard counted as its first tensor, the shard at the buffer's start), the sums
  inside the model's groups, never the world's: test_course_homework_parallel_transfer.py,
  test_global_grad_norm_right_answer_full_marks_and_each_mistake_keeps_at_most_half; only
  all_reduce, the course's clip and ZeRO's layout refused: test_global_grad_norm_may_only_
  all_reduce_and_not_run_the_course_clip.
* reshard_plan, rows in the old rank's own numbering: test_course_homework_parallel_transfer.py,
  test_reshard_right_answer_full_marks_and_global_row_numbers_lose.
* finish_step, the gradients changed in place: test_course_homework_parallel_step.py,
  test_replacing_a_gradient_tensor_is_refused; the partial gradients summed over tp, the tied
  copies summed, the loss not averaged over pp, dp left alone when the optimizer averages it,
  the norm not counting replicated numbers tp times: test_each_clinic_mistake_loses_the_cases_
  that_show_it; the loss averaged over dp, the norm not summed over dp, partial and tied
  numbers counted once, the clip's coefficient capped at 1: test_a_plausible_wrong_answer_
  loses_at_least_half.
* recompute (test_course_homework_parallel_recompute.py), the forward's random state restored
  in backward: test_the_clinic_mistake_loses_every_case_with_dropout; no activation kept:
  test_keeping_the_activations_loses_every_case; fn run once in backward: test_a_backward_
  that_runs_fn_twice_is_named; the generator where one direct call leaves it after the
  forward, and where the backward found it: test_the_caller_generator_left_elsewhere_loses_
  the_caller_case; torch.utils.checkpoint refused: test_torch_checkpoint_is_refused_from_the_
  student_code.
* fsdp_tp_pieces, the [q | k | v] blocks cut one by one, adjacent rows merged, FSDP's rows
  per rank rounded up: test_course_homework_parallel_fsdp.py, test_mistakes_lose_the_cases_
  that_show_them.
* step_bytes_3d, nothing forward from the last stage nor back from the first, tensor
  parallelism's all-reduces counted: test_course_homework_parallel_transfer.py,
  test_step_bytes_3d_is_graded_exactly.
"""
from __future__ import annotations

import dataclasses
import functools

import cloudpickle
import pytest

from reference.course.homework import homework
from reference.course.homework.refuse import REFUSED
from reference.course.homework.scoring import Case, ExerciseScore, score_exercise, weight
from solution_cells import solution_function

TIMEOUT = 60  # s per launch
SEED = 11
pytestmark = pytest.mark.timeout(300)
SPECS = {s.id: s for s in homework("06_3d_parallel")}  # as graded: WRONG_KEEPS applied
# The world size whose cases show every mistake below (the grader draws the same cases there)
WORLD = {"mesh_groups": 1, "parameters_per_rank": 1, "global_grad_norm": 4, "reshard_plan": 1,
         "finish_step": 4, "recompute": 1, "fsdp_tp_pieces": 1, "step_bytes_3d": 1}


def _variant(exercise: str, *edits):
    """The solution's function with each (old, new) edit, as a notebook defines it."""
    return solution_function("06_3d_parallel", exercise, *edits)


_DRAWN: dict = {}  # (exercise, world size) -> its cases, drawn once (finish_step's take seconds)


def _on(exercise: str, only: str | None = None):
    """The graded spec on its one world size (and only the case named `only`, when given).
    Its cases are drawn once: every score here uses SEED, so the grader's generator for the
    exercise and the world size is the same each time, and so are the cases it draws."""
    spec = SPECS[exercise]

    def make_cases(generator, world_size, make=spec.make_cases):
        if (exercise, world_size) not in _DRAWN:
            _DRAWN[exercise, world_size] = make(generator, world_size)
        return [c for c in _DRAWN[exercise, world_size] if only is None or only in c.name]

    return dataclasses.replace(spec, world_sizes=(WORLD[exercise],), make_cases=make_cases)


def _together(spec, answers: dict) -> dict:
    """{name: the ExerciseScore `score_exercise` gives that answer alone}, every answer in one
    launch: the exercise's cases (the grader's draw for SEED) once per answer, each run through
    the exercise's own call, under its rules and refusal, and judged by its own judge; an
    answer is scored on its own copy of the cases, weighed as the grader weighs it."""
    names = tuple(answers)

    def make_cases(generator, world_size, make=spec.make_cases):
        cases = make(generator, world_size)
        return [Case(f"{name} | {c.name}", [{"answer": name, "case": x} for x in c.inputs])
                for name in names for c in cases]

    def call(fn, tagged, call=spec.call):  # fn: the answers behind the grader's student frame
        return call(fn.__wrapped__[tagged["answer"]], tagged["case"])

    def expect(inputs, expect=spec.expect):
        return expect([x["case"] for x in inputs])

    def judge(inputs, expected, outputs, world_size, judge=spec.judge):
        return judge([x["case"] for x in inputs], expected, outputs, world_size)

    (world_size,) = spec.world_sizes
    many = dataclasses.replace(spec, make_cases=make_cases, call=call, expect=expect, judge=judge)
    score = score_exercise(many, cloudpickle.dumps(dict(answers)), seed=SEED, timeout=TIMEOUT)
    per_answer = score.max // len(names)
    out = {}
    for name in names:
        lost = [f for f in score.failures if f.startswith(f"{world_size} ranks, {name} | ")]
        out[name] = ExerciseScore(spec.id, points=per_answer - len(lost), max=per_answer,
                                  failures=lost, weight=weight(spec), wrong_keeps=spec.wrong_keeps)
    return out


# rule -> (exercise, edits, words in every failure); none of these answers raises
RULES = {
    # ---- mesh_groups: a dict of the five dimensions' groups
    "mesh_groups: the five dimensions' keys": (
        "mesh_groups",
        [(',\n             "ep": ("pp", "tp", "edp"), "edp": ("pp", "tp", "ep")}',
          ',\n             "ep": ("pp", "tp", "edp")}')],
        "no list of rank lists for 'edp'"),
    # ---- parameters_per_rank: ints (numbers, not bytes) in rank order, what stays whole
    "parameters_per_rank: a list of ints": (
        "parameters_per_rank",
        [("    return [per_stage[rank // (tp * dp)]", "    return [float(per_stage[rank // (tp * dp)])")],
        "not a list of ints"),
    "parameters_per_rank: numbers, not bytes": (
        "parameters_per_rank", [("        per_stage.append(n)", "        per_stage.append(4 * n)")], "holds"),
    "parameters_per_rank: in rank order": (
        "parameters_per_rank", [("per_stage[rank // (tp * dp)]", "per_stage[rank % pp]")], "holds"),
    "parameters_per_rank: the row-parallel biases whole": (
        "parameters_per_rank",
        [("    block = split // tp + 4 * C + 2 * C", "    block = (split + 2 * C) // tp + 4 * C")], "holds"),
    "parameters_per_rank: the LayerNorms whole": (
        "parameters_per_rank",
        [("    block = split // tp + 4 * C + 2 * C", "    block = (split + 4 * C) // tp + 2 * C")], "holds"),
    "parameters_per_rank: the positions whole": (
        "parameters_per_rank", [("n += vocab_shard * C + T * C ", "n += vocab_shard * C + T * C // tp ")],
        "holds"),
    "parameters_per_rank: ln_f on the last stage": (
        "parameters_per_rank", [("            n += 2 * C ", "            n += 0 ")], "holds"),
    # (the case that shows this one, a tied model on one stage, was added to the hidden checks)
    "parameters_per_rank: the tied head is the embedding itself on one stage": (
        "parameters_per_rank", [("            if not (tied and stage == 0):", "            if True:")],
        "holds"),
    "parameters_per_rank: the untied head split like the embedding": (
        "parameters_per_rank",
        [("                n += vocab_shard * C", "                n += (vocab_shard if tied else V) * C")],
        "holds"),
    "parameters_per_rank: the untied head without a bias": (
        "parameters_per_rank",
        [("                n += vocab_shard * C",
          "                n += vocab_shard * C + (0 if tied else vocab_shard)")], "holds"),
    # ---- global_grad_norm: the shard left unchanged, a number, the same on every rank
    "global_grad_norm: the shard not changed": (
        "global_grad_norm",
        [("shard[lo - begin:hi - begin].double().pow(2).sum()",
          "shard[lo - begin:hi - begin].pow_(2).double().sum()")],
        "changed its shard"),
    "global_grad_norm: a float or a 0-d tensor": (
        "global_grad_norm", [("    return math.sqrt(total.item())", "    return [math.sqrt(total.item())]")],
        "not a number"),
    "global_grad_norm: the same on every rank": (
        "global_grad_norm",
        [("    return math.sqrt(total.item())",
          "    return math.sqrt(total.item()) if dist.get_rank(groups['dp']) == 0 else 0.0")],
        "norm 0,"),
    # ---- reshard_plan: tensor_split's cut, the pieces in order, one list per new rank
    "reshard_plan: the longer shards first, as tensor_split cuts": (
        "reshard_plan",
        [("starts = [r * base + min(r, extra) for r in range(tp + 1)]",
          "starts = [r * base + max(0, r - (tp - extra)) for r in range(tp + 1)]")],
        "expected"),
    "reshard_plan: the pieces in order": (
        "reshard_plan", [("if max(lo, a) < min(hi, b)])", "if max(lo, a) < min(hi, b)][::-1])")], "expected"),
    "reshard_plan: one list per new rank, [] for one without rows": (
        "reshard_plan",
        [("    for lo, hi in bounds(new_tp):\n",
          "    for lo, hi in bounds(new_tp):\n        if lo == hi:\n            continue\n")],
        "lists for new_tp"),
    # ---- finish_step: what each label needs, the loss on every rank, no norm for ZeRO, the
    # norm before the clip
    "finish_step: a replicated gradient not summed over tp": (
        "finish_step",
        [('        if layout[name]["tp"] == "partial":', '        if layout[name]["tp"] != "split":')],
        "differs from one process's"),
    "finish_step: the mean over dp, not the sum": (
        "finish_step", [("            g /= dp\n", "")], "one process's"),
    "finish_step: the loss on every rank": (
        "finish_step", [("    dist.all_reduce(value, group=pp_group)\n", "")], "loss 0,"),
    "finish_step: no norm when the optimizer averages dp": (
        "finish_step", [("    if not dp_reduce:\n        return mean_loss, None\n", "")],
        "returned a norm although"),
    "finish_step: the norm before clipping": (
        "finish_step", [("            g.mul_(coef)\n", "            g.mul_(coef)\n        norm *= coef\n")],
        "norm "),
    # ---- fsdp_tp_pieces: in the shard's order, padding left out, [] for padding alone
    "fsdp_tp_pieces: in the order the shard holds them": (
        "fsdp_tp_pieces", [("    return pieces", "    return pieces[::-1]")], "in another order"),
    "fsdp_tp_pieces: padding left out": (
        "fsdp_tp_pieces",
        [("    return pieces", "    pad = (dp_rank + 1) * c - max(n_local, dp_rank * c)\n"
                                "    return pieces + ([(n_rows, n_rows + pad)] if pad > 0 else [])")],
        "rows where the rank holds"),
    "fsdp_tp_pieces: [] for a rank holding only padding": (
        "fsdp_tp_pieces", [("    return pieces", "    return pieces or [(0, 0)]")], "pieces of tp rank"),
    # ---- step_bytes_3d: an int, bytes_per_element throughout, dp chunks of ceil(m / dp)
    "step_bytes_3d: an int": (
        "step_bytes_3d",
        [("    return (tp_sent + pp_sent + dp_sent) * bytes_per_element",
          "    return float((tp_sent + pp_sent + dp_sent) * bytes_per_element)")],
        "whole number"),
    "step_bytes_3d: bytes_per_element for the dp all-reduce too": (
        "step_bytes_3d",
        [("    return (tp_sent + pp_sent + dp_sent) * bytes_per_element",
          "    return (tp_sent + pp_sent) * bytes_per_element + dp_sent * 4")],
        "wrong number"),
    "step_bytes_3d: the dp all-reduce's chunks of ceil(m / dp)": (
        "step_bytes_3d", [("    dp_sent = 2 * (dp - 1) * -(-m // dp)", "    dp_sent = 2 * (dp - 1) * m // dp")],
        "wrong number"),
}

# what the text allows -> (exercise, edits): a right answer in that form keeps every point
FREEDOMS = {
    "mesh_groups: the groups and their ranks in any order": (
        "mesh_groups", [("        groups[dim] = sorted(by_key.values())",
                         "        groups[dim] = [g[::-1] for g in by_key.values()][::-1]")]),
    "reshard_plan: empty pieces may stay": (
        "reshard_plan", [("if max(lo, a) < min(hi, b)])", "if max(lo, a) <= min(hi, b)])")]),
    "global_grad_norm: the squares summed in float32": (
        "global_grad_norm", [("    total = torch.zeros((), dtype=torch.float64)",
                              "    total = torch.zeros((), dtype=torch.float32)"),
                             (".double().pow(2).sum()", ".float().pow(2).sum()")]),
    "global_grad_norm: a 0-d tensor": (
        "global_grad_norm", [("    return math.sqrt(total.item())", "    return total.sqrt()")]),
    "finish_step: the loss broadcast from the last stage's global rank": (
        "finish_step", [("    dist.all_reduce(value, group=pp_group)\n",
                         "    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)\n"
                         "    dist.broadcast(value, src=last, group=pp_group)\n")]),
}

# rule -> (exercise, edits, words in every failure, the one case scored or None): answers
# that are refused or raise, each in a launch of its own (a refusal stops the whole launch)
ALONE = {
    "mesh_groups: reference.mesh not used": (
        "mesh_groups",
        [("    def coords(rank):",
          "    from reference.mesh import Mesh\n"
          "    mesh = Mesh(dp=dp, tp=tp, pp=pp, ep=ep)\n"
          "    return {d: mesh.group_ranks(d) for d in ('tp', 'dp', 'pp', 'ep', 'edp')}\n"
          "    def coords(rank):")],
        REFUSED, None),
    "parameters_per_rank: the calculator's helpers not used either": (
        "parameters_per_rank",
        [("    block = split // tp + 4 * C + 2 * C",
          "    from reference.parallel.estimate_memory import block_params\n"
          "    block = block_params(C, d_ff, tp)")],
        REFUSED, None),
    "finish_step: only all_reduce and broadcast": (
        "finish_step",
        [("    dist.all_reduce(value, group=pp_group)\n",
          "    parts = [torch.zeros_like(value) for _ in range(dist.get_world_size(pp_group))]\n"
          "    dist.all_gather(parts, value, group=pp_group)\n"
          "    value = sum(parts)\n")],
        "not allowed", None),
    # the last stage's group rank as src (a case whose pp groups are not ranks 0 and 1):
    # a rank outside the group, one case so that no case is run again alone
    "finish_step: a broadcast's src is a global rank": (
        "finish_step",
        [("    dist.all_reduce(value, group=pp_group)\n",
          "    dist.broadcast(value, src=dist.get_world_size(pp_group) - 1, group=pp_group)\n")],
        "is not part of group", "tp 2 x pp 2"),
    "recompute: RNGStates not used": (
        "recompute",
        [("            ctx.rng = torch.get_rng_state()",
          "            from reference.tensor_parallel.rng import RNGStates\n"
          "            ctx.rng = RNGStates.capture(torch.nn.Module())"),
         ("            torch.set_rng_state(ctx.rng)", "            ctx.rng.restore()")],
        REFUSED, None),
}


@functools.cache
def _scores(exercise: str) -> dict:
    """Every answer of RULES and FREEDOMS to `exercise`, scored in one launch."""
    answers = {name: _variant(ex, *edits) for name, (ex, edits, *_) in {**RULES, **FREEDOMS}.items()
               if ex == exercise}
    return _together(_on(exercise), answers)


@pytest.mark.parametrize("rule", list(RULES) + list(ALONE))
def test_each_stated_rule_broken_alone_costs_half_the_exercise(rule):
    """An otherwise right answer that breaks one rule the text states, on a world size that
    shows it, keeps at most half of the exercise as the grader weighs it (WRONG_KEEPS)."""
    if rule in RULES:
        exercise, _, words = RULES[rule]
        score = _scores(exercise)[rule]
    else:
        exercise, edits, words, only = ALONE[rule]
        score = score_exercise(_on(exercise, only), cloudpickle.dumps(_variant(exercise, *edits)),
                               seed=SEED, timeout=TIMEOUT)
    assert score.points < score.max and score.weighted() <= score.weight / 2, (rule, score.failures)
    assert all(words in f for f in score.failures), (rule, score.failures)


@pytest.mark.parametrize("freedom", list(FREEDOMS))
def test_what_the_text_allows_keeps_every_point(freedom):
    score = _scores(FREEDOMS[freedom][0])[freedom]
    assert score.points == score.max > 0 and score.weighted() == score.weight, score.failures


def test_the_answers_scored_together_score_as_alone():
    """One launch for several answers changes nothing: the solution and one wrong answer,
    scored together, lose exactly the cases `score_exercise` takes from each alone."""
    rule = "reshard_plan: the pieces in order"
    right, wrong = _variant("reshard_plan"), _variant("reshard_plan", *RULES[rule][1])
    together = _together(_on("reshard_plan"), {"right": right, "wrong": wrong})
    for name, fn in (("right", right), ("wrong", wrong)):
        alone = score_exercise(_on("reshard_plan"), cloudpickle.dumps(fn), seed=SEED, timeout=TIMEOUT)
        assert (together[name].points, together[name].max) == (alone.points, alone.max), name
        assert [f.replace(f"{name} | ", "") for f in together[name].failures] == alone.failures
    assert together["right"].points == together["right"].max and together["wrong"].points < together["wrong"].max


def test_the_text_says_what_the_grader_checks():
    """Exercise 2 asks for ints (a float count is refused: `parameters_per_rank: a list of
    ints`); exercise 3 says a float32 sum meets the grader's bound, float64 being for a real
    model's sums (`global_grad_norm: the squares summed in float32` keeps every point);
    exercise 4 lets empty pieces stay (`reshard_plan: empty pieces may stay`)."""
    import nbformat

    from solution_cells import SOLUTIONS

    cells = {c.get("id"): " ".join(c.source.split())
             for c in nbformat.read(SOLUTIONS / "06_3d_parallel.ipynb", as_version=4).cells}
    assert "as a list of ints in rank order" in cells["ex2-text"]
    assert "a float32 sum of its cases' few numbers meets it" in cells["2f741efe"]
    assert "Work in float64" not in cells["2f741efe"]
    assert "Empty pieces may be left out (the grader skips them)" in cells["f22ad886"]
    assert "Leave out empty pieces" not in cells["f22ad886"]
