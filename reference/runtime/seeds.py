"""Each rank's random state: its own, and reproducible on request.

A process forked from another inherits its generators' states. The ranks of a
launch are all forked from one fork server, so without reseeding every rank
would draw the same `torch.rand` numbers, in every launch, as long as the server
lives: "random" per-rank batches would all be one batch, and a model built in
each rank without a seed would be the same model everywhere by accident. So
every rank reseeds its default generators before running the function:

* torch's CPU generator and (lazily, without initialising CUDA) every GPU's;
* Python's `random` and numpy's global state (`np.random.rand` and friends).

``launch(fn, n)`` seeds them from fresh operating-system entropy: different
on every rank and in every launch, like a fresh process.
``launch(fn, n, seed=s)`` seeds rank r with ``rank_seed(s, r)``: the same
numbers in every launch with that seed, different on every rank. Code that
needs the *same* numbers on several ranks (the replicas of a model, a shared
batch) seeds a generator of its own with the same value on those ranks.
"""
from __future__ import annotations

import hashlib
import os
import random
import sys

import torch

__all__ = ["rank_seed", "seed_rank", "check_seed"]

_SEED_BITS = 63  # torch.manual_seed takes up to 64 bits; 63 stays clear of sign questions


def check_seed(seed) -> None:
    """`seed` must be None or a non-negative int (bools are refused: `seed=True` is a slip)."""
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"seed must be None or a non-negative int, got {seed!r}")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank` in a launch with `seed`: a hash of both.

    The first 8 bytes of SHA-256 of the text ``"{seed}:{rank}"``, read big-endian,
    keeping the low 63 bits. A hash rather than ``seed + rank``: launches with
    seeds 1 and 2 then share no rank's stream."""
    digest = hashlib.sha256(f"{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << _SEED_BITS) - 1)


def seed_rank(seed: int | None, rank: int) -> int:
    """Seed this process's default generators (the module's list) for rank `rank` from
    `rank_seed(seed, rank)`, or os.urandom with ``seed=None``; returns the value used, which
    `torch.initial_seed()` also tells."""
    value = (int.from_bytes(os.urandom(8), "big") & ((1 << _SEED_BITS) - 1) if seed is None
             else rank_seed(seed, rank))
    torch.manual_seed(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is None and seed is not None:
        try:  # reproducible also for a function that imports numpy later
            import numpy
        except ImportError:
            numpy = None
    if numpy is not None:
        # The legacy global state takes 32-bit words: the value as two of them.
        numpy.random.seed([value & 0xFFFFFFFF, value >> 32])
    return value
