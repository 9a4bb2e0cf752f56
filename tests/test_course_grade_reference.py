"""The grader refuses the course's own answers, by every route, and nothing else.

A submission whose `ring_all_reduce` was `from reference.comms import ring_all_reduce`
used to score full marks. Now each exercise's `banned` code (the course's answer
first, then its relatives) and the grader's own expected answers refuse to run from
the student's code (`reference.course.homework.refuse`). For every exercise of every
homework, the cheats that hand the arguments on to the course's answer score 0: the
function itself under the exercise's name, `importlib` and `getattr`, a
`types.FunctionType` rebuilt from its code object in the rank; and, for an answer
long enough to tell a copy from a rewrite (MIN_COPY_INSTRUCTIONS), a copy compiled
from `inspect.getsource` in the rank. An exercise with no `banned` fails a test of
its own. The in-process tests show the rules themselves: the grader may use refused
code around the student's call (the student may not launder a call through it), the
student's backward and threads are watched, a caught refusal or a switched-off watch
still counts, a copy pickled by value is recognised, a comprehension written like the
course's is not, and no profile function is left behind.
"""
import dataclasses
import dis
import sys
import threading
import types

import cloudpickle
import pytest
import torch

import reference.comms
from reference.course.checks.collectives import run_check
from reference.course.checks.runner import REFUSED, public_cases, run_cases
from reference.course.homework import HOMEWORK, score_exercise
from reference.course.homework.collectives import ALL_REDUCE
from reference.course.homework.guard import NotAllowedError
from reference.course.homework.parallel import MESH_GROUPS
from reference.course.homework.refuse import (
    MIN_COPY_INSTRUCTIONS, Refusal, fingerprint, refusal_for, resolve,
)

CHECK_TIMEOUT = 60  # s per launch (about 1 s needed); only a hanging answer would wait
SEED = 5
RING = dataclasses.replace(ALL_REDUCE, world_sizes=(2,),
                           banned=("reference.comms.ring.ring_all_reduce", "reference.comms"))
ALL_SPECS = [spec for specs in HOMEWORK.values() for spec in specs]

STUDENT = r'''
import importlib, inspect, sys, textwrap, types
import torch
import torch.distributed as dist
from reference.runtime import device


def target():
    obj = importlib.import_module(MODULE)
    for part in QUALNAME.split("."):
        obj = getattr(obj, part)
    return obj


def by_importlib(*args, **kwargs):
    return target()(*args, **kwargs)


def code_copy(obj):
    """`obj` rebuilt from its code object(s) under another name."""
    if isinstance(obj, type):
        return type(obj.__name__, obj.__bases__,
                    {k: code_copy(v) if isinstance(v, types.FunctionType) else v
                     for k, v in vars(obj).items() if k not in ("__dict__", "__weakref__")})
    copy = types.FunctionType(obj.__code__, dict(vars(sys.modules[obj.__module__])), "mine",
                              obj.__defaults__, obj.__closure__)
    copy.__kwdefaults__ = obj.__kwdefaults__
    return copy


def by_code_copy(*args, **kwargs):
    return code_copy(target())(*args, **kwargs)


def by_source(*args, **kwargs):
    f = target()
    namespace = dict(vars(sys.modules[f.__module__]))
    exec(textwrap.dedent(inspect.getsource(f)), namespace)
    return namespace[f.__name__](*args, **kwargs)


def ring(tensor, group=None):  # a ring of its own; reference only for the device
    p, r = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.view(-1).tensor_split(p))
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(p - 1):
            send = chunks[(r - step + (phase == "all-gather")) % p]
            recv = chunks[(r - step - 1 + (phase == "all-gather")) % p]
            incoming = torch.empty_like(recv, device=device())
            req = dist.isend(send.contiguous(), (r + 1) % p)
            dist.recv(incoming, (r - 1) % p)
            req.wait()
            recv.add_(incoming) if phase == "reduce-scatter" else recv.copy_(incoming)
    return tensor


def ring_after_a_caught_refusal(tensor, group=None):
    try:
        return reference_ring(tensor)
    except Exception:
        return ring(tensor)


def ring_with_the_watch_off(tensor, group=None):
    sys.setprofile(None)
    return reference_ring(tensor)


def mesh_from_the_grader(dp, tp, pp, ep):
    from reference.course.homework.parallel import expect_mesh_groups
    return expect_mesh_groups([{"dp": dp, "tp": tp, "pp": pp, "ep": ep}])[0]
'''


