"""Proving a pipeline schedule right before it runs, and its ideal timeline.

`validate(schedule)` checks, without starting a process:

1. every rank's list is complete: each F and B (or a split B's I and W) of every (micro-batch,
   chunk) exactly once, with the receives and sends its stage needs, in an order that can work,
   each message addressed to the rank of the neighbouring stage (`Schedule.rank_of`);
2. every message has a partner: the k-th send from rank a to rank b is the k-th receive on b
   from a (messages between two ranks arrive in the order sent), carrying what b expects;
3. no deadlock: all ranks are simulated together, a communication step finishing only once
   every partner has *reached* its own matching step. That is the strict rule (large messages
   under NCCL and gloo do wait for the receiver), so a schedule that passes cannot hang
   whatever the library buffers; in a schedule that is not strict (`Schedule.strict`) only a
   receive waits. If no rank can move, the error names each stuck rank and what it waits for.

The same simulation, with costs per action and messages free, is the ideal timeline that
`Schedule.plot` draws and `bubble_of` measures (a `TraceEvent` list per rank, as measured).
"""
from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple, Optional

from reference.pipeline_parallel.actions import COMM, COMPUTE, Action, ScheduleError

# `Schedule` appears only in annotations, as a string: schedules.py plugs this module in.

__all__ = ["TraceEvent", "validate", "simulate", "bubble_of"]


class TraceEvent(NamedTuple):
    """One action of one rank, from ``start`` to ``end`` (seconds, or the simulation's units)."""

    rank: int
    action: Action
    start: float
    end: float


def _where(rank, index, action) -> str:
    return f"rank {rank} action #{index} {action}"


def _check_rank(s: "Schedule", rank: int) -> None:
    """Completeness and local order of one rank's list."""
    pp, m, v = s.pp, s.m, s.virtual
    seen: dict[tuple, int] = {}
    for i, a in enumerate(s.actions(rank)):
        here = _where(rank, i, a)
        if a.op not in COMPUTE + COMM:  # (a trace's A2A_F, A2A_B are never scheduled)
            raise ScheduleError(f"{here}: unknown op {a.op!r}; expected one of {', '.join(COMPUTE + COMM)}")
        if not 0 <= a.mb < m or a.chunk not in s.chunks_of(a.mb):
            raise ScheduleError(f"{here}: micro-batch {a.mb} / chunk {a.chunk} out of range "
                                f"(m={m}, virtual={v})")
        stage = s.stage(rank, a.chunk)
        if a.op in COMM:
            down = a.op in ("SEND_F", "RECV_B")
            towards = stage + 1 if down else stage - 1
            if s.ends(stage)[down]:
                raise ScheduleError(f"{here}: stage {stage} has no stage {towards} to talk to "
                                    f"({s.n_stages} stages)")
            if a.peer != s.rank_of(towards):
                raise ScheduleError(f"{here}: stage {towards} lives on rank {s.rank_of(towards)}, "
                                    f"not on rank {a.peer}")
        elif a.peer is not None:
            raise ScheduleError(f"{here}: {a.op} is computed locally and takes no peer")
        key = (a.op, a.mb, a.chunk)
        if key in seen:
            raise ScheduleError(f"{here}: repeats action #{seen[key]}")
        seen[key] = i
    for mb in range(m):
        for c in s.chunks_of(mb):
            first, last = s.ends(s.stage(rank, c))
            stage, split = s.stage(rank, c), {("I", mb, c), ("W", mb, c)} & seen.keys()  # B in halves
            if split and ("B", mb, c) in seen:
                raise ScheduleError(f"rank {rank} runs B{mb} (chunk {c}) and also its halves I, W")
            need = ["F", *(("I", "W") if split else ("B",))] + (["RECV_F", "SEND_B"] if not first else []) \
                + (["SEND_F", "RECV_B"] if not last else [])
            for op in need:
                if (op, mb, c) not in seen:
                    raise ScheduleError(f"rank {rank} never runs {Action(op, mb, c)} "
                                        f"(stage {stage} of {s.n_stages}, pp={pp}, m={m})")
            # each pair must come in this order on the rank (the input's gradient comes from I, or B)
            for before, after in (("RECV_F", "F"), ("F", "SEND_F"), ("F", "B"), ("RECV_B", "B"), ("B", "SEND_B"),
                                  ("F", "I"), ("RECV_B", "I"), ("I", "SEND_B"), ("I", "W")):
                i, j = seen.get((before, mb, c)), seen.get((after, mb, c))
                if i is not None and j is not None and i > j:
                    acts = s.actions(rank)
                    raise ScheduleError(f"{_where(rank, j, acts[j])} comes before "
                                        f"{acts[i]} (action #{i}), which it needs")


