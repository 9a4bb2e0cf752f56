"""Where a tensor-parallel layer cut each of its parameters: recorded on the parameter.

    p.tp_cut                        # TensorParallelCut, or absent: p is whole on every tp rank
    p.tp_cut.whole_shape(p.shape)   # (out, in) of the plain layer, the padding dropped
    p.tp_cut.pieces()               # [(offset in the whole, offset in p, length)] along p.tp_cut.dim
    p.tp_cut.gather(p, group)       # the whole tensor, on every tp rank (one all-gather)

A layer that splits a weight records it where it splits it, and whatever undoes the split
(`reference.parallel.gather`, `reference.train.checkpoint_shards`, `reference.train.reshard`,
`reference.parallel.clip`) reads the record instead of re-deriving it from the layer's type.
A dimension of (padded) size ``whole`` cut over ``parts`` ranks:

    blocks = 1   rank r holds [r w, (r + 1) w), w = whole / parts
    blocks = k   the dimension is k blocks side by side (c_attn's [q | k | v]); each block is
                 cut over the ranks and rank r holds its piece of every block: [q_r | k_r | v_r]

Rows past ``real`` (the vocabulary's padding) belong to no whole tensor: `pieces` and `gather` leave them out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import comms

__all__ = ["TensorParallelCut", "record_cut"]


@dataclass(frozen=True)
class TensorParallelCut:
    dim: int        # the dimension cut (0: rows, output features; 1: columns, input features)
    parts: int      # tp
    index: int      # this rank's place in the tp group
    whole: int      # the whole (padded) size of `dim`
    real: int       # the size without padding (the vocabulary V); == whole elsewhere
    blocks: int = 1  # 3 for a fused q|k|v: each block cut on its own

    def whole_shape(self, shape) -> tuple:
        """The whole tensor's shape (the padding dropped) of a piece shaped ``shape``."""
        return tuple(shape[:self.dim]) + (self.real,) + tuple(shape[self.dim + 1:])

    def pieces(self) -> list[tuple[int, int, int]]:
        """This rank's runs along `dim`: (offset in the whole, offset in the piece, length),
        the padding past `real` left out (a run may be empty)."""
        block = self.whole // self.blocks
        piece = block // self.parts
        starts = [b * block + self.index * piece for b in range(self.blocks)]
        return [(s, b * piece, max(0, min(piece, self.real - s))) for b, s in enumerate(starts)]

    def gather(self, piece: torch.Tensor, group) -> torch.Tensor:
        """The whole tensor from every rank's ``piece`` (collective over the tp ``group``)."""
        rows = piece.new_empty((self.parts * piece.shape[0], *piece.shape[1:]))  # rank r's rows r-th
        comms.all_gather_into_tensor(rows, piece.contiguous(), group=group)
        split = [p.chunk(self.blocks, dim=self.dim) for p in rows.chunk(self.parts)]  # [rank][block]
        return torch.cat([split[r][b] for b in range(self.blocks) for r in range(self.parts)],
                         dim=self.dim).narrow(self.dim, 0, self.real)


def record_cut(param: torch.Tensor, dim: int, parts: int, index: int, whole: int,
               real: int | None = None, blocks: int = 1) -> None:
    """Record on ``param`` how its layer cut it (see the module's docstring)."""
    param.tp_cut = TensorParallelCut(dim, parts, index, whole, whole if real is None else real, blocks)
