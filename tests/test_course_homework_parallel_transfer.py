"""Homework 06's transfer exercises and written question: right answers earn every point,
the usual mistakes lose the cases they should, and an answer wrong in principle keeps at most
half of its exercise."""
import dataclasses
import math

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from reference.course.homework import homework
from reference.course.homework.parallel_transfer import (
    RESHARD_PLAN, STEP_BYTES_3D, course_reshard_plan, step_bytes_3d_formula,
)
from reference.course.homework.scoring import score_exercise


def _score(spec, fn, seed=11):
    return score_exercise(spec, cloudpickle.dumps(fn), seed=seed, timeout=60)


def _norm(mistake=""):
    """The norm over ZeRO-1's shards as a student writes it, or with one plausible mistake."""
    def global_grad_norm(shard, sizes, tp_split, groups):
        d = dist.get_rank(groups["dp"])
        here = dist.get_rank(groups["tp"]) == 0
        begin = 0 if mistake == "shard at the buffer's start" else d * len(shard)
        acc, pos, first_flag = torch.zeros((), dtype=torch.float64), 0, None
        for size, split in zip(sizes, tp_split):
            a, b = max(pos, begin), min(pos + size, begin + len(shard))
            if a < b:
                first_flag = split if first_flag is None else first_flag
                flag = first_flag if mistake == "the shard counted as its first tensor" else split
                if flag or here or mistake == "replicated counted on every tp rank":
                    acc += shard[a - begin:b - begin].double().square().sum()
            pos += size
        if mistake == "dp rank 0 alone" and d != 0:   # step 5's rule, for averaged gradients
            acc.zero_()
        if mistake == "one all-reduce over the world":    # the lecture's world was one model
            dist.all_reduce(acc)
            return acc.sqrt()
        for g in ("dp", "tp", "pp"):
            dist.all_reduce(acc, group=groups[g])
        return acc.sqrt()
    return global_grad_norm


def test_homework_06_has_its_warm_ups_transfers_the_composed_exercises_and_a_question():
    ids = [s.id for s in homework("06_3d_parallel")]
    assert ids == ["mesh_groups", "parameters_per_rank", "global_grad_norm", "reshard_plan",
                   "finish_step", "recompute", "fsdp_tp_pieces", "step_bytes_3d"]


def _spec(exercise):
    """The exercise as the grader scores it (with the homework's WRONG_KEEPS)."""
    return next(s for s in homework("06_3d_parallel") if s.id == exercise)


# each mistake, and the world size whose cases show it
NORM_MISTAKES = {"dp rank 0 alone": 4, "replicated counted on every tp rank": 4,
                 "the shard counted as its first tensor": 4, "shard at the buffer's start": 4,
                 "one all-reduce over the world": 8}


def test_global_grad_norm_right_answer_full_marks_and_each_mistake_keeps_at_most_half():
    """Six cases on 4 and 8 ranks. Each mistake fails some of them (dp rank 0 alone: every
    case, all have dp > 1; the shard's arithmetic and the replicated tensors: those with
    tp > 1; one all-reduce over the world: two models side by side in one world) and keeps at
    most half."""
    spec = _spec("global_grad_norm")
    right = score_exercise(spec, cloudpickle.dumps(_norm()), seed=11, timeout=60)
    assert right.points == right.max == 6 and right.weighted() == 4, right.failures
    # Each mistake is scored on the world size whose cases show it; the grader draws the same
    # cases there (its seed, the exercise and the world size), so failing one keeps at most
    # half of the whole exercise.
    for mistake, world_size in NORM_MISTAKES.items():
        one = dataclasses.replace(spec, world_sizes=(world_size,))
        wrong = score_exercise(one, cloudpickle.dumps(_norm(mistake)), seed=11, timeout=60)
        assert wrong.points < wrong.max and wrong.weighted() <= 2, (mistake, wrong.as_dict())
        assert "ratio" in wrong.failures[0], (mistake, wrong.failures)


