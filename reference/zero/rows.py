"""ZeRO-3 per parameter: each tensor cut along dim 0, the layout a `reference.zero.units.Unit`
takes when a tensor-parallel slice must be sharded again (FSDP2's `Shard(0)`).

    p (d0, *rest)   c = ceil(d0 / N) rows per rank, dim 0 padded with zero rows to N c
    rank r holds rows [r c, (r + 1) c) of the padded tensor:   shard (c, *rest)

The shards are packed (S,), all-gathered to (N, S) and each tensor's N row blocks copied out
(FSDP2's copy-in / copy-out); gradients go the other way. Padding rows stay zero, so an
element-wise optimizer leaves them zero. Where a tensor was cut is recorded on it
(``p.zero_rows``, a `ZeroRows`) for the clip and the checkpoints.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

__all__ = ["RowShards", "ZeroRows", "copy_rows", "shard_rows"]


def copy_rows(blocks: torch.Tensor, full: torch.Tensor) -> None:
    """Write ``full`` (d0, *rest) into ``blocks`` (N, c, *rest), zero, as rows of the padded
    (N c, *rest) tensor: block r gets rows [r c, (r + 1) c), the rows past d0 stay zero."""
    c, d0 = blocks.shape[1], full.shape[0]
    whole = d0 // c                                    # blocks filled entirely
    blocks[:whole].copy_(full[:whole * c].view((whole, c) + tuple(full.shape[1:])))
    if whole * c < d0:
        blocks[whole, :d0 - whole * c].copy_(full[whole * c:])


def shard_rows(full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rows [r c, (r + 1) c) of ``full`` (d0, *rest) padded with zero rows to n c, c = ceil(d0 / n)."""
    c = math.ceil(full.shape[0] / n)
    out = full.new_zeros((c,) + tuple(full.shape[1:]))
    rows = full[rank * c:(rank + 1) * c]  # fewer than c (or none) on the last ranks
    out[:rows.shape[0]] = rows
    return out


@dataclass(frozen=True)
class ZeroRows:
    """Where ZeRO-3 per parameter cut a tensor, recorded on it (``p.zero_rows``) for the clip and
    the checkpoints: rows [rank c, (rank + 1) c) of the whole (TP-local) tensor of shape
    ``whole``, c = ceil(whole[0] / parts), padded with zero rows."""

    rank: int
    parts: int
    whole: torch.Size
    replica: int = 0  # HSDP: which copy of these rows (its rank across the replicas); 0 otherwise

    @property
    def first_row(self) -> int:
        return self.rank * math.ceil(self.whole[0] / self.parts)


class RowShards:
    """The per-parameter layout of tensors of whole (TP-local) ``shapes``: each cut along dim 0
    into ``n`` blocks of c rows, this rank (``rank``) holding block ``rank`` of each."""

    def __init__(self, shapes, rank: int, n: int):
        self.shapes, self.rank, self.n = [torch.Size(s) for s in shapes], rank, n
        self.c_shapes = [torch.Size((math.ceil(s[0] / n),) + tuple(s[1:])) for s in self.shapes]
        self.full_numel = sum(s.numel() for s in self.shapes)      # P: the whole numbers
        self.shard_numel = sum(c.numel() for c in self.c_shapes)   # S: this rank's, padding included

    def whole_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        offsets = itertools.accumulate([s.numel() for s in self.shapes], initial=0)
        return [full[o:o + s.numel()].view(s) for o, s in zip(offsets, self.shapes)]

    def blocks(self, packed: torch.Tensor):
        """Each tensor's part of an (N, S) buffer, as its (N, c, *rest) row blocks."""
        offsets = itertools.accumulate([c.numel() for c in self.c_shapes], initial=0)
        for o, c_shape in zip(offsets, self.c_shapes):
            yield packed[:, o:o + c_shape.numel()].view((self.n,) + tuple(c_shape))

    def pack(self, shards) -> torch.Tensor:
        return torch.cat([s.reshape(-1) for s in shards])                            # (S,)

    def gather_buffer(self, full: torch.Tensor) -> torch.Tensor:
        return full.new_empty(self.n * self.shard_numel)                             # (N S,)

    def unpack(self, gathered: torch.Tensor, views) -> None:
        for view, blocks in zip(views, self.blocks(gathered.view(self.n, self.shard_numel))):
            view.copy_(blocks.reshape((-1,) + tuple(view.shape[1:]))[:view.shape[0]])  # (d0, *rest)

    def pack_grads(self, params, dtype, device) -> tuple[torch.Tensor, list[bool]]:
        packed = torch.zeros(self.n, self.shard_numel, dtype=dtype, device=device)    # (N, S)
        had = [p.grad is not None for p in params]
        for p, blocks in zip(params, self.blocks(packed)):
            if p.grad is not None:
                copy_rows(blocks, p.grad)
                p.grad = None  # each whole gradient goes as soon as it is packed
        return packed.view(-1), had

    def rows_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``whole`` (d0, *rest): its shard (c, *rest)."""
        return shard_rows(whole, self.rank, self.n)
