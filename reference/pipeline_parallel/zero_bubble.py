"""Zero-bubble pipeline schedules: the backward split into I and W, and W put where 1F1B idles.

Qi, Wan, Huang and Lin (2024), "Zero Bubble Pipeline Parallelism" (ICLR 2024): only I, the
gradient of the stage's input, is on the critical path (the previous stage waits for it); W,
the weights' gradients, can run any time before the optimizer step. Run I at once and the idle
time of 1F1B fills with W's (`reference.pipeline_parallel.split_backward` runs them). Built as
plain data, reached by name through `build_schedule` (`reference.pipeline_parallel.registry`),
checked by the same deadlock checker, run by the same executor with a table of handlers of their
own (`ZeroBubbleSchedule.handlers`: the executor's F and B, F recording what a split backward's
W needs, and I and W):

* ``zb-h1`` (the paper's "handcrafted 1"): 1F1B's order with each B split into I then W, rank r
  putting off its first r W's. Every rank holds min(p, m) micro-batches from F to W, 1F1B's
  peak on rank 0. The bubble shrinks from (p - 1)(F + B) to (p - 1)(F + I - W): with F = I = W
  a third of 1F1B's.
* ``zb-h2`` (the paper's "handcrafted 2"): 2 (p - r) - 1 warm-up forwards on rank r, enough to
  reach its first I without waiting, then I, W, F, and 2 r W's put off to the end. With
  F = I = W and m >= 2p - 1 no rank idles between its first and its last action: the step is a
  parallelogram, rank r running from r F to 3 m F + r F. Every rank holds up to 2p - 1
  micro-batches (the paper's (2p - 1) M_B, twice 1F1B's peak). One step alone still idles
  (p - 1) F, the parallelogram's slant; the slant vanishes only when consecutive steps overlap
  (optimizer post-validation, `reference.pipeline_parallel.multistep`).
* ``zb-v`` (the paper's section 6; torch's ``ScheduleZBVZeroBubble``): two chunks per rank in a
  V, rank r holding model stages r and 2p - 1 - r, so the last rank turns a micro-batch round by
  a message to itself and the first rank holds both the first and the last stage. With
  F = I = W a rank idles only (p - 1) I / 2, half of ZB-H1's; rank r holds min(2p, m + r + 1, 2m)
  chunk micro-batches, each half a stage: at most p whole stages, 1F1B's peak.
* ``dualpipev`` (DualPipe, DeepSeek-AI's "DeepSeek-V3 Technical Report", 2024, cut in half into a
  V by Sea AI Lab, their "cut-in-half" variant, as DualPipe's README credits it; in the order
  of torch's ``ScheduleDualPipeV``), m >= 2p: after its warm-up each rank runs pairs,
  the forward of one chunk with the whole backward B of the other. DeepSeek overlaps a pair's
  halves (one's computation under the other's all-to-all of experts); here, as in torch without
  an overlap callback, they run one after the other, so it has ZB-V's bubble (at F = I = W) and
  holds one chunk micro-batch more (2p + 1). `overlap_pairs` (`reference.pipeline_parallel.overlap`)
  runs the pairs overlapped, each expert all-to-all under the other micro-batch's compute.

The bubble (`zero_bubble_formula`), with F, I and W the times of a whole stage's halves
(B = I + W; a chunk of the V takes half of each) and messages free, is idle / (m (F + B) + idle):

    zb-h1      idle = (p - 1) (F + max(I - W, 0))    for m >= p and W <= F
    zb-h2      idle = (p - 1) F                      for m >= 2p - 1 and F = I = W
    zb-v       idle = (p - 1) max(I - W, I / 2)      for m >= 2p - 1 and W, F <= I
    dualpipev  idle = (p - 1) I / 2                  for m >= 2p and F = I = W

(elsewhere only the simulated timeline, `Schedule.bubble_fraction`, gives it). With F = I = W
at p = 4, m = 8: 1F1B idles 27.3 %, interleaved (v = 2) 15.8 %, zb-h1 11.1 %, zb-v and
dualpipev 5.9 % (3.0 % at m = 16).

From its I to its W a micro-batch holds, in place of what its F stored, each linear layer's
input X and output gradient dY, which W needs (`reference.pipeline_parallel.split_backward`;
`reference.pipeline_parallel.costs.held_bytes_formula`); `peak_bytes` gives the peak of both that
the executor measures, exactly.
"""
from __future__ import annotations

