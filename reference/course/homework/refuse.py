"""Inside a rank: the course's own answers refuse to run from the student's code.

`from reference.comms import ring_all_reduce` would answer "write a ring all-reduce"
in one line. A `Refusal` holds the code an exercise may not run, as code objects:

* its `ExerciseSpec.banned` names: a function; a class (every method written in its
  module's file); a module (every function and method written in it); a package (all
  its modules); each with the code nested in them;
* the course's homework and checks code (expected answers, judges, checks), but not
  the machinery around the student's call (`MACHINERY`) nor what the exercise's
  `call` wrapper reaches: itself, the course's functions it names, and so on.

While `run(call, fn, ...)` runs `call(fn, ...)`, a profile function (`sys.setprofile`;
`threading.setprofile` for threads started meanwhile) sees every Python call. A call
into refused code counts when the student's code is its caller, however far up:
`fn`'s own frame, or a frame whose globals are no module's (functions unpickled from
a notebook, code made by `exec`), met before the grader's own call (the wrapper as
`run` calls it, or a callback nested in it); in a thread the student started, every
call counts. So the grader may run the course's schedules or models around the
student's call; the student's function, its backward, its hooks may not, nor launder
a call through the grader's helpers. A call that counts raises `NotAllowedError`
("calls the course's reference implementation <module.name>") and is recorded; when
`call` ends, a recorded refusal, or a profile function no longer in place, raises
again, so catching the error or switching the watch off fails.

Code is recognised by identity (an alias, `importlib`, `getattr`, a
`types.FunctionType` made from its code object) and by a fingerprint (name, local
names, instructions with their names and constants, nested code alike; no file or
line numbers), so a copy compiled again, from `inspect.getsource` or by pickling, is
caught too; only from `MIN_COPY_INSTRUCTIONS` instructions, since a student's
one-line method (`return self.net(x)`) may equal the course's by chance.
"""
from __future__ import annotations

import contextlib
import dis
import functools
import importlib
import pkgutil
import sys
import threading
import types

from reference.course.homework.guard import NotAllowedError

__all__ = ["Refusal", "refusal_for", "fingerprint", "COURSE_PACKAGES", "MACHINERY",
           "MIN_COPY_INSTRUCTIONS", "REFUSED"]

COURSE_PACKAGES = ("reference.course.homework", "reference.course.checks")
# The grader's machinery around the student's call: never refused.
MACHINERY = ("reference.course.homework", "reference.course.homework.guard",
             "reference.course.homework.refuse", "reference.course.homework.scoring",
             "reference.course.checks", "reference.course.checks.runner")
MIN_COPY_INSTRUCTIONS = 12
REFUSED = "calls the course's reference implementation"  # how every refusal begins


# ------------------------------------------------------------------ which code

def resolve(name: str):
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        with contextlib.suppress(ModuleNotFoundError):  # not a module: a shorter one's attribute
            return functools.reduce(getattr, parts[i:], importlib.import_module(".".join(parts[:i])))
    return functools.reduce(getattr, parts[1:], importlib.import_module(parts[0]))


def _functions(value) -> list:
    """The plain functions a module global or class attribute stands for (wrappers unwrapped)."""
    if isinstance(value, property):
        return [f for part in (value.fget, value.fset, value.fdel) for f in _functions(part)]
    if isinstance(value, (staticmethod, classmethod, functools.cached_property)):
        value = value.func if isinstance(value, functools.cached_property) else value.__func__
    found = []
    for _ in range(8):  # functools.wraps chains: the wrapper and what it wraps
        if isinstance(value, types.FunctionType):
            found.append(value)
        try:
            value = getattr(value, "__wrapped__", None)
        except Exception:  # noqa: BLE001 - an object with an odd __getattr__ wraps nothing
            break
        if value is None or isinstance(value, (type, types.ModuleType)):
            break
    return found


