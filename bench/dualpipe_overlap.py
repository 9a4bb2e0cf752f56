"""DualPipe's overlapped F&B against its pairs run one after the other, and against ZB-V.

    python bench/dualpipe_overlap.py [--microbatches 8] [--cost 0.02]

Eight ranks would not fit a laptop's cores, so the pipeline is pp = 2 ranks (four model stages in
a V) times dp = ep = 2 (the experts split over the two data-parallel ranks of a stage): 4 gloo
ranks. The model is a GPT whose every block's MLP is a mixture of 4 experts, 2 per token, no
token dropped (one block per stage). Costs are injected (`reference.pipeline_parallel.overlap.slow`
and `charged_all_to_all`), with tau = ``--cost``: per block and micro-batch, attention takes tau
forward and 2 tau backward, the experts together tau and 2 tau, and every dispatch and combine
all-to-all, forward or backward, tau: the all-to-all as long as the MLP, as the issue asks. The
expert counts' exchange is not charged.

For each schedule, the step time (the slowest rank's span from the common start) and the idle
share 1 - C / step, C the compute a rank is charged (2 chunks x m x 6 tau; the same work under
every schedule). Sequential DualPipeV waits for each all-to-all where it stands, as ZB-V does;
overlapped, a pair's all-to-alls run while the other micro-batch computes.
Gradients: the overlapped run's, after the dp / ep reduction, against one process
(`accumulate_gradients` over the 2 m rows), within `reference.tolerance.gradient`.
"""
from __future__ import annotations

import argparse

import torch

CFG = dict(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=64)
MOE = dict(n_experts=4, k=2)
PP, DP = 2, 2
RUNS = ("zb-v", "dualpipev", "dualpipev-overlap")


def _model():
    from reference.expert_parallel import moe_factory
    from reference.model import GPT, GPTConfig

    return GPT.from_config_seed(GPTConfig.tiny(**CFG), seed=0, ffn_factory=moe_factory(**MOE, capacity_factor=None))


def _batch(m: int):
    from reference.data import synthetic_batch

    return synthetic_batch(DP * m, CFG["block_size"], CFG["vocab_size"], seed=1, step=0)  # one row per micro-batch


def _body(m: int, cost: float, with_grads: bool):
    """On each of the 4 ranks: every run's span and, for the overlapped one, its trace and gradients."""
    import torch.distributed as dist

    from reference.comms import all_to_all_waited_by
    from reference.expert_parallel import moe_all_reduce_gradients, shard_experts
    from reference.expert_parallel.moe import MoELayer
    from reference.mesh import Mesh
    from reference.pipeline_parallel import (build_embedding_group, build_schedule, local_stages,
                                             overlap_pairs, run_pipeline, split_stages)
    from reference.pipeline_parallel.overlap import charged_all_to_all, slow

    mesh = Mesh(pp=PP, dp=DP, ep=DP).build_groups()
    tied = build_embedding_group(mesh)
    x, y = _batch(m)
    rows = slice(mesh.dp_rank * m, (mesh.dp_rank + 1) * m)  # this dp rank's m rows
    out = {}
    for name in RUNS:
        kind = "dualpipev" if name.startswith("dualpipev") else name
        schedule = build_schedule(kind, PP, m, virtual=2)
        schedule = overlap_pairs(schedule) if name.endswith("overlap") else schedule
        model = shard_experts(_model(), mesh.ep_group)
        stages = local_stages(split_stages(model, PP, 2), PP, mesh.pp_rank, schedule)
        timed = cost > 0
        if timed:
            for st in stages:
                for block in st.h.values():
                    slow(block.attn, cost, 2 * cost)
                    moe = block.ffn
                    assert isinstance(moe, MoELayer)
                    for e in moe.experts:
                        slow(e, cost / len(moe.experts), 2 * cost / len(moe.experts))
        dist.barrier()
        with all_to_all_waited_by(charged_all_to_all(cost) if timed else None):
            result = run_pipeline(schedule, stages, x[rows], y[rows], group=mesh.pp_group, tied_group=tied)
        both = torch.nn.ModuleList(stages)  # under the V rank 0's two stages share the tied embedding
        moe_all_reduce_gradients(both, mesh.dp_group, mesh.edp_group)
        span = max(e.end for e in result.trace) - min(e.start for e in result.trace)
        out[name] = dict(span=span, trace=result.trace if name.endswith("overlap") else None)
        if with_grads:
            out[name]["grads"] = {_global_name(st, n): p.grad.clone() for st in stages
                                  for n, p in st.named_parameters() if p.grad is not None}
    dist.barrier()
    return out


def _global_name(stage, name: str) -> str:
    """The model's name of a stage's parameter: a local expert l named by its global id."""
    from reference.expert_parallel import ExpertParallelMoE

    for path, mod in stage.named_modules():
        if isinstance(mod, ExpertParallelMoE) and name.startswith(f"{path}.experts."):
            local, rest = name[len(path) + 9:].split(".", 1)
            return f"{path}.experts.{mod.expert_ids[int(local)]}.{rest}"
    return name


def run(m: int = 8, cost: float = 0.02, with_grads: bool = False):
    """Every rank's results (`_body`) on 4 gloo ranks."""
    from reference.runtime import launch

    return launch(_body, PP * DP, m, cost, with_grads, timeout=280, quiet=True)


def figures(results, m: int, cost: float) -> dict:
    """Per run: step time (the slowest rank's span) and idle share 1 - charged compute / step."""
    charged = 2 * m * 6 * cost  # 2 chunks x m micro-batches x (attention 3 tau + experts 3 tau)
    out = {}
    for name in RUNS:
        step = max(r[name]["span"] for r in results)
        out[name] = dict(step=step, idle=1 - charged / step)
    return out


def one_process_grads(m: int) -> dict:
    """The oracle's gradients: the 2 m rows as 2 m chunks, by the model's names."""
    from reference.train.single import accumulate_gradients

    model = _model()
    x, y = _batch(m)
    accumulate_gradients(model, x, y, chunks=DP * m, loss_mean="mean_of_means")
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--cost", type=float, default=0.02)
    args = ap.parse_args()
    results = run(args.microbatches, args.cost)
    fig = figures(results, args.microbatches, args.cost)
    base = fig["dualpipev"]["step"]
    print(f"pp={PP} (V, 4 stages), dp=ep={DP}, m={args.microbatches}, tau={args.cost}s: "
          f"attention tau / 2 tau, experts tau / 2 tau, each all-to-all tau")
    print(f"{'schedule':<20}{'step (s)':>10}{'idle':>8}{'vs sequential DualPipeV':>26}")
    for name, f in fig.items():
        print(f"{name:<20}{f['step']:>10.3f}{f['idle']:>8.1%}{f['step'] / base:>26.2f}")


if __name__ == "__main__":
    main()