from typing import Optional, Sequence

from reference.pipeline_parallel.actions import Action
from reference.pipeline_parallel.async_messages import AsyncMailbox
from reference.pipeline_parallel.executor import HANDLERS
from reference.pipeline_parallel.schedules import Schedule
from reference.pipeline_parallel.split_backward import backward_input, backward_weight, forward_recording

__all__ = ["ZeroBubbleSchedule", "VSchedule", "build_zb_h1", "build_zb_h2", "build_zb_v", "build_dualpipev",
           "zero_bubble_formula", "peak_bytes", "ZB_KINDS"]

ZB_KINDS = ("zb-h1", "zb-h2", "zb-v", "dualpipev")


class ZeroBubbleSchedule(Schedule):
    """A schedule whose sends are waited for only at the end (`AsyncMailbox`), so a rank goes on
    to its W's while its message travels. Sends that waited for their receivers would make ZB-H1
    idle as 1F1B does, and deadlock ZB-V's two chunks, which send to the same neighbour both ways."""

    strict = False
    mailbox = AsyncMailbox
    # The executor's table, extended: F records the linear layers of a micro-batch whose backward
    # the schedule splits (so that its W holds only X and dY; the plain F otherwise), I and W.
    handlers = {**HANDLERS, "F": forward_recording, "I": backward_input, "W": backward_weight}


class VSchedule(ZeroBubbleSchedule):
    """Two chunks per rank in a V: rank r holds model stages r and 2 pp - 1 - r."""

    def stage(self, rank: int, chunk: int) -> int:
        return rank if chunk == 0 else 2 * self.pp - 1 - rank

    def rank_of(self, stage: int) -> int:
        return stage if stage < self.pp else 2 * self.pp - 1 - stage


def _message(s: Schedule, rank: int, op: str, mb: int, c: int):
    """The message compute action (op, mb, c) on ``rank`` sends: (peer, the peer's RECV), or None."""
    st = s.stage(rank, c)
    to = st + 1 if op == "F" else st - 1 if op in ("I", "B") else None
    if to is None or s.ends(st)[op == "F"]:
        return None
    peer = s.rank_of(to)
    chunk = next(k for k in range(s.virtual) if s.stage(peer, k) == to)
    return peer, Action("RECV_F" if op == "F" else "RECV_B", mb, chunk, rank)


def _with_messages(s: Schedule, orders: dict) -> dict:
    """Every rank's compute ``orders`` (op, mb, chunk) with their messages: each send right after
    its action, each receive right before the action that needs it (W's fill the wait), with every
    message sent before it on the same channel, so that messages arrive in the order sent."""
    channel = {}  # (sender, receiver) -> the receiver's RECV actions, in the order sent
    for r, order in orders.items():
        for op, mb, c in order:
            sent = _message(s, r, op, mb, c)
            if sent is not None:
                channel.setdefault((r, sent[0]), []).append(sent[1])
    out = {}
    for r, order in orders.items():
        taken, actions = {q: 0 for q in range(s.pp)}, []  # messages received so far, from each rank
        for op, mb, c in order:
            want = ("RECV_F" if op == "F" else "RECV_B", mb, c)
            for q in range(s.pp):
                recvs = channel.get((q, r), [])
                k = next((i + 1 for i, a in enumerate(recvs) if a[:3] == want and op != "W"), 0)
                actions += recvs[taken[q]:k]
                taken[q] = max(taken[q], k)
            sent = _message(s, r, op, mb, c)
            actions += [Action(op, mb, c)] + ([Action("SEND_F" if op == "F" else "SEND_B", mb, c, sent[0])]
                                               if sent else [])
        out[r] = actions
    return out


def _zb_h1_order(pp: int, m: int, rank: int) -> list[tuple]:
    """ZB-H1 on one rank: 1F1B with B split into I, W, and the first ``rank`` W's put off."""
    warmup = min(pp - rank - 1, m)
    order = [("F", i, 0) for i in range(warmup)]
    waiting = []  # micro-batches whose I has run and W has not
    for i in range(m):
        if warmup + i < m:
            order.append(("F", warmup + i, 0))
        order.append(("I", i, 0))
        waiting.append(i)
        # steady state: hold at most pp micro-batches from F to W; cool-down: one W per I
        if len(waiting) > rank or warmup + i >= m:
            order.append(("W", waiting.pop(0), 0))
    return order + [("W", i, 0) for i in waiting]


