"""The step's loss: what one process's mean becomes when the batch is cut.

One process computes ``F.cross_entropy`` over the whole batch: the sum of the counted tokens'
losses over how many count (a target equal to ``IGNORE_INDEX``, padding or a masked prompt,
counts for nothing). A parallel step cuts the batch into micro-batches and over dp x cp ranks;
each piece computes its loss on its own, and the pieces combine in one of two ways:

* `TokenMean` (the default): each piece's *sum* over its counted tokens, divided by the count N
  of the whole global batch. Summed over micro-batches and ranks this is exactly one process's
  loss, however unevenly padding falls. Every rank is handed the global batch
  (`reference.parallel.train_step`), so N costs no communication (a loader handing each rank
  its own rows would need one all-reduce of a scalar). N is known before the backward, so the
  gradients are right as they are made, which fp16's loss scaler and gradient clipping read.
  The gradient reduction averages over the dp x cp replicas, so a share is multiplied by
  ``replicas = dp * cp``.
* `MeanOfMeans`: each micro-batch's *mean* over its own counted tokens, averaged over the
  micro-batches and (by the gradient average) the ranks. Equal to one process only when every
  piece counts as many tokens; kept to show what goes wrong otherwise.

Experts' balance losses keep their own normalisation in both: each micro-batch's over the
tokens it routed (padding included: the router routes every position), averaged like a mean.

    mean = step_mean("tokens", targets, microbatches, replicas=dp * cp)   # N of the global batch
    share = mean.share(loss_fn, logits, targets_of_one_micro_batch)
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["IGNORE_INDEX", "LOSS_MEANS", "TokenMean", "MeanOfMeans", "counted_tokens", "step_mean"]

IGNORE_INDEX = -100  # F.cross_entropy's default: a target that counts for nothing
LOSS_MEANS = ("tokens", "mean_of_means")


def counted_tokens(targets: torch.Tensor) -> int:
    """How many targets count (are not `IGNORE_INDEX`)."""
    return int((targets != IGNORE_INDEX).sum())


class TokenMean:
    """The step's loss as one process has it: a piece's ``share`` is its sum over its counted tokens
    times ``replicas / count`` (0, with a gradient of 0, when it counts none)."""

    def __init__(self, count: int, replicas: int = 1):
        if count < 1:
            raise ValueError(f"the step counts no token (every target is {IGNORE_INDEX}): "
                             f"its mean over counted tokens is undefined")
        self.count, self.replicas = int(count), int(replicas)

    @classmethod
    def of(cls, targets, replicas: int = 1):
        """The token mean of the step's ``targets`` (B, T); None without them (a pipeline rank
        that does not hold the last stage computes no loss)."""
        return None if targets is None else cls(counted_tokens(targets), replicas)

    def share(self, loss_fn: Callable, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets, reduction="sum") * (self.replicas / self.count)

    def __repr__(self) -> str:
        return f"TokenMean(count={self.count}, replicas={self.replicas})"


class MeanOfMeans:
    """The mean of the pieces' means: each micro-batch's mean over its own counted tokens,
    divided by the step's ``microbatches`` (and by the gradient average over dp x cp)."""

    def __init__(self, microbatches: int):
        self.microbatches = int(microbatches)

    def share(self, loss_fn: Callable, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets) / self.microbatches

    def __repr__(self) -> str:
        return f"MeanOfMeans(microbatches={self.microbatches})"


def step_mean(kind: str, targets: torch.Tensor, microbatches: int, replicas: int):
    """The step's mean of ``kind`` (`LOSS_MEANS`) for the global ``targets`` cut into
    ``microbatches`` per rank over ``replicas`` = dp x cp ranks."""
    if kind == "tokens":
        return TokenMean(counted_tokens(targets), replicas)
    if kind == "mean_of_means":
        return MeanOfMeans(microbatches)
    raise ValueError(f"loss_mean must be one of {LOSS_MEANS}, got {kind!r}")
