"""Inside a rank: what the student's function may not do while it is graded.

Two rules hold while the student's function runs, in the hidden checks and in the
visible ones alike:

* The collectives an exercise asks to build are switched off. An exercise such as
  "build all-reduce from send and recv" is only an exercise if
  `torch.distributed.all_reduce` and its relatives are out of reach.
  `exercise_rules` (here) replaces them, in the module namespaces and on
  `ProcessGroup`, with functions that raise `NotAllowedError`, and wraps
  send/recv/isend/irecv (and so `batch_isend_irecv`, which calls isend/irecv) to
  record every message: its peer (global rank) and its element count. The checks
  then verify the ring pattern (send only to the next rank, receive only from the
  previous one) and the traffic the ring algorithm implies.
* The course's own answers refuse to run (`reference.course.homework.refuse`): the
  exercise's `banned` functions, classes and modules and the grader's expected
  answers, however they are reached (an alias, `importlib`, `getattr`, a function
  rebuilt from their code object, a copy compiled from their source). A profile
  function watches every Python call the student's code makes; a refused one raises
  `NotAllowedError` ("calls the course's reference implementation ..."), and the
  exercise scores 0, as it does for a forbidden collective. The grader's own code
  around the student's call may still use them; the rest of `reference` (the
  runtime, the model, the layers an exercise does not ask for) stays open to it.

This is a guard, not a sandbox. It stops the built-in used by mistake and the course's
answer called, imported or copied; code that sets out to defeat it can: the backend
object or the C++ ops reach a collective; a new process (`subprocess`, a fresh
`launch`) or a thread that autograd starts for a GPU runs outside the watch (the
grader runs on CPUs); code unpickled before the watch starts can patch
the grader's modules or keep its own `sys.setprofile`; a function given a module's
globals and run by the grader after the student's call returns (a returned
`functools.partial` of the course's function, a backward whose globals were swapped)
looks like the grader's own; a copy edited by hand (one name changed) is the
student's own code as far as the fingerprint can tell, and so is a copy under
`refuse.MIN_COPY_INSTRUCTIONS` instructions. And no rank ever sees the other ranks'
inputs, which a collective built by hand needs.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["NotAllowedError", "Traffic", "COLLECTIVES", "exercise_rules"]

# Every torch.distributed function that moves data among more than two ranks.
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "all_gather_coalesced", "all_gather_single", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "_broadcast_coalesced", "reduce", "gather", "gather_object", "scatter",
    "scatter_object_list",
)
# The same operations as methods of the process group object, each with the
# functions whose ban also bans it.
_GATHER = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base")
_SCATTER = ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base")
_GROUP_METHODS = {
    "allreduce": ("all_reduce",), "allreduce_coalesced": ("all_reduce", "all_reduce_coalesced"),
    "allgather": ("all_gather",), "allgather_coalesced": ("all_gather", "all_gather_coalesced"),
    "allgather_into_tensor_coalesced": _GATHER, "all_gather_single": _GATHER,
    "all_gather_single_coalesced": _GATHER, "_allgather_base": _GATHER,
    "reduce_scatter": ("reduce_scatter",), "reduce_scatter_single": _SCATTER,
    "reduce_scatter_single_coalesced": _SCATTER, "reduce_scatter_tensor_coalesced": _SCATTER,
    "_reduce_scatter_base": _SCATTER, "alltoall": ("all_to_all",),
    "alltoall_base": ("all_to_all_single",), "all_to_all_single": ("all_to_all_single",),
    "broadcast": ("broadcast",), "reduce": ("reduce",), "gather": ("gather",),
    "scatter": ("scatter",),
}
_P2P = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


class NotAllowedError(RuntimeError):
    """The exercise asks to build this collective, so calling the built-in one is refused."""


@dataclass
class Traffic:
    """Messages this rank posted: (peer global rank or None for any source, element count)."""
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)
    depth: int = 0  # > 0 inside a recorded call: send calls isend, recv calls irecv

    def clear(self) -> None:
        self.sends.clear()
        self.recvs.clear()


def _refuse(name: str, exercise: str, hint: str):
    def refused(*args, **kwargs):
        raise NotAllowedError(f"torch.distributed.{name} is not allowed in this exercise "
                              f"({exercise}): {hint}")
    refused.__name__ = name
    return refused


def _recording(name: str, original, traffic: Traffic):
    """`original` (send, recv, isend or irecv) that first notes the message in `traffic`."""
    signature = inspect.signature(original)
    peer_arg = _P2P[name]
    log = traffic.sends if peer_arg == "dst" else traffic.recvs

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        if traffic.depth == 0:  # one message, however many wrappers it passes through
            try:
                bound = signature.bind(*args, **kwargs).arguments
                peer = bound.get(peer_arg)
                group_peer = bound.get(f"group_{peer_arg}")
                if peer is None and group_peer is not None:
                    group = bound.get("group") or dist.group.WORLD
                    peer = dist.get_global_rank(group, group_peer)
                log.append((peer, int(bound["tensor"].numel())))
            except Exception:  # noqa: BLE001 - bad arguments: torch's own call reports them
                pass
        traffic.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            traffic.depth -= 1

    return recorded


@contextlib.contextmanager
def exercise_rules(exercise: str, forbidden=COLLECTIVES):
    """While open: the `forbidden` collectives raise NotAllowedError; messages are recorded.

    Yields the `Traffic` that send/recv/isend/irecv append to. Both `torch.distributed`
    and `torch.distributed.distributed_c10d` are patched, because batch_isend_irecv and
    P2POp compare against the latter's isend/irecv."""
    traffic = Traffic()
    saved = []
    missing = object()

    def replace(owner, name, value):
        if not hasattr(owner, name):
            return
        # A class attribute is saved raw from __dict__ (getattr would give a bound
        # pybind11 method, which does not work when set back) or, when inherited,
        # deleted again at the end.
        raw = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name)
        saved.append((owner, name, raw))
        setattr(owner, name, value)

    forbidden = tuple(forbidden)
    hint = ("build it from send/recv (or isend/irecv)" if set(forbidden) >= set(COLLECTIVES)
            else "use only the operations the exercise names")
    try:
        for name in forbidden:
            refused = _refuse(name, exercise, hint)
            replace(dist, name, refused)
            replace(c10d, name, refused)
        for name, functions in _GROUP_METHODS.items():
            if any(f in forbidden for f in functions):
                replace(dist.ProcessGroup, name, _refuse(f"ProcessGroup.{name}", exercise, hint))
        for name in _P2P:
            recorded = _recording(name, getattr(c10d, name), traffic)
            replace(dist, name, recorded)
            replace(c10d, name, recorded)
        yield traffic
    finally:
        for owner, name, value in reversed(saved):
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