def _zb_h2_order(pp: int, m: int, rank: int) -> list[tuple]:
    """ZB-H2 on one rank: forwards until the first I arrives, then I, W, F, the last ``2 rank``
    W's put off to the end (they fill the wait for the last I's: the parallelogram's right side)."""
    warmup = min(2 * (pp - rank) - 1, m)  # the first I reaches rank r at (2p - 1 - r) F
    order = [("F", i, 0) for i in range(warmup)]
    waiting = []  # micro-batches whose I has run and W has not
    for i in range(m):
        order.append(("I", i, 0))
        waiting.append(i)
        if len(waiting) > 2 * rank or warmup + i >= m:  # W before the next F: at most 2p - 1 held
            order.append(("W", waiting.pop(0), 0))
        if warmup + i < m:
            order.append(("F", warmup + i, 0))
    return order + [("W", i, 0) for i in waiting]


def _zb_v_order(pp: int, m: int, rank: int) -> list[tuple]:
    """ZB-V on one rank, as the paper's section 6 lays it out for m >= 2 pp - 1; with fewer
    micro-batches the same order with the missing micro-batches' actions left out."""
    n = max(m, 2 * pp - 1)
    count = {(op, c): 0 for op in "FIW" for c in (0, 1)}
    order = []

    def do(op, c):
        order.append((op, count[(op, c)], c))
        count[(op, c)] += 1

    for _ in range(2 * (pp - rank) - 1):   # warm-up: the first chunk fills the V's left arm
        do("F", 0)
    for _ in range(rank):
        do("F", 1), do("F", 0)
    for _ in range(pp - rank):             # the turn: chunk 1 starts backward at once
        do("F", 1), do("I", 1), do("W", 1)
    while count[("F", 1)] < n:              # steady state
        if count[("F", 0)] < n:
            do("F", 0)
        do("I", 0), do("W", 0), do("F", 1), do("I", 1), do("W", 1)
    for _ in range(rank):                   # cool-down: the input gradients first
        do("I", 0), do("I", 1)
    for _ in range(pp - rank):
        do("I", 0), do("W", 0)
    order += [("W", i, 1) for i in range(count[("W", 1)], n)]
    order += [("W", i, 0) for i in range(count[("W", 0)], n)]
    return [x for x in order if x[1] < m]


def _dualpipev_order(pp: int, m: int, rank: int) -> list[tuple]:
    """DualPipeV on one rank, in the order torch's ``ScheduleDualPipeV`` lays it out; the last
    backwards split into I and W from the middle on, their W's run last."""
    if m < 2 * pp:
        raise ValueError(f"'dualpipev' needs at least as many micro-batches as stages: m={m} < "
                         f"2 pp = {2 * pp} (its steady state pairs a forward of each chunk with a "
                         f"backward of the other)")
    count: dict = {}  # (op, chunk) -> the next micro-batch; a whole B counts as an I
    order, waiting = [], []  # waiting: (micro-batch, chunk) whose I has run and W has not

    def do(op, c):
        key = ("I" if op == "B" else op, c)
        mb = count[key] = count.get(key, -1) + 1
        order.append((op, mb, c))
        if op == "I":
            waiting.append((mb, c))

    def w():  # the oldest W waiting, if any
        if waiting:
            mb, c = waiting.pop(0)
            order.append(("W", mb, c))

    for _ in range(2 * (pp - rank - 1)):   # warm-up: chunk 0 ahead
        do("F", 0)
    for _ in range(rank + 1):
        do("F", 0), do("F", 1)
    for _ in range(pp - rank - 1):         # chunk 1 turns back: I, a W, F
        do("I", 1), w(), do("F", 1)
    for _ in range(m - 2 * pp + rank + 1):  # the main part: F of each chunk beside B of the other
        do("F", 0), do("B", 1), do("F", 1), do("B", 0)
    for _ in range(pp - rank - 1):
        do("B", 1), do("F", 1), do("B", 0)
    split = False  # the last backwards: whole, then in halves from the middle on
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        do("I" if split else "B", 1)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        do("I" if split else "B", 0)
    for _ in range(pp - rank - 1):
        w(), do("I" if split else "B", 0)
    for _ in range(rank + 1):
        w()
    return order