def _match(s: "Schedule") -> dict:
    """Pair every send with its receive: (rank, action index) -> (peer, peer's action index)."""
    sends: dict[tuple, list] = {}  # (sender, receiver) -> [(rank, action index, action)], in order
    recvs: dict[tuple, list] = {}
    for r in range(s.pp):
        for i, a in [(i, a) for i, a in enumerate(s.actions(r)) if a.is_comm]:
            sending = a.op.startswith("SEND")
            (sends if sending else recvs).setdefault((r, a.peer) if sending else (a.peer, r), []).append((r, i, a))
    partner = {}
    for channel in sorted(set(sends) | set(recvs)):
        out, inn = sends.get(channel, []), recvs.get(channel, [])
        for k in range(max(len(out), len(inn))):
            if k >= len(inn):
                r, i, a = out[k]
                raise ScheduleError(f"{_where(r, i, a)} has no matching receive on rank {a.peer}")
            if k >= len(out):
                r, i, a = inn[k]
                raise ScheduleError(f"{_where(r, i, a)} has no matching send on rank {a.peer}")
            (sr, si, sa), (rr, ri, ra) = out[k], inn[k]
            step = 1 if sa.op == "SEND_F" else -1
            if (ra.op[4:] != sa.op[4:] or ra.mb != sa.mb
                    or s.stage(rr, ra.chunk) != s.stage(sr, sa.chunk) + step):
                raise ScheduleError(
                    f"{_where(rr, ri, ra)} would receive {sa} ({_where(sr, si, sa)}): messages "
                    f"from rank {sr} to rank {rr} arrive in the order they are sent, and the "
                    f"two ranks list them in different orders")
            partner[(sr, si)], partner[(rr, ri)] = (rr, ri), (sr, si)
    return partner


def _run(s: "Schedule", cost: dict, partner: dict) -> list[list[TraceEvent]]:
    """Simulate all ranks together; raise ScheduleError on a deadlock. A send waits for its
    receiver too if the schedule is strict (`Schedule.strict`), else only a receive waits,
    for its send; a message to oneself is handed over and never waits for its receive."""
    steps = [s.steps(r) for r in range(s.pp)]
    # on each rank: the step of every action (by its index), to find where a partner waits,
    # and the index of every step's first action
    step_of = [[k for k, step in enumerate(st) for _ in step] for st in steps]
    first_index = [[0, *accumulate(len(step) for step in st[:-1])] for st in steps]

    pos, clock = [0] * s.pp, [0.0] * s.pp
    reached = {(r, 0): 0.0 for r in range(s.pp)}  # (rank, step) -> time the rank got there
    events: list[list[TraceEvent]] = [[] for _ in range(s.pp)]
    moved = True
    while moved:
        moved = False
        for r in range(s.pp):
            while pos[r] < len(steps[r]):
                k = pos[r]
                step = steps[r][k]
                reached.setdefault((r, k), clock[r])
                if not step[0].is_comm:
                    for a in step:  # one action, or an overlapped pair F&B counted one after the other
                        d = cost[a.op] / s.virtual
                        events[r].append(TraceEvent(r, a, clock[r], clock[r] + d))
                        clock[r] += d
                else:
                    waits = [partner[(r, first_index[r][k] + j)] for j, a in enumerate(step)
                             if a.op.startswith("RECV") or (s.strict and a.peer != r)]
                    where = [(q, step_of[q][i]) for q, i in waits]
                    if any(pos[q] < kq for q, kq in where):
                        break  # a partner has not posted its side yet
                    end = max([clock[r]] + [reached[w] for w in where])
                    events[r] += [TraceEvent(r, a, clock[r], end) for a in step]
                    clock[r] = end
                pos[r] += 1
                moved = True
    stuck = [r for r in range(s.pp) if pos[r] < len(steps[r])]
    if stuck:
        lines = []
        for r in stuck:
            k = pos[r]
            for j, a in enumerate(steps[r][k]):
                q, qi = partner[(r, first_index[r][k] + j)]
                if pos[q] < step_of[q][qi] and (s.strict or a.op.startswith("RECV")):
                    i = first_index[r][k] + j
                    lines.append(f"{_where(r, i, a)} waits for rank {q}, which has not reached "
                                 f"its action #{qi} {s.actions(q)[qi]}")
                    break
        raise ScheduleError(f"deadlock in {s!r}: no rank can move.\n  " + "\n  ".join(lines))
    return events


def validate(s: "Schedule") -> None:
    """Raise ScheduleError unless the schedule is complete and free of deadlock."""
    simulate(s)


def simulate(s: "Schedule", t_f: float = 1.0, t_b: float = 2.0,
             t_w: Optional[float] = None) -> list[list[TraceEvent]]:
    """The ideal timeline of a valid schedule: a list per rank of `TraceEvent`.

    A chunk's F takes ``t_f / virtual``, its B ``t_b / virtual``, a split B's W ``t_w / virtual``
    (``t_b / 2`` unless given: dW = X^T dY costs what dX = dY W^T does) and its I the rest. A
    message costs nothing but waiting for its partner (not strict: a receive for its send)."""
    t_w = t_b / 2 if t_w is None else t_w
    if t_f <= 0 or not 0 < t_w < t_b:
        raise ValueError(f"need t_f > 0 and 0 < t_w < t_b, got t_f={t_f}, t_b={t_b}, t_w={t_w}")
    for r in range(s.pp):
        _check_rank(s, r)
    return _run(s, {"F": t_f, "B": t_b, "I": t_b - t_w, "W": t_w}, _match(s))


def bubble_of(timeline) -> float:
    """Idle share of a timeline (simulated or measured): 1 - busy / (ranks * makespan), busy the
    time spent computing (F, B, I, W), the makespan from the first event on any rank to the last."""
    events = [e for rank in timeline for e in rank]
    if not events:
        raise ValueError("the timeline has no events")
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events if e.action.op in COMPUTE)
    return 1.0 - busy / (len(timeline) * span) if span > 0 else 0.0
