"""Balancing experts without an auxiliary loss: a bias on the router's choice, moved after each step.

Loss-free balancing (Wang et al. 2024; DeepSeek-V3, Liu et al. 2024, section 2.1.2) adds a bias
b_i per expert to the router's scores only to choose the top-k (`Router` with ``bias_update_rate``
u > 0): the combine weights stay the chosen experts' own scores, no term is added to the loss
and the bias gets no gradient. It does change which experts a token goes to, and so the
output, the loss and the gradients. After each step every expert's load c_i, its assignments
over the *whole step*, moves its bias against the load (Megatron-Core's
`get_updated_expert_bias`; torchtitan also subtracts the update's mean):

    b_i <- b_i + u * sign(mean(c) - c_i)

An overloaded expert is chosen a little less next step, an idle one a little more. The bias
moves by u a step in the scores' units: DeepSeek-V3's u = 0.001 is for its sigmoid scores (each
in (0, 1)) over some hundred thousand steps; a softmax's probabilities are about 1/E each.

"The whole step" is every micro-batch's counts on the rank (the router counts each forward run
with autograd: a recomputed chunk counts once), summed over the dp group by one all-reduce of
an (L, E) tensor per step. Tensor-parallel ranks route the same tokens and pipeline stages hold
other layers: neither is summed over; but under DualPipe a layer's second copy, on another
pipeline rank, routes the other direction's micro-batches, and its loads are added (``copies``). Each router is replicated over dp, ep included. The update
runs as an optimizer step pre-hook (as torchtitan does; `ParallelGPT.make_optimizer` registers
it), so a step skipped for an fp16 overflow carries its counts into the next, as in the oracle
(`Router.move_bias`, the rule's one place).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms
from reference.expert_parallel.router import Router

__all__ = ["biased_routers", "update_expert_bias", "register_bias_update"]


def biased_routers(model: nn.Module) -> list[Router]:
    """The routers of ``model`` that balance by a bias, in module order."""
    return [m for m in model.modules() if isinstance(m, Router) and m.expert_bias is not None]


@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None, copies=None) -> Optional[torch.Tensor]:
    """Move every biased router's bias by u * sign(mean load - load) and zero its counts.

    The loads are the step's counts summed over ``group`` (the data-parallel ranks; None:
    this process alone) and, with ``copies`` = (pipeline group, peer), with the peer's: under
    DualPipe the peer holds a second copy of the same layers, in the same order, that routed
    the other direction's micro-batches. Returns the (L, E) loads used (None without biased routers)."""
    routers = biased_routers(model)
    if not routers:
        return None
    loads = torch.stack([r.step_tokens_per_expert for r in routers])  # (L, E) int64
    if group is not None and dist.get_world_size(group) > 1:
        comms.all_reduce(loads, group=group)  # the step's counts over every dp rank, once
    if copies is not None:  # + the other copy's (a + b = b + a: both copies move alike)
        pp_group, peer = copies
        comms.sum_with_peer(loads, peer, pp_group)
    for r, load in zip(routers, loads):
        r.move_bias(load)
    return loads


def register_bias_update(optimizer: torch.optim.Optimizer, model: nn.Module, group=None, copies=None):
    """Run `update_expert_bias(model, group, copies)` before every ``optimizer.step()``; returns the
    hook's handle, or None when ``model`` has no biased router (nothing is hooked)."""
    if not biased_routers(model):
        return None

    def hook(*_):
        update_expert_bias(model, group, copies)  # (a pre-hook returns None: the step's arguments stay)
    return optimizer.register_step_pre_hook(hook)
