"""Dropout under tensor parallelism: which ranks must draw the same mask.

A dropout mask is drawn from the random generator of the rank's device. What it
must look like across the ranks of a TP group depends on what they hold:

* **replicas** (the residual stream after g's all-reduce, the embeddings without
  sequence parallelism): every rank must drop the *same* elements, or the copies
  stop being copies and the ranks silently train different models. They draw
  from the default generator, which the training loop seeds with the same seed on
  every rank.
* **shards** (attention heads inside a TP region; with sequence parallelism, each
  rank's slice of the tokens): each rank must draw a *different*, independent
  mask. With the same seed, head h on rank 1 would be dropped exactly where head
  h on rank 0 is, and token t + T/tp exactly where token t is: the dense model
  never correlates them.

Megatron-LM keeps a second generator state for the shards, seeded with
``seed + 2718 + tp_rank``, and swaps it in around sharded dropout. The default
stream is left exactly where it was, so the replicated draws of all ranks stay
in step whatever the shards drew. `TensorParallelRNG.fork()` is that swap.

Activation checkpointing runs a forward a second time in backward, and that
recomputation must drop exactly the elements the first forward dropped, or the
gradient belongs to another network than the output sent on. `RNGStates`
captures every stream a module's forward draws from (the default CPU
generator, the GPU's when the module runs on one, and the state of every
`TensorParallelRNG` its layers hold) so the recomputation can replay them.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TensorParallelRNG", "ShardedDropout", "RNGStates", "TP_SEED_OFFSET"]

TP_SEED_OFFSET = 2718  # Megatron-LM's offset between the default and the TP seed


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TensorParallelRNG:
    """The random stream of sharded regions, seeded ``seed + 2718 + tp_rank``: ``with
    rng.fork(): ...`` draws from it inside the block, the default generator untouched."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seed = seed + TP_SEED_OFFSET + tp_rank
        self._state = _get_state(self.device)
        with self.fork():  # seeded in place of the default generator, which fork() gives back
            (torch.cuda.manual_seed if self.device.type == "cuda" else torch.manual_seed)(self.seed)

    @contextmanager
    def fork(self):
        saved = _get_state(self.device)
        _set_state(self.device, self._state)
        try:
            yield
        finally:
            self._state = _get_state(self.device)
            _set_state(self.device, saved)

    def get_state(self) -> torch.Tensor:
        """Where this stream stands (a copy): the next `fork()` draws from here."""
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()

    def __repr__(self) -> str:
        return f"TensorParallelRNG(seed={self.seed}, device={self.device})"


class RNGStates:
    """The state of every generator a forward of `module` draws from, to replay it.

    ``RNGStates.capture(module, device)`` before the first forward;
    ``states.restore()`` before running it again (activation checkpointing),
    and a second capture taken just before lets the streams go on afterwards as
    if the recomputation had drawn nothing. The `TensorParallelRNG` streams are
    found as attributes of the module's layers (`ShardedDropout`, the parallel
    attention).
    """

    def __init__(self, cpu: torch.Tensor, gpu: tuple | None, trackers: list):
        self.cpu, self.gpu, self.trackers = cpu, gpu, trackers

    @classmethod
    def capture(cls, module: nn.Module, device: torch.device | str = "cpu") -> "RNGStates":
        device = torch.device(device)
        gpu = (device, torch.cuda.get_rng_state(device)) if device.type == "cuda" else None
        found = {id(v): v for m in module.modules() for v in vars(m).values()
                 if isinstance(v, TensorParallelRNG)}
        return cls(torch.get_rng_state(), gpu, [(t, t.get_state()) for t in found.values()])

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.gpu is not None:
            torch.cuda.set_rng_state(self.gpu[1], self.gpu[0])
        for tracker, state in self.trackers:
            tracker.set_state(state)


class ShardedDropout(nn.Dropout):
    """Dropout on a tensor whose ranks hold different shards: draws from `rng.fork()`."""

    def __init__(self, p: float, rng: TensorParallelRNG):
        super().__init__(p)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng.fork():
            return F.dropout(x, self.p, training=True)
