"""Mixture of experts under Megatron sequence parallelism: gather the sequence, route it whole.

Under sequence parallelism (SP) the residual stream between tensor-parallel regions holds
this tp rank's T / tp tokens of each sequence, so the MoE layer's input is ``(B, T/tp, C)``.
Two ways to route it:

* **route the shard** (Megatron-Core's choice): each tp rank routes its own T / tp tokens,
  the token dispatcher moves them to the experts (an all-gather over tp x ep, or
  all-to-alls), and the load-balancing statistics are all-reduced over tp so the aux loss
  covers the whole sequence. No redundant compute, but capacity is then counted per shard:
  ``ceil(cf * (T/tp) * k / E)`` slots for the T/tp tokens of one rank, and which
  assignments are dropped depends on tp; the run no longer equals one process whenever
  capacity drops anything (Megatron accepts that: its capacity is per rank's tokens);
* **gather the sequence** (what this module does): all-gather the T / tp shards over tp
  before the layer, route the whole sequence on every tp rank exactly as without SP (the
  same tokens, the same capacity per sequence, the same drops as one process), then keep
  this rank's T / tp rows of the output. Routing, capacity and the aux loss are one
  process's, at every tp.

We gather, because this course's contract is "equal to one process" and a router here
counts capacity per sequence (`reference.expert_parallel.router`). The price, per MoE
layer, micro-batch and rank, with b bytes per element: forward one all-gather of the
activations, backward one reduce-scatter of their gradient, each moving
``(tp - 1) / tp * B * T * C * b`` bytes, half of what a dense SP MLP pays (its
all-gather and reduce-scatter forward, the same two backward); against routing the shard,
which needs only the tp all-reduce of E statistics (plus its dispatch). And the experts
run on the whole sequence on every tp rank, as they do without SP (TP never splits an
expert here): tp-fold redundant expert compute, where Megatron's shard routing computes
each token once.

Gradients. Rank r's output rows are only its own tokens, so the gradient reaching every
MoE parameter (router, experts, shared expert) on rank r covers its tokens only: those
parameters are marked ``sequence_parallel`` like the SP LayerNorms, and
`allreduce_sequence_parallel_grads` sums them over tp. The aux loss (balance and z-loss)
is computed on the whole sequence, identically on every tp rank, and each rank backwards
it: its gradient is scaled by 1 / tp (the value is left as it is), so that the sum over tp
counts it once, through the parameters as through the reduce-scatter of the gathered input.

In eval mode `SequenceParallelScatter` may pad T up to a multiple of tp; the padded
positions are then routed too (they sit after the real tokens, so causal attention never
sees them, but with a finite capacity they can take slots): generation with a capacity
limit may differ from one process's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

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


def _is_moe(module: nn.Module) -> bool:
    from reference.expert_parallel.moe import MoELayer

    return isinstance(module, MoELayer)


def sequence_parallel_experts(model: nn.Module, group) -> int:
    """Make every MoE layer of `model` take and return this tp rank's sequence shard.

    In place, by hooks (parameter names stay the model's own). Call it after
    `shard_experts` (the `ExpertParallelMoE` layers it builds are new modules), as
    `reference.parallel.parallelize` does; a layer already handled is skipped. Returns the
    number of layers handled now; a no-op when the group has one rank.
    """
    tp = dist.get_world_size(group)
    if tp == 1:
        return 0
    rank = dist.get_rank(group)
    done = 0
    for module in model.modules():
        if not _is_moe(module) or getattr(module, "sequence_parallel_group", None) is not None:
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
