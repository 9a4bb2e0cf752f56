"""DualPipeV with experts, measured: its pairs overlapped, one after the other, and ZB-V.

The expert all-to-all that DualPipe's overlap hides (`reference.pipeline_parallel.overlap`) is
expert parallelism's, so the comparison lives in the composing layer, above both, beside the
oracle it is checked against. Four gloo ranks: a pipeline of
pp = 2 ranks (four model stages in a V, one block each) times dp = ep = 2 (the experts of a stage
split over its two data-parallel ranks). The GPT's every block is a mixture of 4 experts, 2 per
token, none dropped. With ``cost`` tau > 0 the costs are injected (`slow`, `charged_all_to_all`):
per block and micro-batch attention takes tau forward and 2 tau backward, the experts together
tau and 2 tau, and every dispatch and combine all-to-all, forward or backward, tau: the
all-to-all as long as the MLP. The expert counts' exchange is not charged.

`figures`: per run the step time (the slowest rank's span) and the idle share 1 - C / step, C the
compute a rank is charged, 2 chunks x m x 6 tau, the same work under every schedule (the tiny
model's own compute, a few milliseconds, counts as idle). `one_process_grads`: the oracle.
"""
from __future__ import annotations

import torch

__all__ = ["run", "figures", "one_process_grads", "RUNS"]

CFG = dict(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=64)
MOE = dict(n_experts=4, k=2)
PP, DP = 2, 2
RUNS = ("zb-v", "dualpipev", "dualpipev-overlap")


def _model():
    from reference.expert_parallel import moe_factory
    from reference.model import GPT, GPTConfig

    experts = moe_factory(**MOE, capacity_factor=None)  # no token dropped
    return GPT.from_config_seed(GPTConfig.tiny(**CFG), seed=0, ffn_factory=experts)


def _batch(m: int):
    from reference.data import synthetic_batch

    # one row per micro-batch
    return synthetic_batch(DP * m, CFG["block_size"], CFG["vocab_size"], seed=1, step=0)


def _body(m: int, cost: float, with_grads: bool, repeats: int):
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
    out = {name: dict(spans=[]) for name in RUNS}
    for _ in range(repeats):  # the schedules in turn, so that a burst of load hits each alike
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
                result = run_pipeline(schedule, stages, x[rows], y[rows], group=mesh.pp_group,
                                      tied_group=tied)
            both = torch.nn.ModuleList(stages)  # under the V rank 0's two stages share the tied embedding
            moe_all_reduce_gradients(both, mesh.dp_group, mesh.edp_group)
            span = max(e.end for e in result.trace) - min(e.start for e in result.trace)
            out[name]["spans"].append(span)
            out[name].update(trace=result.trace if name.endswith("overlap") else None,
                             peak=result.peak_activation_bytes)
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


def run(m: int = 8, cost: float = 0.02, with_grads: bool = False, repeats: int = 2):
    """Every rank's results on 4 gloo ranks, each schedule run ``repeats`` times in turn: per
    schedule ``spans`` (seconds from the common start to the last action, one per repeat), and of
    the last repeat ``peak`` (`PipelineResult.peak_activation_bytes`), the overlapped run's
    ``trace``, and with ``with_grads`` every gradient after the dp / ep reduction, by the model's names."""
    from reference.runtime import launch

    return launch(_body, PP * DP, m, cost, with_grads, repeats, timeout=280, quiet=True)


def figures(results, m: int, cost: float) -> dict:
    """Per run: step time (the slowest rank's span, the least over the repeats: a busy machine only
    ever adds) and idle share 1 - charged compute / step."""
    charged = 2 * m * 6 * cost  # 2 chunks x m micro-batches x (attention 3 tau + experts 3 tau)
    out = {}
    for name in RUNS:
        step = min(max(spans) for spans in zip(*(r[name]["spans"] for r in results)))
        out[name] = dict(step=step, idle=1 - charged / step)
    return out


def one_process_grads(m: int) -> dict:
    """The oracle's gradients: the 2 m rows as 2 m chunks, by the model's names."""
    from reference.train.single import accumulate_gradients

    model = _model()
    x, y = _batch(m)
    accumulate_gradients(model, x, y, chunks=DP * m, loss_mean="mean_of_means")
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
            if p.grad is not None}
