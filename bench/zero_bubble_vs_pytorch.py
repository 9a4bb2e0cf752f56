"""The course's zero-bubble schedules against PyTorch's own, same stages, same gloo ranks.

    python bench/zero_bubble_vs_pytorch.py [--pp 4] [--microbatches 8] [--cost 0.08] [--steps 3]
                                           [--plain-steps 10] [--only ScheduleZBVZeroBubble]

PyTorch's `torch.distributed.pipelining` ships three schedules that split the backward into
I (the input's gradient) and W (the weights'). Each runs on gloo CPU ranks beside the
course's schedule that lays out the same actions, on the same stages: the tiny GPT
(`GPT.from_config_seed(config, 0)`, tied embedding) cut by `split_stages` into pp x v stages,
placed by the course's schedule (`local_stages`), the same batch cut into the same m
micro-batches. Each side has its own copy of the weights, equal at the start.

==============================  ======  =========================================================
PyTorch's                       chunks  the course's, beside it
==============================  ======  =========================================================
ScheduleInterleavedZeroBubble   1       ``zb-h1``: PyTorch's class with one stage per rank is
                                        ZB-H1 (its source: p - 1 - r forwards of warm-up, then F
                                        and I in turn, a W after each I from the (r + 1)-th on,
                                        the W's left at the end), the same order as the course's
ScheduleInterleavedZeroBubble   2       ``interleaved`` (1F1B, v = 2): with two stages per rank it
                                        is the paper's ZB-1p on the looped placement (rank r
                                        holds stages r and r + p), which the course does not
                                        build; the nearest course schedule on the same stages is
                                        interleaved 1F1B, whose backward is whole, so its bubble
                                        is the larger one: this row shows what splitting it buys
ScheduleZBVZeroBubble           2       ``zb-v``: the same V (rank r holds stages r, 2p - 1 - r)
ScheduleDualPipeV               2       ``dualpipev``: the same V; PyTorch's pairs (F of one
                                        chunk with B of the other, ``OVERLAP_F_B``) run one after
                                        the other in its runtime, as in the course's
==============================  ======  =========================================================

Gradients. One step without injected costs on each side, its gradients (this rank's
parameters, by the model's names) against each other and against one process
(`reference.train.single.accumulate_gradients` over the same m chunks). PyTorch's schedule
runs with ``scale_grads=False`` and the loss divided by m, as the course's executor divides
it: with ``scale_grads=True`` every ``PipelineStage`` divides its own module's gradients by
m at the end (``_PipelineStageBase.scale_grads``), and under the V rank 0's two stages
share the tied embedding's one Parameter, which would be divided twice. The tied
embedding's two copies on two ranks (ZB-H1 and interleaved) are summed by
`sync_tied_grads` on both sides; under the V they are one Parameter on rank 0. The bound
is `reference.tolerance.gradient(m + 1)`: each side adds m micro-batches' gradients (and
the tied embedding's second use) in its own order (section 1 of `reference.tolerance`).

Idle share, under injected costs. An action of the tiny model computes in a millisecond or
two, and the ranks share two cores, so a timeline of the real compute would show the
competition for cores and each runtime's own code, not the schedule. Both sides therefore sleep a fixed time per action, standing for a
device busy that long (`reference.pipeline_parallel.DelayedStage` does this for a whole F and
B): with ``--cost`` tau, a chunk's F, I and W each take tau / v and a whole backward B
2 tau / v, the cost model of `Schedule.simulate(tau, 2 tau, tau)` (F = I = W). The sleep is
injected per action, where each runtime calls the stage, not inside the stage module: on the
first stage the input is token ids, both runtimes skip I there and run the whole backward in
W, so a module could not charge I and W as the simulation does on every stage.

* ours: `run_pipeline(..., action_hook=...)` calls the hook before every compute action (F,
  B, I, W); it sleeps the action's cost there. The executor's own trace
  (`PipelineResult.trace`) times each action from the start of the hook to the end of its
  compute; receives are actions of their own, so waiting for a message is not in it.
* PyTorch's: its runtime (``_PipelineScheduleRuntime._step_microbatches``) calls, for every
  compute action, one method of the ``PipelineStage``: ``forward_one_chunk`` (F),
  ``backward_one_chunk`` (B with ``full_backward=True``, I without), and
  ``backward_weight_one_chunk`` (W), after it has waited for the action's message. Each of
  the three is wrapped on the stage object: sleep the cost, call the method, record start and
  end (``time.perf_counter``, the same clock as the course's trace). The last stage's loss,
  which PyTorch computes after ``forward_one_chunk``, falls outside its F (a cross-entropy of
  one micro-batch, microseconds).

From each side's timeline (compute actions only), with the span from the first action's
start on any rank to the last one's end, rank r's idle share is 1 - busy_r / span, and their
mean is the bubble (`bubble_of`); the simulated one comes from the course's ideal timeline.
The ``margin`` column is how far a measurement may stray from the simulation, from the
lateness of the sleeps in this run (see `idle_margin`).

Time: per side, the median over the timed steps of the step's time (the slowest rank's,
from a barrier to the end of its step), ours / PyTorch's, under the injected costs (then
it is the schedules' spans, plus each runtime's own time) and with the compute alone
(``--plain-steps`` steps without costs: each runtime's own time on a tiny model, the ranks
sharing two cores), and the CPU time of those steps summed over the ranks (``time.process_time``,
which other processes loading the machine do not move as they move the wall clock). The two versions alternate step by step (ours first on even steps,
PyTorch's first on odd ones), so machine load affects both alike.

What it shows here (torch 2.13, gloo, 4 ranks on 2 cores): PyTorch's three schedules run,
and ZB-H1, ZB-V and DualPipeV in the course's order, action for action. The gradients of
the two sides are bit for bit equal, both 7.5e-9 from one process. Measured idle shares
sit a few points above the ideal timeline's (messages, a rank woken late), within the
margin, ours and PyTorch's alike for ZB-H1 and ZB-V. PyTorch's DualPipeV idles more than
ours (12 % against 7 to 10 % in four runs): its lowering to messages (``_add_send_recv``,
seen in ``pipeline_order_with_comms``) puts the sends of a pair (F of one chunk, B of the
other) after both, so the forward's activation leaves a whole B later than the course's,
which sends it right after its F; with the two halves overlapped, as DeepSeek runs them,
that costs nothing, one after the other it does.

A PyTorch schedule that raises on every rank prints its error's first line in place of its
row; the others still run.
"""
import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig, lm_loss
from reference.pipeline_parallel import TraceEvent, build_schedule
from reference.pipeline_parallel.actions import Action
from reference.pipeline_parallel.costs import idle_margin, lateness
from reference.runtime import launch
from reference.tolerance import gradient