def test_global_grad_norm_cases_cut_tensors_and_the_truth_is_the_whole_buffer():
    """Every case's shards start or end inside a tensor and hold a split and a replicated piece
    somewhere; the expected norm is the one computed from the whole buffers, whatever the shard."""
    from reference.course.homework.parallel import expect_global_grad_norm, make_zero_norm_cases

    for ws in (4, 8):
        for case in make_zero_norm_cases(torch.Generator().manual_seed(5), ws):
            c = case.inputs[0]
            cuts = torch.tensor(c["sizes"]).cumsum(0).tolist()
            S = c["shard"].numel()
            assert any(k * S not in [0] + cuts for k in range(1, c["dp"])), case.name  # a cut inside
            n = c["dp"] * c["tp"] * c["pp"]
            assert c["dp"] > 1 and len(case.inputs) == n * c["copies"] == ws
            expected = expect_global_grad_norm(case.inputs)
            for copy in range(c["copies"]):       # each model on its own ranks, its own norm
                model, truth = case.inputs[copy * n:(copy + 1) * n], 0.0
                for r, inp in enumerate(model):   # every tensor of every stage, split ones per tp rank
                    if r % (c["tp"] * c["dp"]) < c["tp"]:   # dp rank 0 of each (stage, tp rank)
                        buf = torch.cat([model[r + d * c["tp"]]["shard"].double() for d in range(c["dp"])])
                        parts = torch.tensor_split(buf, torch.tensor(inp["sizes"]).cumsum(0).tolist())[:-1]
                        truth += sum(float(p.pow(2).sum()) for p, s in zip(parts, inp["tp_split"])
                                     if s or r % c["tp"] == 0)
                assert expected[copy * n:(copy + 1) * n] == pytest.approx([math.sqrt(truth)] * n, rel=1e-12)


def test_global_grad_norm_may_only_all_reduce_and_not_run_the_course_clip():
    def gathered(shard, sizes, tp_split, groups):
        out = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.zeros(()))
        return 0.0

    def package(shard, sizes, tp_split, groups):
        from reference.zero.shard import FlatLayout
        FlatLayout([3], 2)
        return 0.0
    spec = _spec("global_grad_norm")
    score = score_exercise(spec, cloudpickle.dumps(gathered), seed=11, timeout=60)
    assert score.points == 0 and "not allowed" in score.reason
    score = score_exercise(spec, cloudpickle.dumps(package), seed=11, timeout=60)
    assert score.points == 0 and "reference implementation" in score.reason, score.reason


def _tensor_split_plan(n_rows, old_tp, new_tp):
    """Built from tensors, independently of the course's arithmetic."""
    rows = torch.arange(n_rows)
    old = torch.tensor_split(rows, old_tp)
    plan = []
    for shard in torch.tensor_split(rows, new_tp):
        pieces = []
        for r, o in enumerate(old):
            inside = [i for i, v in enumerate(o.tolist()) if v in set(shard.tolist())]
            if inside:
                pieces.append((r, inside[0], inside[-1] + 1))
        plan.append(pieces)
    return plan


@pytest.mark.parametrize("n, a, b", [(16, 2, 4), (13, 3, 2), (3, 2, 4), (10, 1, 3), (7, 4, 1)])
def test_the_course_plan_rebuilds_every_shard(n, a, b):
    assert course_reshard_plan(n, a, b) == _tensor_split_plan(n, a, b)
    full = torch.arange(n)
    old = torch.tensor_split(full, a)
    for shard, pieces in zip(torch.tensor_split(full, b), course_reshard_plan(n, a, b)):
        rebuilt = torch.cat([old[r][s:e] for r, s, e in pieces]) if pieces else full[:0]
        assert torch.equal(rebuilt, shard)


def test_reshard_right_answer_full_marks_and_global_row_numbers_lose():
    assert (s := _score(RESHARD_PLAN, _tensor_split_plan)).points == s.max == 8, s.failures

    def global_rows(n_rows, old_tp, new_tp):  # forgets to renumber in the old rank's shard
        plan = _tensor_split_plan(n_rows, old_tp, new_tp)
        bounds = torch.tensor_split(torch.arange(n_rows), old_tp)
        return [[(r, s + int(bounds[r][0]) if len(bounds[r]) else s,
                  e + int(bounds[r][0]) if len(bounds[r]) else e) for r, s, e in p] for p in plan]
    wrong = _score(RESHARD_PLAN, global_rows)
    # Right only where every piece comes from old rank 0 (old tp 1): 1 case of 8.
    assert wrong.points == 1, wrong.failures


