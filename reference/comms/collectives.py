"""Thin wrappers of torch.distributed's collectives that record each call in the open meters.

Same signatures as torch.distributed. S, a call's `payload_bytes`, is the whole tensor the
collective reduces or produces (all-gather's output, reduce-scatter's input). `sent_bytes` is
what this rank sends in the ring algorithm (`reference.comms.ring.ring_sent_bytes`): gloo or NCCL
may choose another, but the ring's count is the one the course's formulas teach.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from reference.comms.metering import record
from reference.comms.ring import ring_sent_bytes

__all__ = ["all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
           "all_to_all_single", "send", "recv", "sum_with_peer", "all_to_all_waited_by", "all_to_all_waiter"]

ReduceOp = dist.ReduceOp

# The tensor-in, tensor-out forms are `*_single` from torch 2.13, `*_into_tensor`/`*_tensor` before.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record_ring(op: str, group, tensor: torch.Tensor, src: int = 0) -> None:
    """Record `op` on `tensor` (its S) with the bytes this rank sends in the ring version."""
    sent = ring_sent_bytes(op, tensor.numel(), tensor.element_size(), dist.get_world_size(group),
                           dist.get_rank(group), src=src)
    record(op, group, _nbytes(tensor), sent)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.all_reduce, recording 2(N-1)/N * S sent bytes (exactly when S divides by N)."""
    _record_ring("all_reduce", group, tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_reduce_coalesced(tensors, group=None, divide_by: int = 1) -> None:
    """Sum ``tensors`` (any shapes, one dtype) over ``group`` in ONE all-reduce, then divide by
    ``divide_by`` (the group's size gives the mean): flattened into one buffer, reduced, copied
    back in place. Many small gradients pay one latency instead of one each (what a DDP bucket
    does during the backward, done once after it)."""
    tensors = list(tensors)
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])  # (sum of numels,)
    all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for t, reduced in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(reduced.view_as(t))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter_tensor, recording (N-1)/N * S_in sent bytes."""
    _record_ring("reduce_scatter", group, input)
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter: rank r receives into ``output`` the reduction of every
    rank's ``input_list[r]``, the pieces of any sizes (a ZeRO-2 bucket cut at the shards' edges).
    Records S = the pieces' bytes and, as the ring sends them, every piece but this rank's own."""
    nbytes = [_nbytes(t) for t in input_list]
    record("reduce_scatter", group, sum(nbytes), sum(nbytes) - nbytes[dist.get_rank(group)])
    return dist.reduce_scatter(output, list(input_list), op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """torch.distributed.all_gather_into_tensor, recording (N-1)/N * S_out sent bytes."""
    _record_ring("all_gather", group, output_tensor)
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """torch.distributed.broadcast, recording S sent bytes, or 0 on the pipelined chain's last
    rank (the one just before src on the ring)."""
    if group_src is None:
        if src is None:
            raise ValueError("broadcast needs src (a global rank) or group_src")
        group_src = src if group is None else dist.get_group_rank(group, src)
    _record_ring("broadcast", group, tensor, src=group_src)
    return dist.broadcast(tensor, group=group, async_op=async_op, group_src=group_src)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """torch.distributed.all_to_all_single, recording the bytes of the rows sent to other ranks."""
    n, i = dist.get_world_size(group), dist.get_rank(group)
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
    wait = getattr(_WAIT, "all_to_all", None)
    if wait is None or async_op:
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      group=group, async_op=async_op)
    # issued at once, waited for as this thread's `all_to_all_waited_by` says
    wait(dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                group=group, async_op=True), input)
    return None


_WAIT = threading.local()  # this thread's waiter of all_to_all_single, if any


@contextmanager
def all_to_all_waited_by(wait):
    """Within it, on this thread, every `all_to_all_single` called without ``async_op`` (the
    expert all-to-all's dispatch and combine, and their backwards) is issued asynchronously and
    handed to ``wait(work, input)``, which returns once the exchange is complete. DualPipe's
    overlapped forward and backward (`reference.pipeline_parallel.overlap`) compute the other
    micro-batch in the meantime; a benchmark can charge the exchange a time. ``None``: none."""
    before = getattr(_WAIT, "all_to_all", None)
    _WAIT.all_to_all = wait
    try:
        yield
    finally:
        _WAIT.all_to_all = before


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    """torch.distributed.send, recording S sent bytes."""
    record("send", group, _nbytes(tensor), _nbytes(tensor))
    return dist.send(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """torch.distributed.recv, recording S payload bytes and 0 sent bytes."""
    record("recv", group, _nbytes(tensor), 0)
    return dist.recv(tensor, src=src, group=group, tag=tag, group_src=group_src)


def sum_with_peer(tensor, peer: int, group=None) -> None:
    """Add, in place, ``peer``'s ``tensor`` (same shape) to this rank's: one send and one receive
    of S, issued together (`batch_isend_irecv`), recorded as a send of S and a receive of S. Both
    ranks end with mine + theirs, bit for bit the same (a + b = b + a). ``peer``: its rank in
    ``group``. DualPipe sums a stage's two copies this way, gradients and routers' loads."""
    record("send", group, _nbytes(tensor), _nbytes(tensor))
    record("recv", group, _nbytes(tensor), 0)
    theirs = torch.empty_like(tensor)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, group=group, group_peer=peer),
                                        dist.P2POp(dist.irecv, theirs, group=group, group_peer=peer)]):
        work.wait()
    tensor += theirs


def all_to_all_waiter():
    """This thread's waiter of `all_to_all_single` (`all_to_all_waited_by`), or None."""
    return getattr(_WAIT, "all_to_all", None)
