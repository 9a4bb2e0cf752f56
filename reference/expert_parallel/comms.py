"""The all-to-all of expert parallelism: the counts it exchanges first, and the bytes it moves.

The E experts are split over the P ranks of the ``ep`` group, E / P consecutive experts each.
A rank routes its tokens locally, then:

1. ``exchange_counts``: every rank tells every other how many rows it will send to each of its
   experts (an all-to-all of E integers), so receivers can size buffers for uneven splits;
2. dispatch: ``all_to_all(rows, recv_splits, send_splits)`` sends the rows, sorted by expert,
   to their experts' ranks (`reference.comms.functional.all_to_all`, metered);
3. the experts run on what arrived;
4. combine: the same all-to-all with the splits swapped returns each result to its token's rank.

An all-to-all permutes rows, so its backward is the all-to-all with the splits swapped:
dispatch's backward is a combine and vice versa. Bytes one rank sends per MoE layer and
training step, C the model width, b bytes per element, ``out`` / ``in`` the rows it sends to /
receives from other ranks (after capacity; rows it keeps are free)::

    forward:   counts (P - 1) * E / P * 8  +  dispatch out * C * b  +  combine in * C * b
    backward:  combine's backward out * C * b  +  dispatch's backward in * C * b

    total = 2 * (out + in) * C * b  +  (P - 1) * (E / P) * 8

Over the P ranks out and in count the same rows: the group moves 4 * (rows crossing ranks) * C * b.
With uniform routing and no drop a rank of S tokens sends k * S * (P - 1) / P rows to the others.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference import comms

__all__ = ["exchange_counts", "all_to_all_bytes_per_step"]


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """(E,) rows this rank sends per expert -> (P, E // P): [s, l] the rows group rank s sends to
    this rank's l-th expert. Integers only, no gradient."""
    P = dist.get_world_size(group)
    received = torch.empty_like(counts)  # (E,) = P blocks of E // P
    # Equal splits: the E // P counts of the experts held by rank d go to rank d.
    comms.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(P, counts.numel() // P)


def all_to_all_bytes_per_step(rows_out: int, rows_in: int, d_model: int, element_size: int,
                              n_experts: int, ep: int, count_size: int = 8) -> int:
    """Bytes one rank sends in one MoE layer's forward and backward (formula above); `rows_out` /
    `rows_in`: kept rows it dispatches to / receives from other ranks."""
    return 2 * (rows_out + rows_in) * d_model * element_size + (ep - 1) * (n_experts // ep) * count_size