def build_from_orders(cls: type, kind: str, pp: int, m: int, virtual: int, want: int, order) -> Schedule:
    """The ``kind`` schedule (a ``cls``, ``want`` chunks per rank): every rank's compute
    ``order(pp, m, rank)`` with its messages; not yet validated (DualPipe's too, `dualpipe`)."""
    for name, value in (("pp", pp), ("m", m), ("virtual", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r} (kind={kind!r})")
    if virtual != want:
        raise ValueError(f"{kind!r} runs {want} chunk{'s' if want > 1 else ''} per rank: virtual must "
                         f"be {want}, got {virtual} (pp={pp}, m={m})")
    layout = cls(pp, m, {r: [] for r in range(pp)}, want, kind)  # empty: where the stages live
    return cls(pp, m, _with_messages(layout, {r: order(pp, m, r) for r in range(pp)}), want, kind)


def build_zb_h1(pp: int, m: int, virtual: int = 1) -> ZeroBubbleSchedule:
    """ZB-H1 for ``pp`` ranks and ``m`` micro-batches (one chunk per rank); not yet validated."""
    return build_from_orders(ZeroBubbleSchedule, "zb-h1", pp, m, virtual, 1, _zb_h1_order)


def build_zb_h2(pp: int, m: int, virtual: int = 1) -> ZeroBubbleSchedule:
    """ZB-H2 for ``pp`` ranks and ``m`` micro-batches (one chunk per rank); not yet validated."""
    return build_from_orders(ZeroBubbleSchedule, "zb-h2", pp, m, virtual, 1, _zb_h2_order)


def build_zb_v(pp: int, m: int, virtual: int = 2) -> VSchedule:
    """ZB-V for ``pp`` ranks and ``m`` micro-batches (two chunks per rank, in a V); not yet validated."""
    return build_from_orders(VSchedule, "zb-v", pp, m, virtual, 2, _zb_v_order)


def build_dualpipev(pp: int, m: int, virtual: int = 2) -> VSchedule:
    """DualPipeV for ``pp`` ranks and ``m >= 2 pp`` micro-batches (two chunks per rank, in a V);
    not yet validated."""
    return build_from_orders(VSchedule, "dualpipev", pp, m, virtual, 2, _dualpipev_order)


def zero_bubble_formula(kind: str, pp: int, m: int, t_f: float = 1.0, t_b: float = 2.0,
                        t_w: Optional[float] = None) -> float:
    """The bubble fraction of one step of ``kind`` ("zb-h1", "zb-h2", "zb-v", "dualpipev") in
    closed form, F = ``t_f``, B = ``t_b``, W = ``t_w`` (t_b / 2 unless given), I = B - W; see the
    module's docstring (steps that overlap: `reference.pipeline_parallel.multistep`)."""
    t_w = t_b / 2 if t_w is None else t_w
    t_i = t_b - t_w
    if kind == "zb-h1" and m >= pp and t_w <= t_f:
        idle = (pp - 1) * (t_f + max(t_i - t_w, 0.0))
    elif kind == "zb-h2" and m >= 2 * pp - 1 and t_f == t_i == t_w:
        idle = (pp - 1) * t_f
    elif kind == "zb-v" and m >= 2 * pp - 1 and max(t_w, t_f) <= t_i:
        idle = (pp - 1) * max(t_i - t_w, t_i / 2)
    elif kind == "dualpipev" and m >= 2 * pp and t_f == t_i == t_w:
        idle = (pp - 1) * t_i / 2
    else:
        raise ValueError(f"no closed form for {kind!r} with pp={pp}, m={m}, W={t_w}, I={t_i} (zb-h1 "
                         f"needs m >= pp and W <= F; zb-h2 m >= 2 pp - 1 and F = I = W; zb-v "
                         f"m >= 2 pp - 1 and W, F <= I; dualpipev m >= 2 pp and F = I = W): simulate it")
    return idle / (m * (t_f + t_b) + idle)


def peak_bytes(schedule: Schedule, rank: int, stored: Sequence[int], held: Sequence[int]) -> int:
    """The most activation bytes ``rank`` holds at once running ``schedule``, when each F of its
    chunk c stores ``stored[c]`` bytes, each I frees them and holds instead the ``held[c]`` bytes
    its W needs, and a W frees those (a whole B, what F stored): the count the executor measures
    (`PipelineResult.peak_activation_bytes`)."""
    now = peak = 0
    for a in schedule.actions(rank):
        c = a.chunk
        now += {"F": stored[c], "I": held[c] - stored[c], "W": -held[c], "B": -stored[c]}.get(a.op, 0)
        peak = max(peak, now)
    return peak

