"""The course's composed parallelisms against PyTorch's own building blocks, same GPT, same ranks.

    python bench/compose_vs_pytorch.py [--steps 10] [--batch 8] [--seq 64] [--layers 4] [--embd 128]
                                       [--microbatches 2] [--only "tp x pp"]

The same GPT (`GPT.from_config_seed(config, 0)`) is trained with AdamW (lr 1e-3, eps 1e-6)
on the same global batches, four ways composed, on gloo CPU ranks:

==============  =====  =========================================  ==========================================
composition     ranks  ours (`reference.parallel`)                 PyTorch's
==============  =====  =========================================  ==========================================
dp x tp         4      ParallelConfig(dp=2, tp=2)                  ``parallelize_module`` (ColwiseParallel on
                                                                   c_attn and c_fc, RowwiseParallel on both
                                                                   c_proj) on the "tp" dim of an
                                                                   ``init_device_mesh("cpu", ...)``; gradients
                                                                   all-reduced over "dp" in one flat tensor
FSDP x tp       4      ParallelConfig(dp=2, tp=2, zero_stage=3)    the same TP, then ``fully_shard`` on every
                                                                   block and the root over the "dp" dim
tp x pp         4      ParallelConfig(tp=2, pp=2, microbatches=m)  the same TP inside each stage;
                                                                   ``PipelineStage`` + ``Schedule1F1B`` over "pp"
dp x tp x pp    8      ParallelConfig(dp=2, tp=2, pp=2, ...)       the three above, dp as a flat all-reduce
==============  =====  =========================================  ==========================================

Both meshes put the ranks in Megatron's order (tp innermost, then dp, pp outermost), so the
same ranks pair up on both sides. Differences in what each computes: ours splits the
embedding and the loss over the vocabulary (vocab-parallel) and PyTorch's plan here keeps
them replicated on every tp rank, as ``parallelize_module`` does for modules it is not
given; c_attn's rows are reordered [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] so that a contiguous
column split keeps whole heads (as in bench/tp_vs_dtensor.py). With a pipeline, the tied
embedding is a separate copy on the last stage and its gradient is summed with the first
stage's over the first and last stages (Megatron's embedding group), on both sides.

Correctness first: the first two steps of each composition (before timing) print the global
loss of ours, of PyTorch's and of one process training the same batches (the second step's
loss shows the gradients, their synchronisation and the optimizer step agree too).

Time: the two versions alternate step by step (ours first on even steps, PyTorch's first on
odd ones) so that machine load affects both alike; a step is bracketed by barriers, its time
is the slowest rank's, and the table shows ours / PyTorch's of the medians. Only the ratio
means anything: every rank shares the same two or few cores.

Bytes sent per rank, one step (the second), counted the same way on both sides: a
``TorchDispatchMode`` sees every collective as it is dispatched, torch.distributed's own
``c10d`` ops (what ``dist.all_reduce``, FSDP2's all-gathers and reduce-scatters and the
pipeline's isend/irecv call) and the functional collectives DTensor issues (it returns
NotImplemented on DTensor arguments, as ``CommDebugMode`` does, so that DTensor desugars into
its collectives first). Each call is charged the bytes the ring algorithm sends from this
rank, `reference.comms.ring_sent_bytes` (all-reduce 2(N-1)/N S, all-gather and
reduce-scatter (N-1)/N S, broadcast S, send S, recv 0): the course's own formula. The
column is the mean over ranks. On our side the course's meter (`reference.comms.meter`,
recorded by its collective wrappers) is read as well, and the two counts are printed side by
side: they agree, which checks the dispatch-level counter. What it cannot see: bytes gloo
moves for its own bookkeeping (barriers, rendezvous, shape messages of the pipeline's first
step are outside the measured step).

Where the bytes differ, the last table splits one step's bytes by collective and by the
mesh dimension of its group, mean over ranks. What it shows with the defaults: ours
all-reduces 2 x b T C x 4 bytes more over tp per micro-batch on the ranks holding the
embedding or the head (b sequences of T tokens, width C): the vocab-parallel embedding's
output in forward and the column-parallel head's input gradient in backward, which a
replicated embedding and head do not need, plus the vocab-parallel loss's three all-reduces
of b T numbers; and it all-reduces less over dp, since each tp
rank holds 1/tp of the embedding's gradient. With pipelines ours all-reduces the tied
embedding's gradient over the first and last stages with 1/tp of the rows, PyTorch's the
whole. Under FSDP x tp PyTorch's ``fully_shard`` all-gathers each block twice per step
(forward, and again in backward: ``reshard_after_forward=True``, its default) where ours
gathers the stage once and keeps it (`reference.zero.fsdp_param`): half the all-gather bytes
for the stage held whole during the step. Ours also sends a few bytes more point to point:
the last stage sends the step's loss to the other pipeline ranks.

Peak memory per rank: the CPU allocator's own count, read through ``torch.profiler`` with
``profile_memory=True``. The profiler is started before the model is built, so it sees every
allocation of this version on this rank (weights, their shards, gradients, optimizer state,
activations, gathered parameters, collective outputs, and the frees, ``resize_(0)`` included);
the running sum of the allocator's [memory] events is taken at its maximum inside the second
step. That includes what the rank holds for good (its weights and AdamW's state) and what the
step allocates; not memory gloo takes with its own malloc, nor Python objects. Both versions
run in the same process, one after the other, and only the profiled version's allocations are
summed. The column is the median over ranks: a rank's peak moves from run to run (by a
128 KiB activation here and there, now and then by MiBs with ZeRO-3), because when gloo's
threads finish a collective, and so when its buffers are freed, depends on timing.

What does not run: with torch 2.13 on gloo CPU all four of PyTorch's compositions run,
DTensor stages inside ``torch.distributed.pipelining`` and ``fully_shard`` over the dp dim of
a 2D mesh included (the TP plan hands plain tensors to the pipeline: ``use_local_output``).
A composition that raises on every rank (a release or backend that does not support it)
prints its name and the error's first line in place of its row, and the others still run;
one that fails on some ranks only leaves the others waiting in a collective until
`launch`'s timeout.
"""
import argparse
import collections
import gc
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from reference.comms import ring_sent_bytes
from reference.model import GPT, GPTConfig, lm_loss
from reference.runtime import launch

