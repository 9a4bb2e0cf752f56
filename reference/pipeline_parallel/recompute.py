"""Activation checkpointing in the pipeline: F keeps only its input, B runs the forward again.

One more forward per micro-batch, for stored bytes that fall from the whole stage's activations
to its input. The forward run again must draw the same dropout masks as the one whose output was
sent on, so F captures every random stream the stage draws from (`RNGStates`: the default
generators and tensor parallelism's per-rank stream) and B restores it.
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
