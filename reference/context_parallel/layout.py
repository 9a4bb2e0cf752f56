"""Which tokens each rank of the cp group holds: the contiguous and the zig-zag split.

The contiguous split gives rank r positions [r T/cp, (r+1) T/cp). Under a causal mask a query
at position p attends to p + 1 keys, so the last rank does about 2 cp - 1 times rank 0's work
(`cost.causal_pairs_per_rank`). The zig-zag split (Megatron-LM's context parallelism,
ring-flash-attention's ``zigzag_ring``) cuts the sequence into 2 cp chunks of c = T / (2 cp)
tokens and gives rank r chunks r and 2 cp - 1 - r, one early and one late, so every rank holds
the same number of (query, key) pairs::

    cp = 2, T = 8, chunks of 2:   | 0 1 | 2 3 | 4 5 | 6 7 |
                                   rank0  rank1 rank1 rank0
    rank 0 holds positions [0 1 6 7], rank 1 holds [2 3 4 5]

A rank's part is kept in increasing position order, so a causal mask inside it is the plain
lower triangle. T must divide by 2 cp for the zig-zag split (by cp for the contiguous one); there
is no padding (a padded token would have to be masked out of every attention and of the loss).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.comms.functional import all_gather_along

__all__ = ["check_sequence_split", "sequence_positions", "split_sequence", "gather_sequence",
           "gather_order", "zigzag_chunks"]


def _check_cp(cp, rank=None) -> None:
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp must be a positive int, got cp={cp!r}")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < cp):
        raise ValueError(f"rank={rank!r} is not a rank of a cp group of cp={cp} ranks")


def check_sequence_split(T: int, cp: int, zigzag: bool = True) -> int:
    """Tokens per rank, T // cp; refuses a T that the split cannot cut evenly."""
    _check_cp(cp)
    parts = 2 * cp if zigzag else cp
    if T % parts:
        how = (f"2*cp={parts} chunks (the zig-zag split gives each rank chunks r and 2*cp-1-r)"
               if zigzag else f"cp={cp} contiguous parts")
        raise ValueError(f"context parallelism cannot split a sequence of T={T} tokens over cp={cp} "
                         f"ranks: T must divide into {how}; T % {parts} = {T % parts}")
    return T // cp


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) that rank `rank` holds under the zig-zag split: (r, 2 cp - 1 - r)."""
    _check_cp(cp, rank)
    return rank, 2 * cp - 1 - rank


def sequence_positions(T: int, cp: int, rank: int, zigzag: bool = True) -> torch.Tensor:
    """Positions (T // cp,) of the tokens rank `rank` holds, in increasing order (int64)."""
    _check_cp(cp, rank)
    n = check_sequence_split(T, cp, zigzag)
    if not zigzag:
        return torch.arange(rank * n, (rank + 1) * n)
    c = T // (2 * cp)
    return torch.cat([torch.arange(chunk * c, (chunk + 1) * c) for chunk in zigzag_chunks(cp, rank)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, zigzag: bool = True, dim: int = 1) -> torch.Tensor:
    """This rank's part of `x` along `dim` (the sequence): (B, T, ...) -> (B, T // cp, ...), by
    indexing (no communication, differentiable)."""
    T = x.shape[dim]
    pos = sequence_positions(T, cp, rank, zigzag).to(x.device)
    return x.index_select(dim, pos)


def gather_order(T: int, cp: int, zigzag: bool = True) -> torch.Tensor:
    """(T,) the position of each row of ``cat([part of rank 0, part of rank 1, ...])``; its
    ``argsort`` puts the rows back in position order."""
    return torch.cat([sequence_positions(T, cp, r, zigzag) for r in range(cp)])


def gather_sequence(x: torch.Tensor, group, zigzag: bool = True, dim: int = 1) -> torch.Tensor:
    """Every rank's part, all-gathered (metered, no autograd) and put back in position order:
    (B, T // cp, ...) -> (B, T, ...)."""
    cp = dist.get_world_size(group)
    gathered = all_gather_along(x, dim, group)  # rank order: part 0, part 1, ...
    order = gather_order(gathered.shape[dim], cp, zigzag).to(x.device)
    return gathered.index_select(dim, torch.argsort(order))
