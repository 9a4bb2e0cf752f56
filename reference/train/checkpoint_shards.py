"""Checkpoints saved as shards: each rank writes what it holds and reads what it needs.

A checkpoint's tensor (``model/<name>``, ``optim/<name>/<key>``) is the plain GPT's whole
tensor, but no rank builds it. DCP stores it as chunks, each a box of the whole tensor
(`ChunkStorageMetadata(offsets, sizes)`), and each rank declares the boxes it holds, as views
of its own parameters and optimizer states:

    rank's tensor            its boxes, in the TP-local tensor (d0, *rest)
    whole (TP-local)         one box, the whole of it
    ZeRO-3 rows (c, *rest)   rows [r c, r c + c) of it, the padding rows dropped
    flat shard (S,)          each parameter's piece of [r S, (r + 1) S): a part row, whole rows,
                             a part row (recursively over the dims), each contiguous in (S,)

    then each box --as `parallelize` cut the weight--> boxes of the whole tensor:
    column rows (a chunk per q|k|v block), row-parallel columns (offset in dim 1), the
    vocabulary's rows [start, end) with the padding rows past V dropped

    dcp.save(plain, checkpoint_id=path, planner=ShardSavePlanner({fqn: (whole shape, boxes)}))
    dcp.load(plain, checkpoint_id=path, planner=ShardLoadPlanner({fqn: boxes}))

``plain`` holds the pickled meta bytes and the 0-dim optimizer states. A replicated box (dp
replicas, LayerNorms over tp, a tied head) is declared by every rank holding it and saved once
(DCP's `dedup_save_plans`). Loading declares the same boxes over this rank's parameters (zeroed
first) and zero optimizer buffers, and DCP reads the overlapping parts of the stored chunks,
whatever layout wrote them. A rank's memory is its shard plus, one at a time, DCP's copy of a
box (saving) or of a stored chunk it needs part of (loading).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                    TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from reference.train.reshard import (Entry, buffer_entries, entries, flat_groups, full_shape,
                                     full_shapes, is_head, is_sharded)

__all__ = ["Holding", "weight_holdings", "model_holdings", "state_holdings", "pieces", "check_shapes", "save_boxes",
           "load_boxes", "ShardSavePlanner", "ShardLoadPlanner"]

Box = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the whole tensor, a view of the data)


@dataclass
class Holding:
    """This rank's part of a tensor of TP-local ``shape``: "whole", "rows" (from ``start`` on, ZeRO-3)
    or "flat" (its flattened numbers [start, end) at position ``at`` of a flat shard)."""
    entry: Entry
    shape: tuple[int, ...]
    kind: str = "whole"
    start: int = 0
    end: int = 0
    at: int = 0


# ---------------------------------------------------------------------- boxes
def _flat_boxes(shape, a: int, b: int, base: int = 0) -> list[tuple[tuple, tuple, int]]:
    """Numbers [a, b) of a flattened tensor of ``shape`` as boxes (offsets, sizes, first number)."""
    if a >= b:
        return []
    if not shape:
        return [((), (), base + a)]
    inner = math.prod(shape[1:])

    def part_of_row(a: int, end: int) -> list:  # numbers [a, end) of row a // inner
        row = a // inner
        return [((row,) + o, (1,) + s, f) for o, s, f in
                _flat_boxes(shape[1:], a - row * inner, end - row * inner, base + row * inner)]

    out = []
    if a % inner:  # a part of the first row
        end = min(b, (a // inner + 1) * inner)
        out += part_of_row(a, end)
        a = end
    if b // inner > -(-a // inner):  # whole rows
        first, last = -(-a // inner), b // inner
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:]),
                    base + first * inner))
        a = last * inner
    if a < b:  # a part of the last row
        out += part_of_row(a, b)
    return out


def _local_boxes(h: Holding, t: torch.Tensor) -> list[Box]:
    """The boxes of the TP-local tensor that ``t`` (this rank's data for ``h``) holds."""
    if h.kind == "whole":
        return [((0,) * t.dim(), t)]
    if h.kind == "rows":  # (c, *rest): rows [start, start + c) of (d0, *rest), padded with zeros
        valid = max(0, min(t.shape[0], h.shape[0] - h.start))
        return [((h.start,) + (0,) * (t.dim() - 1), t[:valid])] if valid else []
    return [(o, t[h.at + f - h.start:h.at + f - h.start + math.prod(s)].view(s))
            for o, s, f in _flat_boxes(h.shape, h.start, h.end)]


def _segments(e: Entry, shape) -> tuple[list[tuple[int, int, int]], int]:
    """[(local row, whole row, rows)] of the TP-local tensor in the whole one (rows past V left out)
    and the column offset (row-parallel), from the parameter's ``tp_cut``."""
    cut, d0 = getattr(e.param, "tp_cut", None), shape[0] if shape else 0
    if cut is None:
        return [(0, 0, d0)], 0
    if cut.dim == 0:  # rank r holds piece r of each block ([q | k | v])
        return [(local, whole, n) for whole, local, n in cut.pieces()], 0
    (whole, _, _), = cut.pieces()
    return [(0, 0, d0)], whole


def pieces(h: Holding, t: torch.Tensor) -> list[Box]:
    """The boxes of the whole tensor that ``t`` holds, each with a view of ``t``'s data."""
    if t.dim() == 0:
        return [((), t)]
    rows, col = _segments(h.entry, h.shape)
    out = []
    for offsets, data in _local_boxes(h, t):
        lo, n = offsets[0], data.shape[0]
        for local, whole, count in rows:
            a, b = max(lo, local), min(lo + n, local + count)
            if a < b:
                rest = offsets[1:]
                if rest and col:
                    rest = (rest[0] + col,) + rest[1:]
                out.append(((whole + a - local,) + rest, data[a - lo:b - lo]))
    return out


# ---------------------------------------------------------------------- what a rank holds
def skip_tied_head(pm, e: Entry) -> bool:
    """The last stage's copy of a weight tied to the embedding: the first stage's is saved."""
    return is_head(e) and e.name != e.local and pm.mesh.pp > 1


def weight_holdings(pm) -> list[tuple[Holding, torch.Tensor]]:
    """(holding, the tensor holding it) for every parameter this rank holds."""
    es = entries(pm)
    units = pm.data_parallel.flat_weights()  # FSDP's units, whose flat shards hold the weights
    if not units:
        out = []
        for e in es:
            if is_sharded(e.param):  # its rows, as ZeRO-3 recorded them where it cut
                rows = e.param.zero_rows
                out.append((Holding(e, tuple(rows.whole), "rows", rows.first_row), e.param))
            else:
                out.append((Holding(e, tuple(e.param.shape)), e.param))
        return out
    by_id = {id(e.param): e for e in es}
    out, flat = [], set()
    for u in units:
        out += _flat_holdings(by_id, u.layout, u.params, u.shapes, u.dp_rank, u.shard)
        flat.update(id(p) for p in u.params)
    return out + [(Holding(e, tuple(e.param.shape)), e.param) for e in es if id(e.param) not in flat]


def model_holdings(pm) -> list[tuple[Holding, torch.Tensor]]:
    """`weight_holdings` and the buffers state_dict saves (a router's ``expert_bias``), whole."""
    return weight_holdings(pm) + [(Holding(e, tuple(e.param.shape)), e.param) for e in buffer_entries(pm)]


def _flat_holdings(by_id, layout, params, shapes, rank, shard) -> list[tuple[Holding, torch.Tensor]]:
    s, end = layout.shard_range(rank)
    out = []
    for p, shape, o, n in zip(params, shapes, layout.offsets, layout.numels):
        a, b = max(s, o), min(end, o + n)  # this rank's numbers of p, in the flat buffer
        out.append((Holding(by_id[id(p)], tuple(shape), "flat", max(0, a - o), max(0, b - o),
                            a - s if a < b else 0), shard))
    return out


def state_holdings(pm, optimizer) -> list[tuple[Holding, torch.Tensor]]:
    """(holding, the optimizer's parameter whose state holds it: a flat shard, or the parameter)."""
    groups = flat_groups(pm, optimizer)
    if not groups:
        return weight_holdings(pm)
    by_id = {id(e.param): e for e in entries(pm)}
    out = []
    for shard, layout, params, shapes, group in groups:
        out += _flat_holdings(by_id, layout, params, shapes, dist.get_rank(group), shard)
    return out


# ---------------------------------------------------------------------- save and load
def check_shapes(path: Path, pm, tensors: dict) -> None:
    """Every tensor the model needs is in the checkpoint, with the whole shape this model has."""
    want = full_shapes(pm)
    have = {k[6:]: tuple(v) for k, v in tensors.items() if k.startswith("model/")}
    problems = [f"{k}: {have[k]} in the checkpoint, {want[k]} in this model"
                for k in want if k in have and have[k] != want[k]]
    for k, shape in tensors.items():  # the optimizer's states are shaped like their parameter
        name = k[6:].rsplit("/", 1)[0]
        if k.startswith("optim/") and len(shape) and name in want and tuple(shape) != want[name]:
            problems.append(f"{k[6:]}: {tuple(shape)} in the checkpoint, {want[name]} in this model")
    for what, names in (("missing from the checkpoint", set(want) - set(have)),
                        ("in the checkpoint but not in this model", set(have) - set(want))):
        if names:
            problems.append(f"{what}: {', '.join(sorted(names))}")
    if problems:
        more = [f"... and {len(problems) - 12} more"] if len(problems) > 12 else []
        raise ValueError(f"checkpoint {path} does not fit this model ({pm.config}):\n  - "
                         + "\n  - ".join(problems[:12] + more))


def save_boxes(pm, optimizer) -> tuple[dict, dict]:
    """({fqn: (whole shape, boxes)} of the weights and optimizer states this rank holds,
    {fqn: 0-dim state}): what `dcp.save` gets, with no copy of any tensor."""
    boxes: dict[str, tuple[tuple, list[Box]]] = {}
    scalars: dict[str, torch.Tensor] = {}
    for h, t in model_holdings(pm):
        if not skip_tied_head(pm, h.entry):
            whole = full_shape(h.entry, h.shape)
            boxes.setdefault(f"model/{h.entry.name}", (whole, []))[1].extend(pieces(h, t.detach()))
    for h, src in state_holdings(pm, optimizer):
        if skip_tied_head(pm, h.entry):
            continue
        for key, v in sorted(optimizer.state.get(src, {}).items()):
            fqn = f"optim/{h.entry.name}/{key}"
            if not torch.is_tensor(v):
                raise TypeError(f"optimizer state {key!r} of {h.entry.name} is a "
                                f"{type(v).__name__}; a checkpoint stores tensor states only")
            if v.dim() == 0:  # AdamW's step: the same on every rank holding the parameter
                scalars[fqn] = v.detach()
            else:
                whole = full_shape(h.entry, h.shape)
                boxes.setdefault(fqn, (whole, []))[1].extend(pieces(h, v.detach()))
    return boxes, scalars


def load_boxes(pm, optimizer, metadata) -> tuple[dict, dict, callable, int]:
    """({fqn: boxes}, {fqn: 0-dim tensor}, finish, bytes allocated) for `dcp.load`: views of this
    rank's parameters (zeroed: the padding stays 0) and of new zero optimizer buffers; ``finish()``
    gives {id(optimizer parameter): {key: state}} once they are read."""
    layout = metadata.state_dict_metadata
    boxes: dict[str, list[Box]] = {}
    done = set()
    for h, t in model_holdings(pm):
        t = t.detach()  # the same storage, outside autograd: DCP copies into its views
        if t.data_ptr() not in done:
            t.zero_()
            done.add(t.data_ptr())
        boxes.setdefault(f"model/{h.entry.name}", []).extend(pieces(h, t))
    keys: dict[str, list[str]] = {}
    for fqn in layout:
        if fqn.startswith("optim/"):
            name, key = fqn[6:].rsplit("/", 1)
            keys.setdefault(name, []).append(key)
    scalars: dict[str, torch.Tensor] = {}
    buffers: dict[int, dict[str, torch.Tensor]] = {}
    users: dict[int, list[Entry]] = {}
    for h, src in (state_holdings(pm, optimizer) if optimizer is not None else []):
        users.setdefault(id(src), []).append(h.entry)
        for key in keys.get(h.entry.name, []):
            fqn, md = f"optim/{h.entry.name}/{key}", layout[f"optim/{h.entry.name}/{key}"]
            if len(md.size) == 0:
                scalars[fqn] = torch.empty((), dtype=md.properties.dtype)
                continue
            mine = buffers.setdefault(id(src), {})
            if key not in mine:
                mine[key] = torch.zeros(src.shape, dtype=md.properties.dtype, device=src.device)
            boxes.setdefault(fqn, []).extend(pieces(h, mine[key]))

    def finish() -> dict[int, dict[str, torch.Tensor]]:
        out = {}
        for src, es in users.items():
            found = [set(keys.get(e.name, [])) for e in es]
            if not any(found):
                continue
            if any(f != found[0] for f in found):
                raise ValueError(f"the checkpoint holds optimizer states {sorted(found[0])} for "
                                 f"{es[0].name} but not for every tensor sharing its flat shard")
            state = dict(buffers.get(src, {}))
            for key in sorted(found[0]):
                values = [scalars[f"optim/{e.name}/{key}"] for e in es
                          if f"optim/{e.name}/{key}" in scalars]
                if values:  # one count for a flat shard: every parameter's must agree
                    if any(not torch.equal(v, values[0]) for v in values):
                        raise ValueError(f"{key!r} differs between the tensors of one flat "
                                         f"shard ({sorted({float(v) for v in values})})")
                    state[key] = values[0].clone()
            out[src] = state
        return out

    return boxes, scalars, finish, sum(t.nbytes for b in buffers.values() for t in b.values())


# ---------------------------------------------------------------------- DCP planners
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