LR, EPS = 1e-3, 1e-6
COMPOSITIONS = {            # name: (dp, tp, pp, zero_stage)
    "dp x tp": (2, 2, 1, 0),
    "FSDP x tp": (2, 2, 1, 3),
    "tp x pp": (1, 2, 2, 0),
    "dp x tp x pp": (2, 2, 2, 0),
}


# ------------------------------------------------------------------------ data and oracle

def batches(cfg, B, steps):
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, cfg.vocab_size, (steps, B, cfg.block_size + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def one_process_losses(cfg, data):
    """The oracle: one process, full batch, AdamW, the first two steps' losses."""
    model = GPT.from_config_seed(cfg, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for x, y in data[:2]:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------------ measuring

def _group_of(value):
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(value, str):
        return _resolve_process_group(value)
    if isinstance(value, dist.ProcessGroup):
        return value
    return dist.ProcessGroup.unbox(value)


def _nbytes(t):
    return t.numel() * t.element_size()


def _ring(op, tensors, group, src=0):
    n, i = group.size(), group.rank()
    return sum(ring_sent_bytes(op, t.numel(), t.element_size(), n, i, src=src) for t in tensors)


def _label(group, comp) -> str:
    """The mesh dimension a group spans, from its ranks (both sides lay ranks out as (pp, dp, tp),
    tp fastest): "tp", "dp", "pp" (with pp = 2 the tied embedding's group is the same pair)."""
    ranks = sorted(dist.get_process_group_ranks(group))
    if len(ranks) == dist.get_world_size():
        return "world"
    dp, tp, pp, _ = comp
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 0
    for dim, degree, step in (("tp", tp, 1), ("dp", dp, tp), ("pp", pp, tp * dp)):
        if degree > 1 and len(ranks) == degree and stride == step:
            return dim
    if pp > 1 and len(ranks) == 2 and stride == (pp - 1) * tp * dp:
        return "embedding"
    return f"{len(ranks)} ranks"


# c10d ops charged the ring formula: op name -> (collective, the argument holding its tensors)
_C10D_RING = {"allreduce_": ("all_reduce", "tensors"), "allreduce_coalesced_": ("all_reduce", "tensors"),
              "_allgather_base_": ("all_gather", "output_tensor"),
              "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
              "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
              "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs")}


class CollectiveBytes(TorchDispatchMode):
    """Bytes this rank sends in the collectives dispatched inside the block (ring formula), in
    all (`sent`) and by (collective, mesh dimension) (`by`)."""

    def __init__(self, comp):
        super().__init__()
        self.comp = comp
        self.sent = 0
        self.calls = 0
        self.by = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns in ("c10d", "_c10d_functional"):
            a = dict(zip((x.name for x in func._schema.arguments), args)) | kwargs
            found = self._bytes(ns, name, a)
            if found is not None:
                op, group, sent = found
                self.sent += sent
                self.calls += 1
                self.by[op, _label(group, self.comp)] += sent
        return func(*args, **kwargs)

    @staticmethod
    def _bytes(ns, name, a):
        """(collective, group, bytes this rank sends), or None for what sends nothing."""
        if ns == "c10d":
            g = a.get("process_group")
            group = _group_of(g) if g is not None else None
            if name in _C10D_RING:
                op, key = _C10D_RING[name]
                tensors = a[key] if isinstance(a[key], (list, tuple)) else [a[key]]
                return op, group, _ring(op, tensors, group)
            if name == "allgather_":
                return "all_gather", group, _ring("all_gather", [torch.cat(o) for o in a["output_tensors"]], group)
            if name == "broadcast_":
                return "broadcast", group, _ring("broadcast", a["tensors"], group, src=a["root_rank"])
            if name == "send":
                return "send", group, sum(_nbytes(t) for t in a["tensors"])
            if name in ("alltoall_base_",):
                n = group.size()
                return "all_to_all", group, _nbytes(a["input"]) * (n - 1) // n
            return None  # recv, barrier, monitored waits: nothing sent
        if "group_name" not in a:
            return None  # wait_tensor and the like: no data of their own
        g = _group_of(a["group_name"])
        if name in ("all_reduce", "all_reduce_"):
            return "all_reduce", g, _ring("all_reduce", [a["input"]], g)
        if name == "all_reduce_coalesced":
            return "all_reduce", g, _ring("all_reduce", a["inputs"], g)
        if name == "all_gather_into_tensor":
            x = a["input"]
            return "all_gather", g, _ring("all_gather", [x.new_empty((x.numel() * g.size(),))], g)
        if name == "all_gather_into_tensor_out":
            return "all_gather", g, _ring("all_gather", [a["out"]], g)
        if name == "reduce_scatter_tensor":
            return "reduce_scatter", g, _ring("reduce_scatter", [a["input"]], g)
        if name == "broadcast":
            return "broadcast", g, _ring("broadcast", [a["input"]], g, src=a["src"])
        if name == "all_to_all_single":
            return "all_to_all", g, _nbytes(a["input"]) * (g.size() - 1) // g.size()
        return None


def peak_bytes(prof, window="bench_measured_step"):
    """The CPU allocator's bytes alive at their maximum inside the `window` record_function."""
    events = list(prof.profiler.kineto_results.events())
    marks = [e for e in events if e.name() == window]
    start, end = marks[-1].start_ns(), marks[-1].end_ns()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    alive = peak = 0
    for t, n in mem:
        alive += n
        if start <= t <= end:
            peak = max(peak, alive)
    return peak


# ------------------------------------------------------------------------ the course's side

def build_ours(cfg, comp, m, B):
    from reference.parallel import ParallelConfig, parallelize, train_step

    dp, tp, pp, zero = comp
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, zero_stage=zero, microbatches=m if pp > 1 else 1)
    pm = parallelize(GPT.from_config_seed(cfg, 0), config.mesh().build_groups(), config,
                     batch=(B, cfg.block_size))
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    return lambda x, y: float(train_step(pm, opt, x, y).loss)


