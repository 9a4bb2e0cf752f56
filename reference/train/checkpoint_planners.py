"""DCP planners that write and read boxes of whole tensors (`reference.train.checkpoint_shards`).

    dcp.save(plain, checkpoint_id=path, planner=ShardSavePlanner({fqn: (whole shape, boxes)}))
    dcp.load(plain, checkpoint_id=path, planner=ShardLoadPlanner({fqn: boxes}))

A box is (offsets in the whole tensor, a view of this rank's data). ``plain`` holds what DCP's
default planner handles as it is: the pickled meta bytes and the 0-dim optimizer states.

Saving: the local plan gets one `WriteItem` of type SHARD per box, with its
`ChunkStorageMetadata(offsets, sizes)` and the whole tensor's size; DCP's global plan keeps
one copy of a box several ranks declare (same tensor, same offsets), writes the chunks into
each tensor's `TensorStorageMetadata`, and refuses boxes that overlap or leave a hole.
Loading: for each box, `create_read_items_for_chunk_list` makes one `ReadItem` per stored
chunk that overlaps it (its offsets in the chunk and in the box), and DCP copies each piece
into the view. Both planners count the bytes this rank writes or reads.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                    TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["ShardSavePlanner", "ShardLoadPlanner"]

Box = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the whole tensor, a view of the data)


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's planner, plus one write item per box: {fqn: (whole shape, [(offsets, view)])}."""

    def __init__(self, boxes: dict[str, tuple[tuple, list[Box]]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes
        self.data = {(k, tuple(o)): t for k, (_, bs) in boxes.items() for o, t in bs}
        self.written = 0  # bytes of tensors this rank writes, once DCP kept one copy of each box

    def create_local_plan(self):
        plan = super().create_local_plan()  # the meta bytes and the 0-dim states
        items = [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(torch.Size(o), t.shape),
                               properties=TensorProperties.create_from_tensor(t),
                               size=torch.Size(shape)))
                 for fqn, (shape, bs) in self.boxes.items() for o, t in bs]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def finish_plan(self, new_plan):
        self.written = sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize
                           for i in new_plan.items if i.tensor_data is not None)  # the box's bytes
        return super().finish_plan(new_plan)

    def lookup_object(self, index: MetadataIndex):
        found = self.data.get((index.fqn, tuple(index.offset or ())))  # index.index: a hint
        return found.detach() if found is not None else super().lookup_object(index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, plus reads into this rank's boxes: {fqn: [(offsets, destination view)]}."""

    def __init__(self, boxes: dict[str, list[Box]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes
        self.read = 0  # bytes of tensors this rank reads

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for fqn, bs in self.boxes.items():
            md = self.metadata.state_dict_metadata[fqn]
            chunks = [ChunkStorageMetadata(torch.Size(o), t.shape) for o, t in bs]
            mine = create_read_items_for_chunk_list(fqn, md, chunks)  # dest_index.index: the box
            self.read += sum(math.prod(i.lengths) for i in mine) * md.properties.dtype.itemsize
            items += mine
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.boxes:
            return self.boxes[index.fqn][index.index][1]
        return super().lookup_tensor(index)
