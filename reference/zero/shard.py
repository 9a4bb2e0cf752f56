"""The flat, padded, sharded layout that every ZeRO stage stores parameters in.

ZeRO partitions the model's numbers, not its tensors: the trainable parameters lie end to end
in one 1-D buffer, padded to a multiple of the data-parallel size N and cut into N equal
shards, rank r owning shard r.

    Psi = sum of the parameters' numels,   S = ceil(Psi / N),   P = N * S

    flat   | p0 ....... | p1 ... | p2 ............... | pad |     P elements
           |<-- shard 0 -->|<-- shard 1 -->|<-- shard 2 -->|     N shards of S
    offset 0            o1       o2                      Psi  P

A parameter may straddle two shards (p0): harmless for element-wise optimizers (SGD, Adam,
AdamW, Adagrad, RMSprop). The padding (< N numbers) is zero in parameters and gradients, so it
stays zero through the update. Equal shards are what `reduce_scatter_tensor` and
`all_gather_into_tensor` need, each rank moving (N - 1) / N of the buffer.

ZeRO-2's buckets (`FlatBucket`) are contiguous ranges of whole tensors, planned from the end
(`FlatLayout.buckets`) because backward produces the last layers' gradients first; a bucket's
*pieces* (`FlatLayout.pieces`) are its intersections with the N shards, some empty.

    flat   | p0 ....... | p1 ... | p2 ............... | pad |   (shards as above)
           |<----- bucket 1 ---->|<------ bucket 0 -------->|
    pieces of bucket 0: rank 0 none, rank 1 [o2, 2S), rank 2 [2S, P)
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["FlatLayout", "FlatBucket", "trainable_unique"]


@dataclass(frozen=True)
class FlatBucket:
    """Elements [start, end) of the flat buffer, holding the whole tensors `tensors` (indices)."""

    index: int
    start: int
    end: int
    tensors: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


def trainable_unique(params: Iterable[torch.Tensor]) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """(trainable, frozen): the parameters split by `requires_grad`, each tensor (a tied weight) once."""
    trainable, frozen, seen = [], [], set()
    for p in params:
        if isinstance(p, dict):
            raise TypeError("pass an iterable of parameters, not parameter groups (dicts): "
                            "every parameter of a ZeRO optimizer shares one group")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"expected parameters (tensors), got {type(p).__name__}")
        if id(p) in seen:
            continue
        seen.add(id(p))
        (trainable if p.requires_grad else frozen).append(p)
    return trainable, frozen


class FlatLayout:
    """Offsets of `numels` laid end to end, padded to N * S and cut into N shards of S."""

    def __init__(self, numels: Sequence[int], world_size: int):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.numels = [int(n) for n in numels]
        self.world_size = world_size
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total                                   # Psi
        self.shard_numel = -(-total // world_size)           # S = ceil(Psi / N)
        self.padded_numel = self.shard_numel * world_size    # P = N * S

    @property
    def padding(self) -> int:
        """P - Psi: zeros appended so the buffer splits into N equal shards (< N)."""
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of shard `rank` inside the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """The view of `flat` (P,) that rank `rank` owns: (S,)."""
        start, end = self.shard_range(rank)
        return flat[start:end]

    def views(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """One view of `flat` per parameter, in its own shape (no copy)."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, shapes)]

    def flatten(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
        """Copy `tensors` into `out` (P,) at their offsets; None and the padding become 0."""
        if out.numel() != self.padded_numel:
            raise ValueError(f"out has {out.numel()} elements, the layout needs {self.padded_numel}")
        for t, o, n in zip(tensors, self.offsets, self.numels):
            if t is None:  # a parameter unused in this step: its gradient is zero
                out[o:o + n].zero_()
            elif t.data_ptr() != out[o:o + n].data_ptr():  # skip a view already in place
                out[o:o + n].copy_(t.reshape(-1))
        out[self.numel:].zero_()
        return out

    def buckets(self, cap_numel: int) -> list[FlatBucket]:
        """Contiguous ranges covering [0, P), at most `cap_numel` elements each, last tensor first
        (bucket 0 also holds the padding); a tensor larger than the cap gets a bucket of its own."""
        if isinstance(cap_numel, bool) or not isinstance(cap_numel, int) or cap_numel < 1:
            raise ValueError(f"cap_numel must be a positive int (elements per bucket), got {cap_numel!r}")
        buckets: list[FlatBucket] = []
        end, members = self.padded_numel, []
        for i in reversed(range(len(self.numels))):
            if members and end - self.offsets[i] > cap_numel:  # tensor i would overflow the bucket
                start = self.offsets[members[-1]]
                buckets.append(FlatBucket(len(buckets), start, end, tuple(reversed(members))))
                end, members = start, []
            members.append(i)
        start = 0  # the last bucket planned starts where the buffer does
        buckets.append(FlatBucket(len(buckets), start, end, tuple(reversed(members))))
        return buckets

    def pieces(self, bucket: FlatBucket) -> list[tuple[int, int]]:
        """Per rank r, [lo, hi): the part of `bucket` inside shard r (lo == hi when none)."""
        clamp = lambda x: min(max(x, bucket.start), bucket.end)
        return [tuple(clamp(x) for x in self.shard_range(r)) for r in range(self.world_size)]

    def __repr__(self) -> str:
        return (f"FlatLayout(tensors={len(self.numels)}, numel={self.numel}, N={self.world_size}, "
                f"shard_numel={self.shard_numel}, padding={self.padding})")
