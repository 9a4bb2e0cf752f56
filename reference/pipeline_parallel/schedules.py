"""Pipeline schedules as plain data: for every rank, the ordered list of its actions.

A pipeline of ``pp`` ranks runs ``m`` micro-batches through ``pp * virtual`` model stages; rank
``r``'s chunk ``c`` is model stage ``c * pp + r`` (Megatron-LM's interleaved layout). A schedule
says, for every rank, in which order to do its actions (six of the eight kinds of
`reference.pipeline_parallel.actions` here; the zero-bubble schedules split B into the other
two, I and W):

    F       forward of micro-batch mb on chunk c
    B       backward of micro-batch mb on chunk c
    RECV_F  receive the activation that F needs from the previous stage
    SEND_F  send F's output to the next stage
    RECV_B  receive the gradient of F's output from the next stage
    SEND_B  send the gradient of F's input to the previous stage

Nothing else is decided at run time: the executor walks the list. Consecutive communication
actions form one *step*, issued together (one ``batch_isend_irecv``), so a rank can send its
activation forward and receive a gradient back at once without either pair of ranks waiting on
the other (Megatron's ``send_forward_recv_backward``). The schedules:

* ``naive``: one micro-batch at a time, forward through every stage and back: a bubble of
  (p - 1) / p, only one rank working at any moment.
* ``gpipe`` (Huang et al., 2019): all m forwards, then all m backwards. Bubble
  (p - 1) / (m + p - 1), but every stage holds the activations of all m.
* ``1f1b`` (PipeDream-Flush, Narayanan et al., 2021): stage r runs p - r - 1 warm-up forwards,
  then alternates one forward and one backward, then drains the backwards. Same bubble as
  GPipe, but stage r holds at most p - r.
* ``interleaved`` 1F1B (Narayanan et al., 2021, section 2.2): ``virtual`` chunks per rank,
  forwards going round in groups of p micro-batches per chunk. The bubble shrinks to
  (p - 1) / (v m + p - 1) when m is a multiple of p, for v times more messages.

Every schedule is checked by `reference.pipeline_parallel.check` (imported here) before it runs.
Each kind has its builder here (`build_1f1b`, ...); `build_schedule`, which takes any kind by
name, the zero-bubble ones of `reference.pipeline_parallel.zero_bubble` too, is the table of
`reference.pipeline_parallel.registry`. A schedule runs its F and B with the executor's own
handlers (`reference.pipeline_parallel.executor.HANDLERS`); a kind that runs other actions brings
its own table (`Schedule.handlers`).
"""
from __future__ import annotations

from itertools import groupby
from typing import Optional

from reference.pipeline_parallel import check
from reference.pipeline_parallel.actions import OPS, Action, ScheduleError  # noqa: F401 (OPS re-exported)

__all__ = ["Action", "Schedule", "ScheduleError", "build_naive", "build_gpipe", "build_1f1b",
           "build_interleaved", "bubble_formula", "KINDS", "OPS"]

KINDS = ("naive", "gpipe", "1f1b", "interleaved")


def _check_args(kind, pp, m, virtual):
    for name, value in (("pp", pp), ("m", m), ("virtual", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r} "
                             f"(kind={kind!r}, pp={pp!r}, m={m!r}, virtual={virtual!r})")
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "interleaved":
        if virtual < 2 or pp < 2:
            raise ValueError(f"interleaved needs virtual >= 2 chunks per rank and pp >= 2, "
                             f"got pp={pp}, virtual={virtual} (m={m})")
        if m > pp and m % pp:  # micro-batches go in rounds of pp, or all at once when m <= pp
            raise ValueError(f"interleaved runs micro-batches in rounds of {pp}: m={m} must be a "
                             f"multiple of pp={pp} or smaller than it (virtual={virtual})")
    elif virtual != 1:
        raise ValueError(f"{kind!r} has one chunk per rank: virtual must be 1, got {virtual} "
                         f"(pp={pp}, m={m}); use kind='interleaved' for virtual stages")