def _namespace(name: str = "") -> dict:
    """STUDENT run as a notebook would: not importable, so pickled by value."""
    namespace = {"__name__": "student", "reference_ring": reference.comms.ring_all_reduce}
    if name:
        obj = resolve(name)
        namespace.update(MODULE=obj.__module__, QUALNAME=obj.__qualname__)
    exec(STUDENT, namespace)
    return namespace


def _cheat(name: str, route: str):
    """A submission that hands its arguments on to `name` by `route`."""
    if route == "alias":
        return resolve(name)
    return _namespace(name)[{"importlib": "by_importlib", "code copy": "by_code_copy",
                             "source copy": "by_source"}[route]]


def _long_enough(name: str) -> bool:
    """Whether a copy compiled again is recognised: one under MIN_COPY_INSTRUCTIONS is
    what a student could have written alike (a one-line formula)."""
    obj = resolve(name)
    code = (obj.__init__ if isinstance(obj, type) else obj).__code__
    return len(list(dis.get_instructions(code))) >= MIN_COPY_INSTRUCTIONS


def _label(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__.split('.')[0]}"


def _score(spec, fn):
    return score_exercise(spec, cloudpickle.dumps(fn), seed=SEED, timeout=CHECK_TIMEOUT)


# ------------------------------------------------------------------ every exercise, every route

def test_every_exercise_names_the_course_answers_it_refuses():
    empty = [f"{hw} {spec.id}" for hw, specs in sorted(HOMEWORK.items()) for spec in specs
             if not spec.banned]
    assert not empty, f"no `banned` (the course's own answer first): {', '.join(empty)}"


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s.banned], ids=lambda s: s.id)
def test_banned_names_resolve_and_the_first_is_refused(spec):
    refusal = refusal_for(spec)
    first = resolve(spec.banned[0])
    assert callable(first)
    code = (first.__init__ if isinstance(first, type) else first).__code__
    assert refusal.refuses(code) == _label(first)
    for name in spec.banned[1:]:
        resolve(name)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.id)
def test_the_grader_answers_are_refused_and_its_call_is_not(spec):
    refusal = refusal_for(spec)
    assert refusal.refuses(spec.call.__code__) is None
    for part in (spec.expect, spec.judge, spec.make_cases, spec.reference):
        if getattr(part, "__module__", "").startswith("reference.course."):
            assert refusal.refuses(part.__code__), f"{part.__qualname__} is not refused"


ROUTES = ("alias", "importlib", "code copy")  # the course's code object itself, any size
COPIES = ("source copy",)  # a new code object, recognised by its fingerprint (and in
# test_every_route_is_refused_in_process, a pickled one too)


def _one_route_each():
    """Every exercise scored through one route, the routes taken in turn (a launch costs
    about two seconds; every route meets every kind of code in-process below)."""
    params, turn = [], 0
    for s in ALL_SPECS:
        if not s.banned:
            continue
        routes = ROUTES + (COPIES if _long_enough(s.banned[0]) else ())
        route = routes[turn % len(routes)]
        turn += 1
        params.append(pytest.param(s, route, id=f"{s.id}-{route}"))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("spec, route", _one_route_each())
def test_every_route_to_the_course_answer_scores_zero(spec, route):
    spec = dataclasses.replace(spec, world_sizes=spec.world_sizes[:1])
    score = _score(spec, _cheat(spec.banned[0], route))
    assert score.max > 0 and score.points == 0, score.failures
    assert REFUSED in score.reason, score.reason
    if route == "alias":
        assert _label(resolve(spec.banned[0])) in score.reason


