"""What the executor does for an F and a B: one micro-batch through one chunk's stage.

F runs the chunk's stage on the micro-batch's input (token ids on the first stage, the received
activation elsewhere), keeps what B needs and posts the output; on the last stage it computes
the micro-batch's share of the step's loss (`reference.loss`) with the stage's own ``loss``, so
the gradients add up to those of the whole batch's loss. B runs backward from the received
output gradient (or the loss) and posts the input's gradient. A checkpointed chunk keeps only
its input (`reference.pipeline_parallel.recompute`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from reference.model import lm_loss
from reference.pipeline_parallel.actions import Action
from reference.pipeline_parallel.messages import Mailbox
from reference.pipeline_parallel.recompute import forward_without_graph, recompute
from reference.pipeline_parallel.schedules import Schedule
from reference.tensor_parallel.rng import RNGStates

__all__ = ["RankState", "Kept", "forward", "backward", "backward_roots"]


@dataclass
class RankState:
    """One rank's run of a schedule: its stages by chunk, micro-batches, messages and stored activations."""

    schedule: Schedule
    stages: Sequence[torch.nn.Module]
    rank: int
    device: torch.device
    inputs: Optional[list]   # micro-batches of token ids (B / m, T), on the first stage
    targets: Optional[list]  # (B / m, T), on the last stage
    checkpoint: list         # one flag per chunk
    loss_mean: object        # each micro-batch's share of the step's loss (reference.loss)
    loss_scale: float        # backward starts from (share + aux / m) * loss_scale
    loss_fn: Optional[Callable]
    mail: Mailbox
    kept: dict = field(default_factory=dict)    # (mb, chunk) -> what its F keeps (`Kept`), until its B
    losses: list = field(default_factory=list)  # each micro-batch's share of the step's loss

    def ends(self, chunk: int) -> tuple[bool, bool]:
        """Whether the chunk's model stage is the first, and the last, of the pipeline."""
        return self.schedule.ends(self.schedule.stage(self.rank, chunk))


@dataclass
class Kept:
    """What one F keeps for its B: the stage's input, and either the output, aux loss and
    scaled loss (their autograd graph kept) or the random state to run it again (checkpointed)."""

    x: torch.Tensor
    out: Optional[torch.Tensor] = None
    aux: Optional[torch.Tensor] = None
    total: Optional[torch.Tensor] = None
    rng: Optional[RNGStates] = None
    weights: Optional[object] = None  # what a split backward's W needs, recorded by F (split_backward.WeightStore)


def _run_stage(state: RankState, a: Action, x: torch.Tensor):
    """Forward one micro-batch: (out, aux, scaled loss or None, its share of the step's loss or None)."""
    out = state.stages[a.chunk](x)
    out, aux = out if isinstance(out, tuple) else (out, None)
    if not state.ends(a.chunk)[1]:
        return out, aux, None, None
    share = state.loss_mean.share(state.loss_fn or getattr(state.stages[a.chunk], "loss", None) or lm_loss,
                                  out, state.targets[a.mb])
    aux_share = 0 if aux is None else aux / state.schedule.m  # the balance loss: each micro-batch's own
    return out, aux, (share + aux_share) * state.loss_scale, share


def forward(state: RankState, a: Action) -> None:
    """F: micro-batch ``a.mb`` through chunk ``a.chunk``; keep what its B needs, post the output."""
    first, last = state.ends(a.chunk)
    # (B / m, T) token ids on the first stage, else (B / m, T, C), or (B / m, T / tp, C) under SP
    x = state.inputs[a.mb] if first else state.mail.take("F", a.mb, a.chunk).requires_grad_()
    kept = state.kept[(a.mb, a.chunk)] = Kept(x)
    if state.checkpoint[a.chunk]:
        kept.rng, (out, _, _, loss) = forward_without_graph(state.stages[a.chunk], state.device,
                                                            lambda: _run_stage(state, a, x))
    else:
        out, kept.aux, kept.total, loss = _run_stage(state, a, x)
        kept.out = None if last else out  # backward starts from it; the last stage's from the loss
    if loss is not None:
        state.losses.append(loss.detach())
    if not last:
        state.mail.post("F", a.mb, a.chunk, out.detach())


def backward_roots(state: RankState, a: Action) -> tuple[Kept, list]:
    """What the backward of micro-batch ``a.mb`` on chunk ``a.chunk`` starts from: (what its F
    kept, [(tensor, its gradient; None for the loss)])."""
    kept = state.kept[(a.mb, a.chunk)]
    if kept.rng is not None:  # checkpointed: run the forward again, as F ran it
        out, aux, total, _ = recompute(state.stages[a.chunk], state.device, kept.rng,
                                       lambda: _run_stage(state, a, kept.x))
    else:
        out, aux, total = kept.out, kept.aux, kept.total
    if state.ends(a.chunk)[1]:
        roots = [(total, None)]  # backward starts from the scaled loss
    else:
        roots = [(out, state.mail.take("B", a.mb, a.chunk))]  # from the output's received gradient
        if aux is not None:  # and the stage's share of the aux loss
            roots.append((aux, torch.full_like(aux, state.loss_scale / state.schedule.m)))
    return kept, [(t, g) for t, g in roots if t.requires_grad]


def backward(state: RankState, a: Action) -> None:
    """B: backward of micro-batch ``a.mb`` through chunk ``a.chunk``; post the input's gradient."""
    kept, roots = backward_roots(state, a)
    if roots:
        torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
    if not state.ends(a.chunk)[0]:
        state.mail.post("B", a.mb, a.chunk, kept.x.grad if kept.x.grad is not None else torch.zeros_like(kept.x))
    del state.kept[(a.mb, a.chunk)]  # what its F kept is freed
