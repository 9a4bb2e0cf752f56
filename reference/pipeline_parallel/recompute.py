"""Activation checkpointing in the pipeline: F keeps only its input, B runs the forward again.

A checkpointed F runs the stage without building the autograd graph, so nothing
but the stage's input is stored until its B. B runs the forward again, this time
with the graph, and backpropagates through it: one more forward per micro-batch,
for stored bytes that fall from the whole stage's activations to its input.

The forward run again must be the forward that was sent on, so it draws the same
dropout masks: F captures the random state and B restores it. "The random state"
is every stream the stage draws from: the default generator (and the GPU's), and
under tensor parallelism the per-rank stream of sharded regions
(`reference.tensor_parallel.rng.RNGStates`). A recomputation with other masks
would differentiate another network than the one whose output was sent on. After
it, the streams go on as if nothing had been drawn again.
"""
from __future__ import annotations

from typing import Callable

import torch

from reference.tensor_parallel.rng import RNGStates

__all__ = ["forward_without_graph", "recompute"]


def forward_without_graph(stage: torch.nn.Module, device: torch.device, forward: Callable):
    """Run ``forward()`` without autograd: (the random state it started from, its result)."""
    rng = RNGStates.capture(stage, device)  # every stream the forward draws from
    with torch.no_grad():
        return rng, forward()


def recompute(stage: torch.nn.Module, device: torch.device, rng: RNGStates, forward: Callable):
    """Run ``forward()`` again, with autograd, from the random state ``rng`` its first run saw."""
    now = RNGStates.capture(stage, device)
    rng.restore()  # the same dropout masks as the forward that was sent on
    try:
        return forward()
    finally:
        now.restore()  # the streams go on as if nothing had been drawn again
