"""Communication for the course: collectives from scratch, a byte meter, a cost model.

Everything the rest of the course needs to communicate is reachable from here:

* ring collectives built from send/recv (`ring_all_reduce`, `ring_reduce_scatter`,
  `ring_all_gather`, `ring_broadcast`), in `reference.comms_ring`;
* `CommMeter` / `meter()`, which counts calls and bytes per collective and per
  process group, and `name_group`, in `reference.comms_meter`;
* `CostModel`, the alpha-beta model of a collective's time, in `reference.comms_cost`;
* below, thin wrappers of torch.distributed's collectives with the same
  signatures. Each records its call in the open meters and then calls
  torch.distributed. Later modules communicate only through these wrappers, so
  every byte they move is counted.

Bytes recorded by the wrappers. S is the `payload_bytes` of the call: the whole
tensor the collective reduces or produces (for all-gather the output, for
reduce-scatter the input, otherwise the tensor handed to the op). `sent_bytes` is
what this rank would send in the ring algorithm of `reference.comms_ring`; torch
(gloo, NCCL) may choose another algorithm, but the ring's count is the one the
course's formulas teach:

    all_reduce              2(N-1)/N * S   (exactly, per rank, when S divides by N)
    reduce_scatter_tensor    (N-1)/N * S
    all_gather_into_tensor   (N-1)/N * S
    all_to_all_single       the bytes of the rows sent to the other ranks (exact,
                            from the split sizes; the rows kept by this rank are free)
    broadcast               S on every rank except the rank just before src on the
                            ring (the end of the pipelined chain), which sends 0
    send / recv             S / 0
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comms_cost import COST_OPS, CostModel
from .comms_meter import CommMeter, format_records, group_label, meter, name_group, record
from .comms_ring import (
    chunk_sizes,
    ring_all_gather,
    ring_all_reduce,
    ring_broadcast,
    ring_reduce_scatter,
    ring_sent_bytes,
)

__all__ = [
    # from-scratch ring collectives
    "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "ring_broadcast",
    "chunk_sizes", "ring_sent_bytes",
    # the meter
    "CommMeter", "meter", "name_group", "group_label", "format_records",
    # the cost model
    "CostModel", "COST_OPS",
    # metered wrappers of torch.distributed
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
    "all_to_all_single", "send", "recv",
]

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor-in, tensor-out forms (`*_into_tensor`, `*_tensor`,
# now deprecated) to `*_single`; older releases have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ring_place(group) -> tuple[int, int]:
    """(N, this rank's group rank)."""
    return dist.get_world_size(group), dist.get_rank(group)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.all_reduce, recording 2(N-1)/N * S sent bytes."""
    n, i = _ring_place(group)
    record("all_reduce", group, _nbytes(tensor),
           ring_sent_bytes("all_reduce", tensor.numel(), tensor.element_size(), n, i))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter_tensor, recording (N-1)/N * S_in sent bytes."""
    n, i = _ring_place(group)
    record("reduce_scatter", group, _nbytes(input),
           ring_sent_bytes("reduce_scatter", input.numel(), input.element_size(), n, i))
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """torch.distributed.all_gather_into_tensor, recording (N-1)/N * S_out sent bytes."""
    n, i = _ring_place(group)
    record("all_gather", group, _nbytes(output_tensor),
           ring_sent_bytes("all_gather", output_tensor.numel(), output_tensor.element_size(), n, i))
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """torch.distributed.broadcast, recording S sent bytes, or 0 on the chain's last rank."""
    n, i = _ring_place(group)
    if group_src is None:
        if src is None:
            raise ValueError("broadcast needs src (a global rank) or group_src")
        group_src = src if group is None else dist.get_group_rank(group, src)
    record("broadcast", group, _nbytes(tensor),
           ring_sent_bytes("broadcast", tensor.numel(), tensor.element_size(), n, i, src=group_src))
    return dist.broadcast(tensor, group=group, async_op=async_op, group_src=group_src)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """torch.distributed.all_to_all_single, recording the bytes of the rows sent to other ranks."""
    n, i = _ring_place(group)
    rows = input.shape[0] if input.dim() > 0 else 1
    if input_split_sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all_single without split sizes needs dim 0 ({rows}) "
                             f"divisible by the group size ({n})")
        input_split_sizes = [rows // n] * n
    if len(input_split_sizes) != n or sum(input_split_sizes) != rows:
        raise ValueError(f"input_split_sizes {list(input_split_sizes)} must have {n} entries "
                         f"summing to dim 0 of the input ({rows})")
    row_bytes = _nbytes(input) // rows if rows else 0
    sent = (rows - int(input_split_sizes[i])) * row_bytes
    record("all_to_all", group, _nbytes(input), sent)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    """torch.distributed.send, recording S sent bytes."""
    record("send", group, _nbytes(tensor), _nbytes(tensor))
    return dist.send(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """torch.distributed.recv, recording S payload bytes and 0 sent bytes."""
    record("recv", group, _nbytes(tensor), 0)
    return dist.recv(tensor, src=src, group=group, tag=tag, group_src=group_src)
