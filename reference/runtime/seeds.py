"""Each rank's random state: its own, and reproducible on request.

The ranks of a launch are all forked from one fork server and inherit its generators' states:
without reseeding every rank would draw the same `torch.rand` numbers, in every launch. So every
rank reseeds torch's CPU generator and (lazily) every GPU's, Python's `random` and numpy's global
state before running the function: from fresh entropy with ``launch(fn, n)``, like a fresh
process; with ``rank_seed(s, r)`` under ``launch(fn, n, seed=s)``, the same numbers in every
launch with that seed. Code that needs the *same* numbers on several ranks (the replicas of a
model, a shared batch) seeds a generator of its own with the same value on those ranks.
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
    """The seed of rank `rank` in a launch with `seed`: the low 63 bits of SHA-256 of ``"{seed}:{rank}"``
    (a hash rather than ``seed + rank``, so that launches with seeds 1 and 2 share no rank's stream)."""
    digest = hashlib.sha256(f"{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << _SEED_BITS) - 1)


def seed_rank(seed: int | None, rank: int) -> int:
    """Seed this process's default generators from `rank_seed(seed, rank)`, or os.urandom with
    ``seed=None``; returns the value used (`torch.initial_seed()` tells it too)."""
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