def _nested(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _add(into: dict, module: str, f) -> None:
    """f's code and its nested code, labelled module.name of what holds f (a method's class)."""
    label = f"{module}.{f.__code__.co_qualname.split('.')[0]}"
    into.update((code, label) for code in _nested(f.__code__))


def collect(obj, into: dict, seen: set | None = None) -> dict:
    """Add {code object: label} for the code `obj` stands for (function, class, module,
    package with all its modules)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return into
    seen.add(id(obj))
    if not isinstance(obj, (types.ModuleType, type)):
        functions = _functions(obj)
        if not functions:
            raise TypeError(f"cannot refuse {obj!r}: not a function, class or module")
        _add(into, functions[-1].__module__, functions[-1])  # the innermost does the work
        return into
    module = obj.__name__ if isinstance(obj, types.ModuleType) else obj.__module__
    home = getattr(sys.modules.get(module), "__file__", None)  # generated code has no file
    if hasattr(obj, "__path__"):  # a package: every module in it
        for info in pkgutil.walk_packages(obj.__path__, obj.__name__ + "."):
            collect(importlib.import_module(info.name), into, seen)
    for value in list(vars(obj).values()):
        if isinstance(value, type) and value.__module__ == module:  # written here
            collect(value, into, seen)
        for f in _functions(value):
            if f.__code__.co_filename == home:
                _add(into, module, f)
    return into


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_FINGERPRINTS: dict = {}  # id(code) -> (code, fingerprint)


def _const(value):
    if isinstance(value, types.CodeType):
        return fingerprint(value)
    if isinstance(value, tuple):
        return ("tuple",) + tuple(_const(v) for v in value)
    if isinstance(value, frozenset):
        return ("frozenset",) + tuple(sorted(repr(v) for v in value))
    return (type(value).__name__, repr(value))


def _key(code: types.CodeType) -> tuple:
    """What a copy shares with its original at a glance (a prefilter for `fingerprint`)."""
    return code.co_name, code.co_argcount, code.co_kwonlyargcount, code.co_varnames


def fingerprint(code: types.CodeType) -> tuple:
    """What a copy compiled again from the same source shares: the instructions with their
    names and constants, jumps by instruction index; no file, no line numbers. A method of
    an imported module loads alike (LOAD_ATTR) compiled in the module or alone (LOAD_METHOD)."""
    cached = _FINGERPRINTS.get(id(code))
    if cached is not None and cached[0] is code:
        return cached[1]
    instructions = list(dis.get_instructions(code))
    index = {ins.offset: n for n, ins in enumerate(instructions)}
    found = _key(code) + tuple(
        ("LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname,
         index.get(ins.argval) if ins.opcode in _JUMPS else _const(ins.argval))
        for ins in instructions)
    _FINGERPRINTS[id(code)] = (code, found)
    return found


def _reach(func, into: dict) -> None:
    """The course's code that `func` (a call wrapper) can run: itself, what it names, and so on."""
    stack = [func]
    while stack:
        f = stack.pop()
        if not isinstance(f, types.FunctionType) or f.__code__ in into:
            continue
        for code in _nested(f.__code__):
            into[code] = f.__module__
            for name in code.co_names:
                stack += _course_functions(f.__globals__.get(name))
        for cell in f.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                stack += _course_functions(cell.cell_contents)


def _course_functions(value) -> list:
    if isinstance(value, type) and (value.__module__ or "").startswith("reference.course."):
        return [f for v in vars(value).values() for f in _functions(v)]
    return [f for f in _functions(value) if (f.__module__ or "").startswith("reference.course.")]


@functools.cache
def _course_code() -> dict:
    """{code: label} of the course's homework and checks modules but the machinery."""
    found: dict = {}
    importlib.invalidate_caches()  # a module written since this process started is found too
    for package in COURSE_PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            if info.name not in MACHINERY:
                collect(importlib.import_module(info.name), found)
    return found


# ------------------------------------------------------------------ watching the calls

def _student(fn):
    """`fn` behind a frame the profile function knows: the student's call starts here."""
    @functools.wraps(fn, updated=())
    def student(*args, **kwargs):
        return fn(*args, **kwargs)
    return student


_STUDENT_CODE = _student(len).__code__


class Refusal:
    """The code one exercise may not run from the student's code, and the watch over it.

    banned: dotted names or objects (functions, classes, modules, packages). course:
    also the course's homework and checks code, but the machinery and what `allowed`
    (the call wrapper) reaches. student_only False: every call counts, whoever makes it."""

    def __init__(self, exercise: str, banned=(), *, course: bool = True, allowed=(),
                 student_only: bool = True):
        self.exercise = exercise
        self.student_only = student_only
        refused, exempt = dict(_course_code()) if course else {}, {}
        for func in allowed:
            _reach(func, exempt)
        for code in exempt:
            refused.pop(code, None)
        for item in banned:  # named explicitly: refused even where the wrapper names it
            refused.update(collect(resolve(item) if isinstance(item, str) else item, {}))
        self._refused = {id(c): (c, label) for c, label in refused.items()}
        # The grader's own calls: the wrapper as `run` calls it (not as the student could),
        # and the code nested in it (the callbacks it hands to the student).
        self._owners = {id(c): c for f in allowed for c in _nested(f.__code__) if c not in refused}
        self._wrappers = {id(f.__code__) for f in allowed}
        self._originals: dict = {}  # _key -> [(code, label)] of named functions and methods
        for c, label in refused.items():  # (comprehensions and closures are anyone's to write)
            if "<" not in c.co_qualname:
                self._originals.setdefault(_key(c), []).append((c, label))
        self._seen: dict = {}  # id(code) -> (code, label or None): each code judged once
        self._modules: set = set()
        self._module_count = -1
        self.violations: list[str] = []

    def refuses(self, code: types.CodeType) -> str | None:
        """The label of the refused code `code` is or copies; None when allowed."""
        seen = self._seen.get(id(code))
        if seen is not None and seen[0] is code:
            return seen[1]
        hit = self._refused.get(id(code))
        label = hit[1] if hit is not None and hit[0] is code else None
        originals = self._originals.get(_key(code)) if label is None else None
        if originals:
            mine = fingerprint(code)
            if len(mine) - len(_key(code)) >= MIN_COPY_INSTRUCTIONS:
                label = next((lbl for c, lbl in originals if fingerprint(c) == mine), None)
        self._seen[id(code)] = (code, label)
        return label

    def _module_globals(self, globals_: dict) -> bool:
        if len(sys.modules) != self._module_count:
            self._module_count = len(sys.modules)
            main = getattr(sys.modules.get("__main__"), "__dict__", None)
            self._modules = {id(vars(m)) for m in list(sys.modules.values())
                             if isinstance(m, types.ModuleType) and vars(m) is not main}
        return id(globals_) in self._modules

    def from_student(self, frame) -> bool:
        """Whether the student's code is the caller: a student frame before a grader's own
        (the machinery and the wrapper's helpers are passed through: the student may call them)."""
        while frame is not None:
            code = frame.f_code
            if code is _STUDENT_CODE:
                return True
            if id(code) in self._owners:
                if id(code) not in self._wrappers or getattr(frame.f_back, "f_code", 0) is _RUN_CODE:
                    return False
            elif not self._module_globals(frame.f_globals):
                return True
            frame = frame.f_back
        return False

    def _message(self, label: str) -> str:
        short = label.rpartition(".")[2]
        return f"{REFUSED} {label}: reference's {short} is not allowed in {self.exercise}, write your own"

    @contextlib.contextmanager
    def watching(self, settle: bool = True):
        """While open, refused calls raise NotAllowedError; on closing, one recorded raises
        (unless not `settle`: then a Refusal watching outside this one records it too)."""
        previous, previous_thread = sys.getprofile(), threading.getprofile()
        outer = getattr(previous, "refusal", None)
        chained = []  # a profile function this one replaced raised: it unset this one too
        self.violations = []
        owner = threading.get_ident()  # other threads were started by the student's code

        def hook(frame, event, arg):
            if previous is not None:
                try:
                    previous(frame, event, arg)
                except BaseException:
                    chained.append(True)
                    raise
            if event != "call":
                return
            label = self.refuses(frame.f_code)
            if label is None or (self.student_only and threading.get_ident() == owner
                                 and not self.from_student(frame.f_back)):
                return
            self.violations.append(self._message(label))
            if outer is not None:
                outer.violations.append(self.violations[-1])
            raise NotAllowedError(self.violations[-1])

        hook.refusal = self
        sys.setprofile(hook)
        threading.setprofile(hook)
        try:
            yield self
        finally:
            installed = sys.getprofile()
            sys.setprofile(previous)
            threading.setprofile(previous_thread)
            if self.violations and settle:
                raise NotAllowedError(self.violations[0])
            if installed is not hook and not chained and not self.violations:
                raise NotAllowedError(f"the grader's watch (sys.setprofile) was switched off "
                                      f"while {self.exercise} ran: not allowed")

    def run(self, call, fn, *args):
        """call(fn, *args) with the student's `fn` watched; its result."""
        with self.watching():
            return call(_student(fn), *args)


_RUN_CODE = Refusal.run.__code__


@functools.cache
def refusal_for(spec) -> Refusal:
    """The Refusal of an ExerciseSpec (built once per process: it reads many modules)."""
    return Refusal(spec.id, spec.banned, allowed=(spec.call,))
