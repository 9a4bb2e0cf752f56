"""Mixture of experts under Megatron sequence parallelism: gather the sequence, route it whole.

Under sequence parallelism (SP) the MoE layer's input is this tp rank's (B, T/tp, C) shard.
Two ways to route it:

* **route the shard** (Megatron-Core's choice): each tp rank routes its T/tp tokens and the
  load statistics are all-reduced over tp. No redundant compute, but capacity counts per shard
  (``ceil(cf * (T/tp) * k / E)`` slots), so the drops depend on tp and the run differs from one
  process whenever capacity drops anything;
* **gather the sequence** (this module): all-gather the shards over tp before the layer, route
  the whole sequence on every tp rank as one process does, keep this rank's T/tp output rows.

We gather, because the course's contract is "equal to one process" and the router counts
capacity per sequence (`router`). The price per MoE layer, micro-batch and rank: one all-gather
forward and one reduce-scatter backward of ``(tp - 1) / tp * B * T * C * b`` bytes each (half
what a dense SP MLP pays), and tp-fold redundant expert compute.

Gradients: rank r's output rows are its own tokens only, so every MoE parameter (router,
experts, shared expert) is marked ``sequence_parallel`` and `allreduce_sequence_parallel_grads`
sums it over tp. The aux loss is computed on the whole sequence, the same on every tp rank; its
gradient is scaled by 1 / tp, so the sum over tp counts it once.

In eval mode `SequenceParallelScatter` may pad T to a multiple of tp; the padded positions are
routed too and, with a finite capacity, can take slots: generation may differ from one process's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from reference.expert_parallel.moe import MoELayer
from reference.tensor_parallel.comms import SEQ_DIM, gather_from_sequence_parallel_region

__all__ = ["sequence_parallel_experts"]


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def sequence_parallel_experts(model: nn.Module, group) -> int:
    """Make every MoE layer of `model` take and return this tp rank's sequence shard, in place, by
    hooks; returns the number of layers handled now (one already handled is skipped). Call it
    after `shard_experts`, whose layers are new modules, as `reference.parallel.parallelize` does."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return 0
    rank = dist.get_rank(group)
    done = 0
    for module in model.modules():
        if not isinstance(module, MoELayer) or getattr(module, "sequence_parallel_group", None) is not None:
            continue
        module.sequence_parallel_group = group
        for p in module.parameters():
            p.sequence_parallel = True  # found by allreduce_sequence_parallel_grads

        def gather(mod, args):  # (B, T/tp, C) -> (B, T, C), the same on every tp rank
            return (gather_from_sequence_parallel_region(args[0], group, SEQ_DIM),) + args[1:]

        def keep_rows(mod, args, output):  # (B, T, C) -> this rank's (B, T/tp, C)
            y, aux = output
            n = y.shape[SEQ_DIM] // tp
            return y.narrow(SEQ_DIM, rank * n, n), _ScaleGrad.apply(aux, 1.0 / tp)

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(keep_rows)
        done += 1
    return done