# ------------------------------------------------------------------ the ring, in ranks

def test_the_one_line_import_scores_zero():
    score = _score(RING, reference.comms.ring_all_reduce)  # full marks before the refusal
    assert score.max == 6 and score.points == 0
    assert score.reason.startswith(f"NotAllowedError: {REFUSED} reference.comms.ring.ring_all_reduce")


def test_a_ring_using_allowed_parts_of_reference_scores_full_marks():
    score = _score(dataclasses.replace(RING, world_sizes=(2, 3)), _namespace()["ring"])
    assert score.max == 12 and score.points == score.max, score.failures


@pytest.mark.parametrize("name, reason", [
    ("ring_after_a_caught_refusal", REFUSED),
    ("ring_with_the_watch_off", "switched off"),
])
def test_catching_the_refusal_or_switching_the_watch_off_scores_zero(name, reason):
    score = _score(RING, _namespace()[name])
    assert score.points == 0 and reason in score.reason, score.reason


def test_the_grader_own_expected_answers_are_refused_without_banned():
    score = _score(dataclasses.replace(MESH_GROUPS, banned=()),
                   _namespace()["mesh_from_the_grader"])
    assert score.points == 0, score.failures
    assert f"{REFUSED} reference.course.homework.parallel.expect_mesh_groups" in score.reason


def test_the_visible_checks_fail_with_the_reason(capsys):
    assert run_check(RING, reference.comms.ring_all_reduce, world_sizes=(2,)) is False
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL ring_all_reduce: {REFUSED} reference.comms.ring.ring_all_reduce")
    assert "hint: write it yourself" in out
    reason, _ = run_cases(RING, reference.comms.ring_all_reduce, 2, public_cases(RING, 2),
                          CHECK_TIMEOUT)
    assert reason.startswith(f"{REFUSED} reference.comms.ring.ring_all_reduce")


# ------------------------------------------------------------------ the rules, in this process

BANNED = "reference.comms.ring.ring_sent_bytes"  # pure arithmetic: no ranks needed
ARGS = ("all_reduce", 10, 4, 3, 0)

WATCHED = r'''
import sys, threading, torch
from reference.comms.ring import ring_sent_bytes


def honest(*args):
    return 7


def calls_it(*args):
    return ring_sent_bytes(*args)


def catches_it(*args):
    try:
        return ring_sent_bytes(*args)
    except Exception:
        return 7


def switches_off(*args):
    sys.setprofile(None)
    return ring_sent_bytes(*args)


def in_a_thread(*args):
    def work():
        try:
            ring_sent_bytes(*args)
        except Exception:
            pass

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return 7


def uses_the_callback(callback, *args):
    return callback(*args)


def launders(*args):  # the grader's wrapper runs the refused code; called by the student
    return WRAPPER(honest, *args)


class Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ring_sent_bytes("all_reduce", 10, 4, 3, 0)
        return grad


def in_backward(x):
    return Backward.apply(x)
'''


def wrapper(fn, *args):
    """A call wrapper: it runs the refused code itself, and hands the student a callback
    that runs it too; neither counts against the student."""
    resolve(BANNED)(*ARGS)

    def callback(*inner):
        return resolve(BANNED)(*inner)

    return fn(callback, *args) if fn.__name__ == "uses_the_callback" else fn(*args)


def backward_wrapper(fn, x):
    fn(x).sum().backward()
    return x.grad


def _watched(name):
    namespace = {"__name__": "student", "WRAPPER": wrapper}
    exec(WATCHED, namespace)
    return namespace[name]


def _refusal(call=wrapper):
    return Refusal("toy", (BANNED,), course=False, allowed=(call,))


