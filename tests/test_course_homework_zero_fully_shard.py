"""Homework 02's exercise 5 (`wrap_tiny_lm`): the right answer earns every point through the
grader, and the usual mistakes each fail the cases they should, for the reason they should.

The answers are functions pickled by value, as a notebook's are. The right one is graded as the
grader does it (`score_exercise`: guard, refusal, fresh ranks); the mistakes run in one launch
through the exercise's own `call` and `judge`, one launch for all of them."""
from pathlib import Path

import cloudpickle
import nbformat
import torch
import torch.distributed as dist

from reference.course.homework import homework
from reference.course.homework.scoring import score_exercise, weight
from reference.course.homework.zero_fully_shard import WRAP_TINY_LM, call, expect, judge, make_cases
from reference.runtime import launch

ROOT = Path(__file__).resolve().parent.parent
SEED, WORLD = 11, 2


def _answers() -> dict:
    """The solution's answer cell, run as a notebook runs it (a namespace no process imports),
    and the mistakes built from it."""
    nb = nbformat.read(ROOT / "solutions" / "02_zero_fsdp.ipynb", 4)
    source = next(c.source for c in nb.cells if c.metadata.get("course", {}).get("exercise") == "wrap_tiny_lm")
    ns = {"__name__": "student", "torch": torch}
    exec(source, ns)
    exec(source.replace("def wrap_tiny_lm(", "def root_only(").replace(
        "    for block in model.blocks:   # bottom-up", "    for block in []:   # bottom-up"), ns)
    exec(source.replace("def wrap_tiny_lm(", "def norms_sharded(").replace(
        "norms = {m.weight for m in model.modules() if isinstance(m, RMSNorm)}", "norms = set()"), ns)
    exec(source.replace("def wrap_tiny_lm(", "def policy_dropped(").replace(
        "mp_policy=mp_policy, ", ""), ns)
    exec(source.replace("def wrap_tiny_lm(", "def weights_not_loaded(").replace(
        "    model.load_state_dict(weights)\n", "    torch.nn.init.normal_(model.head.weight)\n"), ns)
    names = ("wrap_tiny_lm", "root_only", "norms_sharded", "policy_dropped", "weights_not_loaded")
    return {name: ns[name] for name in names}


def _run_mistakes(fns_bytes, cases):
    fns, rank = cloudpickle.loads(fns_bytes), dist.get_rank()
    return {(name, case.name): call(fn, case.inputs[rank]) for name, fn in fns.items() for case in cases}


def test_the_exercise_is_in_homework_02_at_four_points():
    specs = {s.id: s for s in homework("02_zero_fsdp")}
    assert weight(specs["wrap_tiny_lm"]) == 4 and specs["wrap_tiny_lm"].call is call


def test_the_solution_earns_every_point():
    score = score_exercise(WRAP_TINY_LM, cloudpickle.dumps(_answers()["wrap_tiny_lm"]), seed=SEED, timeout=120)
    assert (score.points, score.max) == (3, 3), score.failures


def test_each_mistake_fails_for_its_reason():
    answers = _answers()
    mistakes = {k: v for k, v in answers.items() if k != "wrap_tiny_lm"}
    cases = make_cases(torch.Generator().manual_seed(SEED), WORLD)
    out = launch(_run_mistakes, WORLD, cloudpickle.dumps(mistakes), cases, timeout=240, quiet=True)
    expected = {case.name: expect(case.inputs) for case in cases}
    why = {(name, case.name): judge(case.inputs, expected[case.name], [o[name, case.name] for o in out], WORLD)
           for name in mistakes for case in cases}
    for case in cases:
        assert "not each block and then the root" in why["root_only", case.name]
        assert "a norm's gain stays whole" in why["norms_sharded", case.name]
    # fp32 compares the first gradients; fp16 and bf16 the weights after the steps
    assert "the gradient of" in why["weights_not_loaded", cases[0].name]
    assert all("differ from one process" in why["weights_not_loaded", c.name] for c in cases[1:])
    # fp32: the policy passed in is the default one, so dropping it changes nothing
    assert [bool(why["policy_dropped", c.name]) for c in cases] == [False, True, True]
    assert "not mp_policy" in why["policy_dropped", cases[1].name]
