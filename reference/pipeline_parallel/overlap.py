"""DualPipe's overlap: the forward of one micro-batch and the backward of another, at once.

DeepSeek-AI's "DeepSeek-V3 Technical Report" (2024, section 3.2.1) builds DualPipe around one
idea: in the steady state a rank pairs the forward F of one micro-batch with the backward B of
another (the ``F&B`` cells of DualPipe's figures) and runs the two *interleaved*, each cut into
chunks at the expert all-to-all (attention; dispatch; MLP; combine), so that one micro-batch's
all-to-all is in flight while the other computes. DualPipe's code leaves the interleaving to the
model (a class method ``overlapped_forward_backward`` the executor calls for each pair); without
it, as in `build_schedule("dualpipev")` alone, the pair runs one after the other.

Here the pair runs as two threads that take turns on the rank's compute (`Turns`): the forward
on the executor's thread, the backward on a second one. Each runs the model's own code (the
stage's forward, autograd's backward) until it reaches an expert all-to-all; there it issues
the exchange asynchronously (gloo runs it on its own threads; `reference.comms.all_to_all_waited_by`),
hands the turn to the other, waits for its exchange, and waits for the turn to come back. The
chunks are therefore exactly the pieces between all-to-alls: in the forward, attention and
router | dispatch | the experts | combine | the next block ...; in the backward, the combine's
backward | the experts' backward | the dispatch's backward | the router's and attention's
backward ... . The turn passes at every exchange in the same order on every rank (the code, not
the clock, decides it), so the ranks of an ep group issue their all-to-alls in the same order,
as a collective needs. The expert counts' all-to-all (integers, needed at once to size the
dispatch) is waited for where it stands, without passing the turn.

`overlap_pairs` marks the pairs in a DualPipeV schedule, as DualPipe's ``_forward_backward_chunk``
does: every F followed by a whole B of the other chunk (not the last rank's first one, which
DualPipe also runs apart; in a two-direction DualPipe schedule, `OverlappedDualPipe`, not the two
middle ranks' first one), the receives of both before the pair and the sends of both after it;
the checker proves the moved messages free of deadlock. The executor runs a pair as one step, by
the schedule's own table (``OverlappedSchedule.handlers["F&B"]``: `forward_backward`);
`run_pipeline` records each chunk and each all-to-all in flight in its trace (`plot_overlap`
draws them). Where the course differs: on a GPU DeepSeek gives the all-to-all
its own SMs and the two micro-batches' kernels share the device; here the compute takes turns
on one CPU thread at a time and only the exchange runs beside it. Recomputation inside a pair is
not built (refused).
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from reference.comms import all_to_all_waited_by, all_to_all_waiter
from reference.pipeline_parallel.actions import Action
from reference.pipeline_parallel.dualpipe import DualPipeSchedule
from reference.pipeline_parallel.forward_backward import RankState, backward, forward
from reference.pipeline_parallel.schedules import Schedule
from reference.pipeline_parallel.zero_bubble import VSchedule

__all__ = ["OverlappedSchedule", "OverlappedDualPipe", "OVERLAPPED", "overlap_pairs", "Turns", "forward_backward",
           "charged_all_to_all", "slow"]


def forward_backward(state: RankState, f: Action, b: Action) -> None:
    """F&B: the forward ``f`` on this thread and the backward ``b`` on another, in turns, each
    passing the turn at its all-to-alls; the pieces are left in ``state.overlap_pieces`` for the recorder."""
    if state.checkpoint[f.chunk] or state.checkpoint[b.chunk]:
        raise ValueError(f"DualPipe's overlapped F&B ({f}, {b}) does not run recomputed chunks: "
                         f"pass checkpoint=False for both chunks")
    turns = Turns(all_to_all_waiter())  # a charge the caller set, kept under the turns
    other = threading.Thread(target=turns.run, args=("B", b, lambda: backward(state, b)), daemon=True)
    other.start()
    turns.run("F", f, lambda: forward(state, f))
    other.join()
    if turns.error is not None:
        raise turns.error
    state.overlap_pieces = turns.pieces


class OverlappedSchedule(VSchedule):
    """A DualPipeV schedule whose marked pairs (an F and the B after it) run as one step, overlapped."""

    handlers = {**VSchedule.handlers, "F&B": forward_backward}  # the zero-bubble table, and the pair

    def __init__(self, pp: int, m: int, actions_by_rank, virtual: int = 2, kind: str = "dualpipev",
                 pairs: Optional[dict] = None):
        super().__init__(pp, m, actions_by_rank, virtual, kind)
        self.pairs = pairs or {r: set() for r in range(pp)}  # rank -> indices of each pair's F

    def steps(self, rank: int) -> list[list[Action]]:
        """As `Schedule.steps`, but each pair [F, B] one step."""
        acts, out, k = self.actions(rank), [], 0
        while k < len(acts):
            if k in self.pairs[rank]:
                out.append(acts[k:k + 2])
                k += 2
            elif acts[k].is_comm:
                run = [acts[k]]
                while k + len(run) < len(acts) and acts[k + len(run)].is_comm:
                    run.append(acts[k + len(run)])
                out.append(run)
                k += len(run)
            else:
                out.append([acts[k]])
                k += 1
        return out


class OverlappedDualPipe(OverlappedSchedule, DualPipeSchedule):
    """A DualPipe schedule (two directions) whose marked pairs run as one step, overlapped."""


OVERLAPPED = {"dualpipev": OverlappedSchedule, "dualpipe": OverlappedDualPipe}  # kind -> its class with pairs


def overlap_pairs(schedule: Schedule) -> OverlappedSchedule:
    """``schedule`` (a "dualpipev" or "dualpipe") with its F&B pairs marked and their messages moved
    around them (receives before, sends after), validated."""
    if schedule.kind not in OVERLAPPED:
        raise ValueError(f"overlap_pairs pairs DualPipeV's (or DualPipe's) forwards and backwards; got a "
                         f"{schedule.kind!r} schedule (build_schedule('dualpipev', pp, m, virtual=2))")
    actions, pairs = {}, {}
    for r in range(schedule.pp):
        acts, out, marked, first = schedule.actions(r), [], set(), True
        # the V's last rank, DualPipe's two middle ones: its chunks run neighbouring model stages
        turn = abs(schedule.model_stage(schedule.stage(r, 0)) - schedule.model_stage(schedule.stage(r, 1))) == 1
        k = 0
        while k < len(acts):
            a = acts[k]
            nxt = next((j for j in range(k + 1, len(acts)) if not acts[j].is_comm), None)
            b = acts[nxt] if nxt is not None else None
            if a.op == "F" and b is not None and b.op == "B" and b.chunk != a.chunk:
                if turn and first:  # DualPipe runs the turn's first pair apart
                    first = False
                else:
                    mid = acts[k + 1:nxt]
                    out += [x for x in mid if x.op.startswith("RECV")]
                    marked.add(len(out))
                    out += [a, b] + [x for x in mid if x.op.startswith("SEND")]
                    k = nxt + 1
                    continue
            out.append(a)
            k += 1
        actions[r], pairs[r] = out, marked
    return OVERLAPPED[schedule.kind](schedule.pp, schedule.m, actions, schedule.virtual, schedule.kind,
                                     pairs).validate()


class Turns:
    """Two threads, "F" and "B", taking turns on one rank's compute: the one whose turn it is
    runs, the backward first; at a floating-point all-to-all it issues the exchange, passes the
    turn, waits for the exchange (``wait(work, input)``, by default ``work.wait()``) and then for
    its turn. ``pieces``: (action, start, end) of every compute piece and, as ``A2A_F`` /
    ``A2A_B`` of the same micro-batch and chunk, of every all-to-all from its issue to its end
    (perf_counter seconds)."""

    def __init__(self, wait=None):
        # the backward first: its first chunk (up to the last block's combine) is short, so its
        # exchange is soon in flight under the forward's attention (DeepSeek-V3's figure 4 order)
        self.cv, self.turn, self.done = threading.Condition(), "B", set()
        self.wait = wait or (lambda work, x: work.wait())
        self.pieces: list = []
        self.error: Optional[BaseException] = None

    def _take(self, me: str) -> float:
        other = "B" if me == "F" else "F"
        with self.cv:
            self.cv.wait_for(lambda: self.turn == me or other in self.done)
            self.turn = me
        return time.perf_counter()

    def _give(self, me: str, finished: bool = False) -> None:
        with self.cv:
            if finished:
                self.done.add(me)
            self.turn = "B" if me == "F" else "F"
            self.cv.notify_all()

    def run(self, me: str, a: Action, fn) -> None:
        """Run ``fn`` as thread ``me`` (doing action ``a``), in turns; an error is kept for the caller."""
        start = [None]

        def exchange(work, x):
            if not x.is_floating_point():  # the expert counts: needed at once, tiny
                self.wait(work, x)
                return
            issued = time.perf_counter()
            self.pieces.append((a, start[0], issued))
            self._give(me)
            self.wait(work, x)
            self.pieces.append((Action(f"A2A_{a.op}", a.mb, a.chunk), issued, time.perf_counter()))
            start[0] = self._take(me)

        try:
            start[0] = self._take(me)
            with all_to_all_waited_by(exchange):
                fn()
        except BaseException as err:  # noqa: B902 (re-raised by the executor's thread)
            self.error = self.error or err
        finally:
            self.pieces.append((a, start[0], time.perf_counter()))
            self._give(me, finished=True)


def charged_all_to_all(seconds: float):
    """A waiter for `all_to_all_waited_by` that makes every floating-point all-to-all take at least
    ``seconds`` from its issue: a link busy that long, while the rank may compute."""
    def wait(work, x):
        issued = time.perf_counter()
        work.wait()
        if x.is_floating_point():
            time.sleep(max(0.0, issued + seconds - time.perf_counter()))
    return wait


def slow(module: torch.nn.Module, forward_s: float, backward_s: float):
    """Make ``module``'s forward take ``forward_s`` seconds more and its backward ``backward_s``
    (the process sleeps, as in `DelayedStage`): an attention or an expert of a chosen cost.
    Returns the hook's handle (``.remove()`` undoes it)."""
    def hook(mod, args, out):
        time.sleep(forward_s)
        if out.requires_grad:  # runs when the output's gradient is computed, on the backward's thread
            out.register_hook(lambda grad: time.sleep(backward_s))

    return module.register_forward_hook(hook)


