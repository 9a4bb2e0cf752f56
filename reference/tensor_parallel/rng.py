"""Dropout under tensor parallelism: which ranks must draw the same mask.

* **replicas** (the residual stream after g, the embeddings without SP): every rank must drop
  the *same* elements, or the copies silently train different models. They draw from the
  default generator, which the training loop seeds alike on every rank.
* **shards** (attention heads inside a TP region; under SP each rank's tokens): each rank must
  draw a *different* mask, or head h on rank 1 is dropped exactly where head h on rank 0 is
  (token t + T/tp where token t is), a correlation the dense model never has.

Megatron-LM keeps a second generator state for the shards, seeded ``seed + 2718 + tp_rank``,
and swaps it in around sharded dropout (`TensorParallelRNG.fork()`): the default stream stays
where it was, so the replicated draws stay in step whatever the shards drew.

Activation checkpointing recomputes a forward in backward, which must drop the elements the
first forward dropped; `RNGStates` captures every stream a module's forward draws from so the
recomputation can replay them.
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
    """The default CPU generator, the GPU's, and every `TensorParallelRNG` on `module`'s layers.

    ``RNGStates.capture(module, device)`` before the first forward, ``states.restore()`` before
    running it again; a second capture taken just before lets the streams go on afterwards as if
    the recomputation had drawn nothing."""

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