# ------------------------------------------------------------------------ PyTorch's side

class Stage(nn.Module):
    """Blocks [lo, hi) of a GPT, with the embedding on the first stage and the head on the last."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.h = nn.ModuleList(model.h[lo:hi])
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
            if not first:  # the tied weight: this stage's own copy, its gradient summed with stage 0's
                self.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, x):
        if self.first:  # (B, T) ids -> (B, T, C)
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1])))
        for block in self.h:
            x, _ = block(x)
        if self.last:  # (B, T, C) -> (B, T, V)
            x = self.lm_head(self.ln_f(x))
        return x


def _tensor_parallel(model, tp_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from reference.tensor_parallel import column_shard

    n = tp_mesh.size()
    plan = {}
    for i, block in enumerate(model.h):
        with torch.no_grad():  # heads laid out rank by rank: a contiguous split keeps them whole
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                p.copy_(torch.cat([column_shard(p, r, n, chunks=3) for r in range(n)]))
        plan |= {f"h.{i}.attn.c_attn": ColwiseParallel(), f"h.{i}.attn.c_proj": RowwiseParallel(),
                 f"h.{i}.ffn.c_fc": ColwiseParallel(), f"h.{i}.ffn.c_proj": RowwiseParallel()}
    return parallelize_module(model, tp_mesh, plan)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def build_torch(cfg, comp, m, B):
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp, pp, zero = comp
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_group, pp_group = mesh.get_group("dp"), mesh.get_group("pp")
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    model = _tensor_parallel(GPT.from_config_seed(cfg, 0), mesh["tp"])
    schedule = emb_group = None
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        per = cfg.n_layer // pp
        first, last = pp_rank == 0, pp_rank == pp - 1
        model = Stage(model, pp_rank * per, (pp_rank + 1) * per, first, last)
        # the embedding group: first and last stage of every pipeline (every rank creates them all)
        grid = mesh.mesh.reshape(pp, -1)
        for col in range(grid.shape[1]):
            g = dist.new_group([int(grid[0, col]), int(grid[-1, col])])
            if dist.get_rank() in (int(grid[0, col]), int(grid[-1, col])):
                emb_group = g
        stage = PipelineStage(model, pp_rank, pp, torch.device("cpu"), group=pp_group)
        schedule = Schedule1F1B(stage, m, loss_fn=lm_loss)  # grads scaled by 1 / m: the mean
    if zero == 3:
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    rows = B // dp

    def step(x, y):
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros(1)
        if schedule is None:
            logits, _ = model(x)
            loss = lm_loss(logits, y)
            loss.backward()
            loss = loss.detach().reshape(1)
        else:
            if model.first:
                schedule.step(x, return_outputs=False)
            elif model.last:
                losses = []
                schedule.step(target=y, losses=losses, return_outputs=False)
                loss = torch.stack(losses).mean().detach().reshape(1)
            else:
                schedule.step(return_outputs=False)
            if emb_group is not None:  # the tied embedding: first + last stage's gradients
                w = model.wte.weight if model.first else model.lm_head.weight
                dist.all_reduce(_local(w.grad), group=emb_group)
        if dp > 1 and zero != 3:  # one flat all-reduce of every local gradient over dp
            with torch.no_grad():
                grads = [_local(p.grad) for p in params if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=dp_group)
                flat /= dp
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
        opt.step()
        if pp > 1:  # the global mean loss on every rank, as train_step returns it
            dist.broadcast(loss, group=pp_group, group_src=pp - 1)
        if dp > 1:
            dist.all_reduce(loss, group=dp_group)
            loss /= dp
        return float(loss)
    return step


# ------------------------------------------------------------------------ one rank

def _build_and_measure(build, cfg, comp, m, B, data, meter_ours):
    """Build one version under the memory profiler; run the two check steps; the second is
    measured for bytes and peak memory. Returns (step function, losses, bytes, peak)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from reference import comms

    # Nothing but this version may free memory while it is profiled: the allocator reports
    # the free of any block allocated under an earlier profile too, which would be subtracted
    # from this version's sum. So the garbage is collected first and the collector held off.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step = build(cfg, comp, m, B)
            losses = [step(*data[0])]
            dist.barrier()
            with record_function("bench_measured_step"), CollectiveBytes(comp) as counted, \
                    comms.meter() as metered:
                losses.append(step(*data[1]))
            dist.barrier()
    finally:
        gc.enable()
    sent = (counted.sent, metered.sent_bytes() if meter_ours else None, dict(counted.by))
    return step, losses, sent, peak_bytes(prof)


