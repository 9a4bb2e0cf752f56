"""The step's loss: what one process's mean becomes when the batch is cut.

One process computes ``F.cross_entropy`` over the whole batch: the sum of the counted
tokens' losses divided by how many tokens count (targets equal to ``IGNORE_INDEX``, such as
padding or a masked prompt, count for nothing). A parallel step cuts the batch into
micro-batches and over dp x cp ranks, and each piece computes its loss on its own. How the
pieces' losses are put back together is one of two parts, chosen once per step:

* `TokenMean` (the default): each piece's *sum* over its counted tokens, divided by the
  step's count N of counted tokens in the whole global batch. Summed over the micro-batches
  and the ranks this is exactly one process's loss, however unevenly padding falls. N is
  computed once per step before any backward, from the global batch that every rank is
  handed (`reference.parallel.train_step` takes the global batch), so it costs no
  communication; a loader that handed each rank only its own rows would need one
  all-reduce of a scalar here instead. Knowing N before the backward, rather than folding
  it in afterwards, keeps the gradients right as they are made, which fp16's loss scaler
  and gradient clipping both read.
* `MeanOfMeans`: each micro-batch's *mean* over its own counted tokens, averaged over the
  micro-batches and (by the gradient average) over the dp x cp ranks. Equal to one process
  only when every piece counts as many tokens; kept to show what goes wrong otherwise.

The data-parallel gradient reduction averages over the dp x cp replicas (divides by
dp x cp), so a `TokenMean` piece multiplies its share by ``replicas = dp * cp``: after the
average the gradient is that of sum / N. Experts' auxiliary (balance) losses keep their own
normalisation in both: each micro-batch's balance loss over the tokens it routed (every
position, padding included: the router routes them all), averaged over the micro-batches
and the dp x cp replicas.

    mean = token_mean(targets, replicas=dp * cp)          # N counted in the global batch
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
    """The step's loss as one process has it. ``share`` is one piece's part: its sum over its
    counted tokens times ``replicas / count``; a piece with no counted token contributes 0,
    with a gradient of 0."""

    def __init__(self, count: int, replicas: int = 1):
        if count < 1:
            raise ValueError(f"the step counts no token (every target is {IGNORE_INDEX}): "
                             f"its mean over counted tokens is undefined")
        self.count, self.replicas = int(count), int(replicas)

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
    """The step's loss mean of ``kind`` ("tokens" or "mean_of_means") for the global
    ``targets`` cut into ``microbatches`` per rank over ``replicas`` = dp x cp ranks."""
    if kind == "tokens":
        return TokenMean(counted_tokens(targets), replicas)
    if kind == "mean_of_means":
        return MeanOfMeans(microbatches)
    raise ValueError(f"loss_mean must be one of {LOSS_MEANS}, got {kind!r}")