def test_step_bytes_3d_is_graded_exactly():
    # The worked example of the notebook: tp 4 * 2 * 1/2 * 24 * 2 layers * 5 mbs = 960 elements,
    # pp 5 * 24 per direction, dp 2 * 6 * ceil(200 / 7) = 348; times 4 bytes.
    assert step_bytes_3d_formula(1_200, 6, 1, 4, 6, 5, 7, 2, 3, 2, 4) == (960 + 120 + 348) * 4
    assert step_bytes_3d_formula(1_200, 6, 1, 4, 6, 5, 7, 2, 3, 1, 4) == (960 + 240 + 348) * 4

    def step_bytes_3d(n_params, n_layer, b, s, h, microbatches, dp, tp, pp, pp_rank,
                      bytes_per_element, forget=""):  # the course's is refused
        act = b * s * h
        tp_sent = 0 if forget == "tp" else (n_layer // pp) * microbatches * 8 * (tp - 1) * act // tp
        stages = (pp_rank < pp - 1) + (pp_rank > 0) if forget != "ends" else 2 * (pp > 1)
        dp_sent = 2 * (dp - 1) * math.ceil(n_params // (tp * pp) / dp)
        return (tp_sent + microbatches * act * stages + dp_sent) * bytes_per_element

    right = _score(STEP_BYTES_3D, step_bytes_3d)
    assert right.points == right.max == 8, right.failures
    # Every stage sending both ways: right only where pp = 1 (no sends) or for middle stages.
    ends = _score(STEP_BYTES_3D, lambda **kw: step_bytes_3d(**kw, forget="ends"))
    assert ends.points < 8
    only_dp_and_pp = _score(STEP_BYTES_3D, lambda **kw: step_bytes_3d(**kw, forget="tp"))
    assert only_dp_and_pp.points < 8


def test_visible_checks_print_pass_and_fail(capsys):
    from reference.course.checks.parallel import (check_global_grad_norm, check_reshard_plan,
                                                  check_step_bytes_3d)
    check_global_grad_norm(_norm("replicated counted on every tp rank"))
    check_reshard_plan(_tensor_split_plan)
    check_step_bytes_3d(lambda **kw: 1.0)
    out = capsys.readouterr().out
    assert "FAIL global_grad_norm" in out and "counted more than once" in out  # the symptom
    assert "tp rank 0" not in out and "tp_group" not in out  # not the answer
    assert "PASS reshard_plan" in out
    assert "FAIL step_bytes_3d" in out and "whole number" in out


def test_the_numeric_question_check_asserts_the_text_worked_values(capsys):
    """The visible check of step_bytes_3d asserts the two values the question's text gives
    (5,712 and 6,192 bytes): an int of the right type but the wrong value fails it, as does
    an answer right on one stage only; the solution's function passes."""
    from reference.course.checks.parallel import WORKED_STEP_BYTES_3D, check_step_bytes_3d

    assert [want for _, want in WORKED_STEP_BYTES_3D] == [5712, 6192]
    assert [step_bytes_3d_formula(**ex) for ex, _ in WORKED_STEP_BYTES_3D] == [5712, 6192]
    for wrong in (lambda **kw: 5713, lambda **kw: 5712, lambda **kw: 0):
        capsys.readouterr()
        assert check_step_bytes_3d(wrong) is False
        assert "FAIL step_bytes_3d" in capsys.readouterr().out
    from solution_cells import solution_function  # the solution notebook's own answer

    check_step_bytes_3d(solution_function("06_3d_parallel", "step_bytes_3d"))
    assert "PASS step_bytes_3d" in capsys.readouterr().out


def test_the_hints_name_symptoms_not_the_answer():
    from reference.course.checks.parallel import _HINTS, _NORM_HINTS

    answers = ("tp rank 0", "tp_group", "pp_group", "rank % tp", "tp apart", "dp * tp apart",
               "12 C^2", "subtract a", "dp_rank *", "get_rank(", "all_reduce over dp")
    for key, hint in {**_HINTS, **_NORM_HINTS}.items():
        assert not any(a in hint for a in answers), (key, hint)


def test_every_section_a_hint_names_is_a_heading_of_its_notebook():
    """A hint that says "Reread notebook 06, 'X'" (or its appendix 'X') names a heading X that
    notebook 06 has; notebook 04's likewise."""
    import json
    import re
    from pathlib import Path

    import reference.course.checks.parallel as checks

    root = Path(__file__).resolve().parent.parent
    text = re.sub(r'"\s*\n\s*f?"', "", Path(checks.__file__).read_text(encoding="utf-8"))  # strings joined
    named = re.findall(r"notebook (\d\d),\s+(?:appendix )?'([^']+)'", text)
    assert len(named) >= 7 and ("06", "A.1 FSDP inside tensor parallelism") in named, named
    for number, title in named:
        (path,) = (root / "notebooks").glob(f"{number}_*.ipynb")
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        heads = {line.lstrip("#").strip() for c in cells if c["cell_type"] == "markdown"
                 for line in c["source"] if line.startswith("#")}
        starts = {"".join(c["source"]).split(":")[0] for c in cells if c["cell_type"] == "markdown"}
        assert title in heads or title in starts, (number, title)
