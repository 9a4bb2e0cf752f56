"""Tied weights across the pipeline: the embedding and the lm_head kept equal on two ranks.

With ``tie_weights`` the token embedding ``wte`` (stage 0) and the ``lm_head`` (the
last stage) are one matrix. Split over two ranks each holds a copy, and each copy
gets only its half of the gradient. `build_embedding_group` makes the process
group of the first and last pipeline ranks (Megatron-LM's "embedding group") and
`sync_tied_grads` all-reduces the two halves there, so both copies take the same
optimizer step and stay equal. Alternatively build the model with
``tie_weights=False``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms

__all__ = ["build_embedding_group", "sync_tied_grads"]


def build_embedding_group(mesh) -> Optional[object]:
    """The group of the first and last rank of this rank's pipeline (None if not in one).

    Every rank must call it (``new_group`` is collective), after ``mesh.build_groups()``.
    With pp = 1 both ends live in one process and share the weight: returns None."""
    if mesh.pp == 1:
        return None
    mine = None
    for ranks in mesh.group_ranks("pp"):
        ends = [ranks[0], ranks[-1]]
        group = dist.new_group(ends)
        if mesh.rank in ends:
            mine = group
            comms.name_group(group, "embedding")
    return mine


def sync_tied_grads(stages: Union[nn.Module, Sequence[nn.Module]], group) -> int:
    """Sum the gradient of the tied embedding / lm_head over its two copies.

    ``stages``: this rank's `GPTStage` modules (or one). Call on every rank of the
    embedding group after the backward pass; the first and last stage each all-reduce
    their copy's gradient. Returns the number of tensors reduced here (0 where nothing
    is tied or shared)."""
    stages = [stages] if isinstance(stages, nn.Module) else list(stages)
    if group is None or not stages or not stages[0].tied:
        return 0
    mine = [s.wte.weight for s in stages if s.spec.embedding] \
        + [s.lm_head.weight for s in stages if s.spec.head]
    if len(mine) != 1 or not mine[0].requires_grad:  # both ends here (the same Parameter), or neither
        return 0
    p = mine[0]
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    comms.all_reduce(p.grad, group=group)
    return 1