def test_every_route_is_refused_in_process():
    banned = resolve(BANNED)
    assert len(list(dis.get_instructions(banned.__code__))) >= MIN_COPY_INSTRUCTIONS  # copies too
    namespace = _namespace(BANNED)
    for fn in (banned, _watched("calls_it"), namespace["by_importlib"], namespace["by_source"],
               namespace["by_code_copy"], namespace["code_copy"](banned),
               cloudpickle.loads(cloudpickle.dumps(namespace["code_copy"](banned)))):
        with pytest.raises(NotAllowedError, match=f"{REFUSED} {BANNED}: reference's ring_sent_bytes"):
            _refusal().run(wrapper, fn, *ARGS)


def test_the_grader_may_run_refused_code_and_so_may_its_callback():
    refusal = _refusal()
    assert refusal.run(wrapper, _watched("honest"), *ARGS) == 7
    assert refusal.run(wrapper, _watched("uses_the_callback"), *ARGS) == resolve(BANNED)(*ARGS)


@pytest.mark.parametrize("name, match", [
    ("catches_it", REFUSED), ("in_a_thread", REFUSED), ("switches_off", "switched off"),
])
def test_caught_threaded_or_unwatched_calls_still_count(name, match):
    with pytest.raises(NotAllowedError, match=match):
        _refusal().run(wrapper, _watched(name), *ARGS)


def test_calling_the_grader_wrapper_itself_launders_nothing():
    with pytest.raises(NotAllowedError, match=REFUSED):  # its refused call is the student's
        _refusal().run(wrapper, _watched("launders"), *ARGS)


def test_the_student_backward_is_watched_though_the_grader_runs_it():
    refusal = _refusal(backward_wrapper)
    with pytest.raises(NotAllowedError, match=REFUSED):
        refusal.run(backward_wrapper, _watched("in_backward"), torch.ones(3, requires_grad=True))


def test_no_profile_function_is_left_behind():
    before = (sys.getprofile(), threading.getprofile())
    refusal = _refusal()
    refusal.run(wrapper, _watched("honest"), *ARGS)
    assert (sys.getprofile(), threading.getprofile()) == before
    for name in ("calls_it", "switches_off"):
        with pytest.raises(NotAllowedError):
            refusal.run(wrapper, _watched(name), *ARGS)
        assert (sys.getprofile(), threading.getprofile()) == before


def test_a_refusal_opened_by_the_wrapper_is_recorded_by_the_grader_too():
    def opens_its_own(fn, *args):  # as tensor_parallel's course_versions_refused does
        with Refusal("toy", (BANNED,), course=False, student_only=False).watching(settle=False):
            return fn(*args)

    grader = Refusal("toy", (), course=False, allowed=(opens_its_own,))
    with pytest.raises(NotAllowedError, match=REFUSED):  # the student caught it: still counts
        grader.run(opens_its_own, _watched("catches_it"), *ARGS)
    assert grader.run(opens_its_own, _watched("honest"), *ARGS) == 7


def course_like(module):  # stands for a course function that holds a comprehension
    return [p for p in module.parameters() if p.requires_grad]


def test_a_comprehension_written_like_the_course_is_the_student_own():
    namespace = {"__name__": "student"}
    exec("def trainable(model):\n    return [p for p in model.parameters() if p.requires_grad]",
         namespace)
    refusal = Refusal("toy", (course_like,), course=False)
    [mine] = [c for c in namespace["trainable"].__code__.co_consts if isinstance(c, types.CodeType)]
    [course] = [c for c in course_like.__code__.co_consts if isinstance(c, types.CodeType)]
    assert fingerprint(mine) == fingerprint(course)  # the same code, written twice
    assert refusal.refuses(course) and refusal.refuses(mine) is None


def test_everyone_is_refused_when_not_only_the_student():
    refusal = Refusal("toy", (resolve(BANNED),), course=False, student_only=False)
    with pytest.raises(NotAllowedError, match=REFUSED), refusal.watching():
        resolve(BANNED)(*ARGS)
    assert sys.getprofile() is None