def _compute_groups(kind: str, pp: int, m: int, virtual: int, rank: int) -> list[list[tuple]]:
    """This rank's F and B as (op, mb, chunk), in order, in groups run back to back
    (the messages of a group are exchanged after it, in one step)."""
    if kind == "naive":
        return [[(op, i, 0)] for i in range(m) for op in ("F", "B")]
    if kind == "gpipe":
        return [[("F", i, 0)] for i in range(m)] + [[("B", i, 0)] for i in range(m)]
    if kind == "1f1b":
        warmup = min(pp - rank - 1, m)  # forwards in flight before the first backward arrives
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            order += [("F", warmup + i, 0), ("B", i, 0)]
        order += [("B", i, 0) for i in range(m - warmup, m)]
        return [[x] for x in order]
    g, total = min(m, pp), m * virtual  # interleaved: rounds of g micro-batches per chunk

    def nth(op, k):  # the k-th forward (backward) of this rank, counted over all chunks
        within = k % (g * virtual)
        c = within // g  # forwards go up the chunks, backwards down
        return (op, (k // (g * virtual)) * g + within % g, c if op == "F" else virtual - 1 - c)

    # Warm-up: the other chunks' forwards of the first round, plus two per stage still ahead of
    # this rank (the activation going there, its gradient coming back), as in Megatron-LM.
    warmup = min((virtual - 1) * g + 2 * (pp - 1 - rank), total)
    # Steady state: a forward and a backward back to back, their four messages in one step (as
    # Megatron's send_forward_backward_recv_forward_backward): exchanged between the two, chunks
    # crossing between the same two ranks both ways could each wait in a send for the other.
    return ([[nth("F", k)] for k in range(warmup)]
            + [[nth("F", warmup + k), nth("B", k)] for k in range(total - warmup)]
            + [[nth("B", k)] for k in range(total - warmup, total)])


def _with_comms(groups, pp: int, virtual: int, rank: int) -> list[Action]:
    """Add the messages: after each group, one step with the group's sends and the
    receives the next group needs (sends of activations, then of gradients, then
    the receives, in that order on every rank)."""
    last = pp * virtual - 1
    prev_rank, next_rank = (rank - 1) % pp, (rank + 1) % pp

    def messages(verb, group):
        """The group's receives (``verb`` "RECV") or sends ("SEND"), activations first: an
        activation goes to the next stage and comes from the previous one, a gradient back."""
        out = []
        for op, mb, c in group:
            s = c * pp + rank
            down = (op == "F") == (verb == "SEND")  # with the next stage
            if (s < last) if down else (s > 0):
                out.append(Action(f"{verb}_{op}", mb, c, next_rank if down else prev_rank))
        return sorted(out, key=lambda a: a.op[-1] != "F")

    actions = []
    for group in groups:  # one group's sends and the next one's receives meet in one step
        actions += messages("RECV", group) + [Action(*x) for x in group] + messages("SEND", group)
    return actions


class Schedule:
    """Every rank's action list, plus what can be read from it without running it: from
    `build_schedule`, or hand-written, ``Schedule(pp, m, {rank: [Action, ...]}, virtual, "custom")``."""

    strict = True  # a send waits for its receive, in its step (the zero-bubble ones: at the end)
    mailbox = None  # the executor's messages (`Mailbox` unless a schedule brings its own)
    handlers = None  # what runs each compute action (the executor's `HANDLERS`, F and B, unless its own)
    sum_copies = None  # a stage held twice (DualPipe's): its method summing the copies' gradients after the step

    def __init__(self, pp: int, m: int, actions_by_rank, virtual: int = 1, kind: str = "custom"):
        self.kind, self.pp, self.m, self.virtual = kind, pp, m, virtual
        missing = [r for r in range(pp) if r not in actions_by_rank]
        if missing:
            raise ScheduleError(f"{kind} schedule (pp={pp}, m={m}) has no action list for ranks {missing}")
        self._actions = {r: [a if isinstance(a, Action) else Action(*a) for a in actions_by_rank[r]]
                         for r in range(pp)}
        self._validated = False

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def stage(self, rank: int, chunk: int) -> int:
        """Model stage held by ``rank`` as its chunk ``chunk``."""
        return chunk * self.pp + rank

    def rank_of(self, stage: int) -> int:
        """The rank that holds model ``stage`` (the inverse of `stage`)."""
        return stage % self.pp

    # A schedule whose stages form more than one pipeline (DualPipe's two directions,
    # `reference.pipeline_parallel.dualpipe`) says where each ends and which chunks run a micro-batch.
    def ends(self, stage: int) -> tuple[bool, bool]:
        """Whether ``stage`` is the first, and the last, of its pipeline (it has no stage before, after)."""
        return stage == 0, stage == self.n_stages - 1

    def model_stage(self, stage: int) -> int:
        """The model's piece (`split_stages`'s index) that ``stage`` runs."""
        return stage

    def chunks_of(self, mb: int) -> range:
        """The chunks of every rank that micro-batch ``mb`` goes through."""
        return range(self.virtual)

    def copy_peer(self, rank: int) -> Optional[int]:
        """The pipeline rank holding a second copy of ``rank``'s model stages (DualPipe's), or None."""
        return None

    def actions(self, rank: int) -> list[Action]:
        """Rank ``rank``'s actions in order (a copy)."""
        if rank not in self._actions:
            raise ValueError(f"rank {rank} is not in a pipeline of pp={self.pp} ranks")
        return list(self._actions[rank])

    def steps(self, rank: int) -> list[list[Action]]:
        """The actions grouped as the executor issues them: each F or B alone,
        each run of consecutive communication actions together."""
        runs = groupby(self.actions(rank), key=lambda a: a.is_comm)
        return [step for comm, run in runs for step in ([list(run)] if comm else [[a] for a in run])]

    def peak_in_flight(self, rank: int) -> int:
        """Most micro-batches (per chunk) whose activations rank holds at once:
        one more after each F, one fewer after its B (or, split, its W)."""
        held = peak = 0
        for a in self.actions(rank):
            held += (a.op == "F") - (a.op in ("B", "W"))
            peak = max(peak, held)
        return peak

    def validate(self) -> "Schedule":
        """Prove every rank's list complete and the schedule free of deadlock (or raise `ScheduleError`)."""
        if not self._validated:
            check.validate(self)
            self._validated = True
        return self

    def simulate(self, t_f: float = 1.0, t_b: float = 2.0, t_w: Optional[float] = None):
        """The ideal timeline, a list per rank of `TraceEvent` (`reference.pipeline_parallel.check.simulate`)."""
        return check.simulate(self, t_f, t_b, t_w)

    def bubble_fraction(self, t_f: float = 1.0, t_b: float = 2.0, t_w: Optional[float] = None) -> float:
        """Idle share of the ideal timeline: 1 - busy / (pp * makespan)."""
        return check.bubble_of(self.simulate(t_f, t_b, t_w))

    def plot(self, t_f: float = 1.0, t_b: float = 2.0, ax=None, title: Optional[str] = None):
        """The ideal timeline as a figure: ranks as rows, F and B as labelled boxes."""
        from reference.pipeline_parallel.viz import plot_schedule  # matplotlib stays out of the ranks

        return plot_schedule(self, t_f, t_b, ax, title)

    def __repr__(self) -> str:
        return f"Schedule({self.kind}, pp={self.pp}, m={self.m}, virtual={self.virtual})"


def _build(kind: str, pp: int, m: int, virtual: int) -> Schedule:
    """The ``kind`` schedule: every rank's F and B (`_compute_groups`) with their messages; not yet validated."""
    _check_args(kind, pp, m, virtual)
    actions = {r: _with_comms(_compute_groups(kind, pp, m, virtual, r), pp, virtual, r)
               for r in range(pp)}
    return Schedule(pp, m, actions, virtual, kind)


def build_naive(pp: int, m: int, virtual: int = 1) -> Schedule:
    """One micro-batch at a time, for ``pp`` ranks and ``m`` micro-batches; not yet validated."""
    return _build("naive", pp, m, virtual)


def build_gpipe(pp: int, m: int, virtual: int = 1) -> Schedule:
    """GPipe: all ``m`` forwards, then all backwards, on ``pp`` ranks; not yet validated."""
    return _build("gpipe", pp, m, virtual)


def build_1f1b(pp: int, m: int, virtual: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush) for ``pp`` ranks and ``m`` micro-batches; not yet validated."""
    return _build("1f1b", pp, m, virtual)


def build_interleaved(pp: int, m: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B, ``virtual`` chunks per rank, for ``pp`` ranks and ``m`` micro-batches;
    not yet validated."""
    return _build("interleaved", pp, m, virtual)


def bubble_formula(kind: str, pp: int, m: int, virtual: int = 1) -> float:
    """The textbook bubble fraction (F and B equal on every stage, messages free): the module's
    formulas; interleaved with m < p idles 1 - v m / (v p + m - 1), a micro-batch coming back to
    rank 0 for its next chunk before rank 0 has anything else to do."""
    _check_args(kind, pp, m, virtual)
    if kind == "naive":
        return (pp - 1) / pp
    # v * m chunk-passes of busy time per rank, out of v * max(m, p) + min(m, p) - 1
    # chunk-pass times in all (for v = 1: m + p - 1).
    return 1.0 - virtual * m / (virtual * max(m, pp) + min(m, pp) - 1)
