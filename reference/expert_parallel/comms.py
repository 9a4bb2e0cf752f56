"""The all-to-all of expert parallelism: the counts it exchanges first, and the bytes it moves.

With expert parallelism the E experts are split over the P ranks of the ``ep``
group, E / P consecutive experts each (rank r holds experts r*E/P ... ). A
rank's tokens are routed locally, then travel to the ranks holding their
experts and come back:

1. ``exchange_counts``: every rank tells every other how many rows it will send
   for each of the receiver's experts (an all-to-all of E integers), so that
   receivers can size their buffers: the splits are uneven and data-dependent.
2. dispatch: ``all_to_all(rows, recv_splits, send_splits)`` sends the rows, sorted by
   expert, to their experts' ranks (`reference.comms.functional.all_to_all`, which
   Ulysses shares);
3. the experts run on what arrived.
4. combine: ``all_to_all(out, send_splits, recv_splits)``, the same exchange
   with the splits swapped, returns each result to its token's rank.

An all-to-all is a permutation of rows between ranks, so its gradient is the
inverse permutation: the backward of `all_to_all` is an all-to-all with the
splits swapped. Dispatch's backward is therefore a combine and vice versa.

Every call goes through `reference.comms`, so ``comms.meter()`` counts it.

Bytes sent per MoE layer and training step by one rank (the rows it keeps for
itself are free), with C the model width, b the bytes of an element, ``out``
the rows this rank sends to other ranks and ``in`` the rows it receives from
them (both after capacity)::

    forward:   counts (P - 1) * E / P * 8  +  dispatch out * C * b  +  combine in * C * b
    backward:  combine's backward out * C * b  +  dispatch's backward in * C * b

    total = 2 * (out + in) * C * b  +  (P - 1) * (E / P) * 8

Summed over the P ranks, out and in count the same rows, so the group moves
4 * (rows crossing ranks) * C * b. With uniform routing and no drop, a rank
of S tokens sends k * S * (P - 1) / P rows to the others.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference import comms

__all__ = ["exchange_counts", "all_to_all_bytes_per_step"]


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """(E,) rows this rank sends per expert -> (P, E // P) rows it receives, per source and local expert.

    Entry [s, l] is how many rows group rank s sends to this rank's l-th expert.
    Integers only, no gradient.
    """
    P = dist.get_world_size(group)
    received = torch.empty_like(counts)  # (E,) = P blocks of E // P
    # Equal splits: the E // P counts of the experts held by rank d go to rank d.
    comms.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(P, counts.numel() // P)


def all_to_all_bytes_per_step(rows_out: int, rows_in: int, d_model: int, element_size: int,
                              n_experts: int, ep: int, count_size: int = 8) -> int:
    """Bytes one rank sends in one MoE layer's forward and backward (formula above).

    `rows_out`: rows it dispatches to other ranks; `rows_in`: rows other ranks
    dispatch to it (kept assignments only).
    """
    return 2 * (rows_out + rows_in) * d_model * element_size + (ep - 1) * (n_experts // ep) * count_size
