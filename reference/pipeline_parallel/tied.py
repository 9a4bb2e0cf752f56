"""Tied weights across the pipeline: the embedding and the lm_head kept equal on two ranks.

With ``tie_weights`` the token embedding ``wte`` (stage 0) and the ``lm_head`` (the last stage)
are one matrix; split over two ranks, each copy gets only its half of the gradient.
`build_embedding_group` makes the group of the first and last pipeline ranks (Megatron-LM's
"embedding group") and `sync_tied_grads` all-reduces the two halves there.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms

__all__ = ["build_embedding_group", "sync_tied_grads"]


def build_embedding_group(mesh) -> Optional[object]:
    """The group of the first and last rank of this rank's pipeline (None if not in one, or pp = 1).
    Every rank calls it (``new_group`` is collective), after ``mesh.build_groups()``."""
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
    """Sum the gradient of the tied embedding / lm_head over its two copies, after the backward, on
    every rank of the group; ``stages``: this rank's `GPTStage` (or one). Returns the tensors reduced."""
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