CFG = dict(n_head=2, n_embd=16, block_size=8, vocab_size=64)  # n_layer: 2 per rank
B = 16  # sequences in the batch (m must divide it)
ROWS = [  # (PyTorch's schedule, chunks per rank, the course's schedule run beside it)
    ("ScheduleInterleavedZeroBubble", 1, "zb-h1"),
    ("ScheduleInterleavedZeroBubble", 2, "interleaved"),
    ("ScheduleZBVZeroBubble", 2, "zb-v"),
    ("ScheduleDualPipeV", 2, "dualpipev"),
]


def config(pp: int) -> GPTConfig:
    """The same model for every row: two layers per rank, in one stage or two chunks of one."""
    return GPTConfig.tiny(n_layer=2 * pp, **CFG)


def costs(tau: float, v: int) -> dict:
    """Seconds each action of a chunk takes: F = I = W = tau for a whole stage, B = I + W."""
    return {"F": tau / v, "I": tau / v, "W": tau / v, "B": 2 * tau / v}


# ------------------------------------------------------------------------ on every rank

class _OutputOnly(torch.nn.Module):
    """PyTorch's stages pass one tensor; a dense `GPTStage` returns (output, aux loss = 0)."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        return self.stage(x)[0]


def _mean_loss(logits, targets, m):
    return lm_loss(logits, targets) / m  # as the course's executor: the m losses add to the mean


class _Clock:
    """PyTorch's side: each compute action of this rank's ``PipelineStage``s sleeps its cost
    (when ``cost`` is set) and is recorded as a `TraceEvent` of the course's actions."""

    def __init__(self, rank: int):
        self.rank, self.cost, self.events, self.t0 = rank, None, [], 0.0

    def start(self, cost):
        self.cost, self.events, self.t0 = cost, [], time.perf_counter()

    def _timed(self, op, mb, chunk, method, *args, **kwargs):
        start = time.perf_counter()
        if self.cost:
            time.sleep(self.cost[op])
        out = method(*args, **kwargs)
        self.events.append(TraceEvent(self.rank, Action(op, mb, chunk), start - self.t0,
                                      time.perf_counter() - self.t0))
        return out

    def wrap(self, stage, chunk: int) -> None:
        """Replace the stage's three compute methods by timed ones (on this object only)."""
        fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(mb, *args, **kwargs):
            return self._timed("F", mb, chunk, fwd, mb, *args, **kwargs)

        def backward_one_chunk(mb, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return self._timed("B" if full else "I", mb, chunk, bwd, mb, *args, **kwargs)

        def backward_weight_one_chunk(mb, *args, **kwargs):
            return self._timed("W", mb, chunk, wgt, mb, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk


def _torch_order(torch_schedule, schedule, rank):
    """PyTorch's compute actions for this rank, as the course's (op, mb, chunk); pairs unpacked."""
    chunk_of = {schedule.stage(rank, c): c for c in range(schedule.virtual)}
    out = []
    for a in torch_schedule.pipeline_order[rank]:
        for sub in (a.sub_actions or (a,)) if a is not None else ():
            out.append((sub.computation_type.value, sub.microbatch_index, chunk_of[sub.stage_index]))
    return out


def _grads(stages):
    return {n: p.grad.clone() for s in stages for n, p in s.named_parameters() if p.grad is not None}


def _zero(stages):
    for s in stages:
        s.zero_grad(set_to_none=True)


def _compare_row(mesh, tied_group, name, v, kind, pp, m, tau, steps, plain_steps):
    """One row on this rank: both sides' gradients, compute orders, and the timelines and times
    of ``steps`` steps with the costs after ``plain_steps`` without."""
    import torch.distributed.pipelining as pipelining

    from reference.pipeline_parallel import local_stages, run_pipeline, split_stages, sync_tied_grads

    rank, group = mesh.pp_rank, mesh.pp_group
    schedule = build_schedule(kind, pp, m, v)
    ours = local_stages(split_stages(GPT.from_config_seed(config(pp), 0), pp, v), pp, rank, schedule)
    theirs = local_stages(split_stages(GPT.from_config_seed(config(pp), 0), pp, v), pp, rank, schedule)
    n = schedule.n_stages
    pstages = [pipelining.PipelineStage(_OutputOnly(st), schedule.stage(rank, c), n, torch.device("cpu"),
                                        group=group) for c, st in enumerate(theirs)]
    clock = _Clock(rank)
    for c, ps in enumerate(pstages):
        clock.wrap(ps, c)
    torch_schedule = getattr(pipelining, name)(pstages, m, loss_fn=partial(_mean_loss, m=m), scale_grads=False)
    x, y = synthetic_batch(B, CFG["block_size"], CFG["vocab_size"], seed=1)
    has_first, has_last = schedule.rank_of(0) == rank, schedule.rank_of(n - 1) == rank
    cost = costs(tau, v)

    def run_ours(with_cost):
        hook = (lambda when, a: time.sleep(cost[a.op]) if when == "before" else None) if with_cost else None
        _zero(ours)
        dist.barrier(group=group)
        start = time.perf_counter()
        result = run_pipeline(schedule, ours, x, y, group=group, tied_group=tied_group, action_hook=hook)
        wall = time.perf_counter() - start
        return [e for e in result.trace if not e.action.is_comm], wall

    def run_theirs(with_cost):
        _zero(theirs)
        dist.barrier(group=group)
        clock.start(cost if with_cost else None)
        torch_schedule.step(*((x,) if has_first else ()), **(dict(target=y, losses=[]) if has_last else {}))
        sync_tied_grads(theirs, tied_group)  # PyTorch's schedules leave tied weights to the user
        wall = time.perf_counter() - clock.t0
        return clock.events, wall

    sides = {"ours": run_ours, "torch": run_theirs}
    out = dict(orders=dict(ours=[(a.op, a.mb, a.chunk) for a in schedule.actions(rank) if not a.is_comm],
                           torch=_torch_order(torch_schedule, schedule, rank)),
               grads={}, timelines={"ours": [], "torch": []}, walls={"ours": [], "torch": []},
               plain={"ours": [], "torch": []}, cpu={"ours": [], "torch": []})
    for side, run in sides.items():  # the first step of each: gradients (and messages sized)
        run(False)
        out["grads"][side] = _grads(ours if side == "ours" else theirs)
    for i in range(plain_steps + steps):
        timed = i >= plain_steps
        for side in (("ours", "torch") if i % 2 == 0 else ("torch", "ours")):
            cpu = time.process_time()
            events, wall = sides[side](timed)
            if timed:
                out["timelines"][side].append(events)
                out["walls"][side].append(wall)
            else:
                out["plain"][side].append(wall)
                out["cpu"][side].append(time.process_time() - cpu)
    return out


def rank_body(rows, pp, m, tau, steps, plain_steps):
    """Every row on this rank: {row: result or the error's first line}. ``steps`` and
    ``plain_steps``: a number for every row, or {course kind: number}."""
    from reference.mesh import Mesh
    from reference.pipeline_parallel import build_embedding_group

    mesh = Mesh(pp=pp).build_groups()
    tied_group = build_embedding_group(mesh)
    out = {}
    for row in rows:
        try:
            n = [s.get(row[2], 0) if isinstance(s, dict) else s for s in (steps, plain_steps)]
            out[row] = _compare_row(mesh, tied_group, *row, pp, m, tau, *n)
        except Exception as err:  # a schedule that does not run here: its row says why
            out[row] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
        dist.barrier()
    return out


# ------------------------------------------------------------------------ reading the results

def one_process_grads(pp: int, m: int) -> dict:
    """The oracle: the whole model, the same batch in m chunks, `accumulate_gradients`."""
    from reference.train.single import accumulate_gradients

    model = GPT.from_config_seed(config(pp), 0)
    x, y = synthetic_batch(B, CFG["block_size"], CFG["vocab_size"], seed=1)
    accumulate_gradients(model, x, y, chunks=m)
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def largest_difference(pairs) -> float:
    """The largest |got[name] - want[name]| over the (got, want) pairs of gradient dicts."""
    return max((g - want[name]).abs().max().item() for got, want in pairs for name, g in got.items())


def idle_by_rank(timeline) -> list:
    """Each rank's idle share of the common span: 1 - busy_r / span (compute actions only).
    Their mean is `bubble_of` of the same events."""
    events = [e for rank in timeline for e in rank]
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    return [1 - sum(e.end - e.start for e in rank) / (t1 - t0) for rank in timeline]


def simulated(kind: str, pp: int, m: int, v: int, tau: float) -> list:
    """The course's ideal timeline at the same costs: its idle share per rank."""
    tl = build_schedule(kind, pp, m, v).simulate(tau, 2 * tau, tau)
    return idle_by_rank([[e for e in rank if not e.action.is_comm] for rank in tl])


def summarise(results, row, pp, m, tau):
    """One row's figures from every rank's result."""
    name, v, kind = row
    got = [r[row] for r in results]
    if any(isinstance(g, str) for g in got):
        return dict(error=next(g for g in got if isinstance(g, str)))
    ref = one_process_grads(pp, m)
    ours, theirs = [g["grads"]["ours"] for g in got], [g["grads"]["torch"] for g in got]
    pairs = {"ours_vs_torch": list(zip(ours, theirs)), "ours_vs_one": [(o, ref) for o in ours],
             "torch_vs_one": [(t, ref) for t in theirs]}
    cost = costs(tau, v)
    out = {key: largest_difference(p) for key, p in pairs.items()}
    out.update(
        same_order=all(g["orders"]["ours"] == g["orders"]["torch"] for g in got),
        within=all(gradient(m + 1).close(a[n], b[n]) for p in pairs.values() for a, b in p for n in a),
        covered=set().union(*ours) == set(ref) == set().union(*theirs),
        simulated=simulated(kind, pp, m, v, tau))
    for side in ("ours", "torch"):
        steps = len(got[0]["timelines"][side])
        per_step = [idle_by_rank([g["timelines"][side][s] for g in got]) for s in range(steps)]
        out[f"idle_{side}"] = [statistics.median(step[r] for step in per_step) for r in range(pp)]
        out[f"late_{side}"] = statistics.median(
            lateness([g["timelines"][side][s] for g in got], cost) for s in range(steps))
        out[f"wall_{side}"] = statistics.median(max(g["walls"][side][s] for g in got) for s in range(steps))
        n_plain = len(got[0]["plain"][side])
        out[f"plain_{side}"] = statistics.median(max(g["plain"][side][s] for g in got)
                                                 for s in range(n_plain)) if n_plain else float("nan")
        out[f"cpu_{side}"] = statistics.median(sum(g["cpu"][side][s] for g in got)
                                               for s in range(n_plain)) if n_plain else float("nan")
    out["margin"] = idle_margin(max(out["late_ours"], out["late_torch"]), cost)
    return out


def _pct(xs) -> str:
    return "/".join(f"{100 * x:.0f}" for x in xs)


def print_table(rows, figures, pp, m, tau):
    print(f"pp = {pp}, m = {m}, tied GPT of {config(pp).n_layer} layers, {config(pp).n_layer // pp} per rank "
          f"(C = {CFG['n_embd']}); gradients of one step; gradient bound "
          f"{gradient(m + 1).summary()} (reference.tolerance.gradient({m + 1}))")
    print(f"injected costs: a whole stage's F = I = W = {1e3 * tau:g} ms (a chunk's 1/v of it); "
          f"idle shares in %, ranks 0..{pp - 1}, mean in brackets; time = ours / PyTorch's\n")
    head = (f"{'PyTorch schedule':<29} {'v':>1} {'course':<11} {'order':>5} {'|ours-pt|':>9} "
            f"{'|ours-1|':>8} {'|pt-1|':>8} {'simulated':>18} {'ours':>18} {'PyTorch':>18} "
            f"{'margin':>6} {'time':>5} {'plain':>5} {'cpu':>5}")
    print(head)
    print("-" * len(head))
    for row in rows:
        name, v, kind = row
        f = figures[row]
        if "error" in f:
            print(f"{name:<29} {v:>1} {kind:<11} does not run: {f['error']}")
            continue

        def idle(xs):
            return f"{_pct(xs)} ({100 * sum(xs) / len(xs):.1f})"

        print(f"{name:<29} {v:>1} {kind:<11} {'same' if f['same_order'] else 'other':>5} "
              f"{f['ours_vs_torch']:>9.1e} {f['ours_vs_one']:>8.1e} {f['torch_vs_one']:>8.1e} "
              f"{idle(f['simulated']):>18} {idle(f['idle_ours']):>18} {idle(f['idle_torch']):>18} "
              f"{100 * f['margin']:>5.1f}% {f['wall_ours'] / f['wall_torch']:>5.2f} "
              f"{f['plain_ours'] / f['plain_torch']:>5.2f} {f['cpu_ours'] / f['cpu_torch']:>5.2f}")
        if not (f["within"] and f["covered"]):
            print(f"    gradients NOT within the bound (or not every parameter covered)")
    print("\norder: whether PyTorch's compute actions (its pipeline_order, pairs unpacked) are the course's,\n"
          "  rank by rank; |ours-pt|, |ours-1|, |pt-1|: the largest gradient difference, ours against\n"
          "  PyTorch's, each against one process; simulated: the course's schedule's ideal timeline (the\n"
          "  v = 2 ScheduleInterleavedZeroBubble runs beside interleaved 1F1B, whose backward is whole);\n"
          "  margin: 2 x the mean lateness of an action / the smallest cost (idle_margin); time: step\n"
          "  time ours / PyTorch's with the costs, plain: without them (compute alone); cpu: the same steps'\n"
          "  CPU seconds, summed over the ranks (what the runtimes compute, whatever else loads the machine)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--cost", type=float, default=0.08, help="seconds of a whole stage's F (= I = W)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side, with the costs")
    parser.add_argument("--plain-steps", type=int, default=10, help="timed steps per side, compute alone")
    parser.add_argument("--only", nargs="*", default=None, help="PyTorch schedule names to run")
    args = parser.parse_args()
    rows = [r for r in ROWS if args.only is None or r[0] in args.only]
    start = time.perf_counter()
    results = launch(rank_body, args.pp, rows, args.pp, args.microbatches, args.cost, args.steps,
                     args.plain_steps, timeout=600, quiet=True)
    figures = {row: summarise(results, row, args.pp, args.microbatches, args.cost) for row in rows}
    print_table(rows, figures, args.pp, args.microbatches, args.cost)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