def _rank(names, cfg, B, m, steps):
    data = batches(cfg, B, steps + 2)
    out = {}
    for name in names:
        comp = COMPOSITIONS[name]
        res = {}
        ours, res["ours_losses"], res["ours_bytes"], res["ours_peak"] = _build_and_measure(
            build_ours, cfg, comp, m, B, data, True)
        try:
            theirs, res["torch_losses"], res["torch_bytes"], res["torch_peak"] = _build_and_measure(
                build_torch, cfg, comp, m, B, data, False)
        except Exception as e:  # noqa: BLE001 - reported in the table, the other rows still run
            res["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            res["traceback"] = traceback.format_exc()
            theirs = None
        times = {"ours": [], "torch": []}
        runs = {"ours": ours, "torch": theirs} if theirs is not None else {"ours": ours}
        for i in range(steps):
            order = list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]
            for key, run in order:
                dist.barrier()
                t0 = time.perf_counter()
                run(*data[2 + i])
                dist.barrier()  # the step ends when the slowest rank ends it
                times[key].append(time.perf_counter() - t0)
        res["times"] = times
        out[name] = res
        del ours, theirs, runs
    return out


# ------------------------------------------------------------------------ main

def _fmt_bytes(n):
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after the two check steps)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2, help="with a pipeline")
    parser.add_argument("--only", nargs="+", choices=list(COMPOSITIONS), default=list(COMPOSITIONS))
    args = parser.parse_args()
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, block_size=args.seq)
    data = batches(cfg, args.batch, 2)
    oracle = one_process_losses(cfg, data)
    n_params = GPT(cfg).num_parameters()
    print(f"GPT {cfg.n_layer} layers, n_embd {cfg.n_embd}, {n_params / 1e6:.2f}M parameters; global batch "
          f"{args.batch} x {cfg.block_size}; {args.microbatches} micro-batches with a pipeline; gloo CPU; "
          f"median of {args.steps} steps (slowest rank)")
    results = {}
    by_world = {}
    for name in args.only:
        dp, tp, pp, _ = COMPOSITIONS[name]
        by_world.setdefault(dp * tp * pp, []).append(name)
    for world, names in by_world.items():
        per_rank = launch(_rank, world, names, cfg, args.batch, args.microbatches, args.steps,
                          backend="gloo", timeout=1200, quiet=True)
        for name in names:
            results[name] = [r[name] for r in per_rank]

    print("\ncheck, global loss of steps 1 and 2:")
    for name in args.only:
        r0 = results[name][0]
        line = (f"  {name:<13} one process {oracle[0]:.6f} {oracle[1]:.6f} | ours "
                f"{r0['ours_losses'][0]:.6f} {r0['ours_losses'][1]:.6f}")
        if "error" in r0:
            print(line + " | PyTorch did not run")
            continue
        ok = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(r0["torch_losses"], oracle))
        print(line + f" | PyTorch {r0['torch_losses'][0]:.6f} {r0['torch_losses'][1]:.6f}"
              f"  {'equal' if ok else 'DIFFERENT'} (rtol 1e-4)")

    print("\nbytes counters on our side (mean per rank): dispatch-level counter vs the course's meter")
    for name in args.only:
        ranks = results[name]
        counted = statistics.mean(r["ours_bytes"][0] for r in ranks)
        metered = statistics.mean(r["ours_bytes"][1] for r in ranks)
        print(f"  {name:<13} {counted:>12,.0f} vs {metered:>12,.0f}  {'agree' if counted == metered else 'DIFFER'}")

    print("\nstep time: median over steps of the slowest rank; sent: one step's bytes, ring count, mean "
          "over ranks; peak: allocator's peak in one step, median over ranks")
    print(f"{'composition':<13} {'ranks':>5} {'ours/PyTorch':>12} {'ours ms':>8} {'PyTorch ms':>10} "
          f"{'sent ours':>11} {'sent PyTorch':>12} {'peak ours':>11} {'peak PyTorch':>12}")
    for name in args.only:
        ranks = results[name]
        world = len(ranks)
        med = {k: statistics.median(max(ts) for ts in zip(*(r["times"][k] for r in ranks)))
               for k in ranks[0]["times"] if ranks[0]["times"][k]}
        ours_sent = statistics.mean(r["ours_bytes"][0] for r in ranks)
        ours_peak = statistics.median(r["ours_peak"] for r in ranks)
        if "error" in ranks[0]:
            print(f"{name:<13} {world:>5} {'n/a':>12} {med['ours'] * 1e3:>8.1f} {'n/a':>10} "
                  f"{_fmt_bytes(ours_sent):>11} {'n/a':>12} {_fmt_bytes(ours_peak):>11} {'n/a':>12}")
            print(f"    PyTorch's {name} did not run: {ranks[0]['error']}")
            continue
        torch_sent = statistics.mean(r["torch_bytes"][0] for r in ranks)
        torch_peak = statistics.median(r["torch_peak"] for r in ranks)
        print(f"{name:<13} {world:>5} {med['ours'] / med['torch']:>11.2f}x {med['ours'] * 1e3:>8.1f} "
              f"{med['torch'] * 1e3:>10.1f} {_fmt_bytes(ours_sent):>11} {_fmt_bytes(torch_sent):>12} "
              f"{_fmt_bytes(ours_peak):>11} {_fmt_bytes(torch_peak):>12}")

    print("\nwhere the bytes go: one step's bytes by collective and mesh dimension, mean over ranks "
          "(a row only where the two differ)")
    for name in args.only:
        ranks = results[name]
        if "error" in ranks[0]:
            continue
        parts = {side: collections.Counter() for side in ("ours", "torch")}
        for r in ranks:
            for side in parts:
                parts[side].update(r[f"{side}_bytes"][2])
        keys = sorted(set(parts["ours"]) | set(parts["torch"]), key=lambda k: (k[1], k[0]))
        rows = [(k, parts["ours"][k] / len(ranks), parts["torch"][k] / len(ranks)) for k in keys]
        rows = [row for row in rows if round(row[1]) != round(row[2])]
        print(f"  {name}: " + ("the same collectives, the same bytes" if not rows else ""))
        for (op, dim), ours_b, torch_b in rows:
            print(f"    {op:<15} over {dim:<10} ours {ours_b:>11,.0f} B   PyTorch {torch_b:>11,.0f} B"
                  f"   ours - PyTorch {ours_b - torch_b:>+11,.0f} B")


if __name__ == "__main__":
    main()
