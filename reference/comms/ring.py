"""Collectives built from point-to-point messages on a ring.

The N ranks of a group stand on a ring in group-rank order: rank i sends only to
``(i + 1) % N`` and receives only from ``(i - 1) % N``, both posted together with
``batch_isend_irecv`` so that nothing deadlocks. A tensor is cut into N chunks by
``torch.tensor_split`` (the first ``numel % N`` one element longer), and rank i *owns*
chunk i, as in ``reduce_scatter_tensor`` and ``all_gather_into_tensor``:

    reduce-scatter  N-1 steps; rank i ends with chunk i reduced over all ranks
    all-gather      N-1 steps; rank i contributes chunk i, all end with every chunk
    all-reduce      reduce-scatter then all-gather: 2(N-1) steps, and each rank
                    sends 2(N-1)/N * S bytes when S divides by N
    broadcast       a pipelined chain from src around the ring

Each records the bytes it really hands to ``isend`` in the open `CommMeter`s, as "ring_<op>".
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from reference.comms.metering import record

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "ring_broadcast", "chunk_sizes",
           "ring_sent_bytes", "exchange"]

ReduceOp = dist.ReduceOp


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Element counts of the n chunks `torch.tensor_split` cuts `numel` elements into."""
    return [numel // n + (1 if i < numel % n else 0) for i in range(n)]


def ring_sent_bytes(op: str, numel: int, element_size: int, world_size: int, rank: int,
                    src: int = 0) -> int:
    """Bytes group rank `rank` = i hands to isend in the ring version of `op`, with c_j the bytes
    of chunk j and S the tensor's: reduce_scatter S - c_i (every chunk but its own), all_gather
    S - c_{(i+1) % N} (every chunk but the one it receives last), all_reduce their sum, broadcast
    S except on the chain's last rank, just before group rank `src`, which sends nothing."""
    n = world_size
    if n == 1:
        return 0
    c = [k * element_size for k in chunk_sizes(numel, n)]
    total = numel * element_size
    if op == "reduce_scatter":
        return total - c[rank]
    if op == "all_gather":
        return total - c[(rank + 1) % n]
    if op == "all_reduce":
        return 2 * total - c[rank] - c[(rank + 1) % n]
    if op == "broadcast":
        return 0 if rank == (src - 1) % n else total
    raise ValueError(f"no ring byte count for {op!r}; expected reduce_scatter, all_gather, all_reduce or broadcast")


def exchange(group, send: torch.Tensor | None = None, dst: int | None = None,
             recv: torch.Tensor | None = None, src: int | None = None) -> int:
    """Send `send` to global rank `dst` and receive into `recv` from global rank `src`, together;
    returns the bytes sent. Either side may be None or empty (both ends skip an empty chunk)."""
    ops, sent = [], 0
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), dst, group))
        sent = send.numel() * send.element_size()
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return sent


class _Ring:
    """This rank's place on the ring of `group`: group rank, size, and the global
    ranks of its neighbours (P2POp wants global ranks)."""

    def __init__(self, group) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.size, self.rank = len(self.ranks), dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of the group with ranks {self.ranks}")
        self.next = self.ranks[(self.rank + 1) % self.size]
        self.prev = self.ranks[(self.rank - 1) % self.size]

    def step(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> int:
        """Send `send` to next and receive into `recv` from prev, together; returns bytes sent."""
        return exchange(self.group, send, self.next, recv, self.prev)


def _combine(acc: torch.Tensor, incoming: torch.Tensor, op) -> None:
    """acc <- acc (op) incoming, in place."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(incoming)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, incoming, out=acc)
    elif op == ReduceOp.MIN:
        torch.minimum(acc, incoming, out=acc)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(incoming)
    else:
        raise ValueError(f"ring collectives support SUM, AVG, MAX, MIN and PRODUCT, got {op}")


def _reduce_scatter_steps(ring: _Ring, chunks: Sequence[torch.Tensor], op) -> int:
    """Reduce the chunk views in place until chunk i = `ring.rank` holds the reduction over all
    ranks; returns bytes sent. Step s sends chunk (i - s - 1), folded at step s - 1, and folds in
    chunk (i - s - 2): each chunk travels once around the ring, ending whole on its owner."""
    n, i, sent = ring.size, ring.rank, 0
    for s in range(n - 1):
        out_c, in_c = (i - s - 1) % n, (i - s - 2) % n
        incoming = torch.empty_like(chunks[in_c])
        sent += ring.step(chunks[out_c], incoming)
        _combine(chunks[in_c], incoming, op)
    if op == ReduceOp.AVG:
        chunks[i].div_(n)
    return sent


def _all_gather_steps(ring: _Ring, chunks: Sequence[torch.Tensor]) -> int:
    """Fill the chunk views in place from chunk i = `ring.rank` outwards; returns bytes sent.
    Step s sends chunk (i - s) (its own first, then the one just received), receives (i - s - 1)."""
    n, i = ring.size, ring.rank
    return sum(ring.step(chunks[(i - s) % n], chunks[(i - s - 1) % n]) for s in range(n - 1))


def ring_reduce_scatter(tensor: torch.Tensor, group=None, op=ReduceOp.SUM) -> torch.Tensor:
    """Reduce `tensor` (left as it is) over `group`; return this rank's chunk of the flattened
    result, 1-D: ``reduce_scatter_tensor(out, tensor.reshape(N, -1))`` when numel divides by N."""
    ring = _Ring(group)
    work = tensor.detach().reshape(-1).clone()                 # (numel,)
    chunks = torch.tensor_split(work, ring.size)               # N views, sizes chunk_sizes(numel, N)
    sent = _reduce_scatter_steps(ring, chunks, op)
    record("ring_reduce_scatter", group, tensor.numel() * tensor.element_size(), sent)
    # clone so the result does not keep the whole work buffer alive
    return chunks[ring.rank].clone()                           # (chunk_sizes(numel, N)[i],)


def ring_all_gather(chunk: torch.Tensor, group=None, sizes: Sequence[int] | None = None,
                    numel: int | None = None) -> torch.Tensor:
    """Concatenate every rank's `chunk` in group-rank order; return the 1-D result. Receivers
    know each chunk's size from `sizes` (every rank's), or `numel` (the total, cut as
    `torch.tensor_split` cuts it), or else this rank's chunk size."""
    ring = _Ring(group)
    n = ring.size
    if sizes is not None and numel is not None:
        raise ValueError("give sizes or numel, not both")
    if numel is not None:
        sizes = chunk_sizes(numel, n)
    elif sizes is None:
        sizes = [chunk.numel()] * n
    sizes = [int(k) for k in sizes]
    if len(sizes) != n:
        raise ValueError(f"sizes has {len(sizes)} entries but the group has {n} ranks")
    if sizes[ring.rank] != chunk.numel():
        raise ValueError(f"rank {ring.rank}'s chunk has {chunk.numel()} elements but sizes says {sizes[ring.rank]}")
    out = chunk.new_empty(sum(sizes))                          # (sum(sizes),)
    chunks = torch.split(out, sizes)                           # N views
    chunks[ring.rank].copy_(chunk.detach().reshape(-1))
    sent = _all_gather_steps(ring, chunks)
    record("ring_all_gather", group, out.numel() * out.element_size(), sent)
    return out


def ring_all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM) -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (and return it): a ring
    reduce-scatter then a ring all-gather, exactly 2(N-1) steps (bytes: `ring_sent_bytes`)."""
    ring = _Ring(group)
    work = tensor.detach().reshape(-1)  # (numel,): a view, or a copy when tensor is not contiguous
    chunks = torch.tensor_split(work, ring.size)
    sent = _reduce_scatter_steps(ring, chunks, op)
    sent += _all_gather_steps(ring, chunks)
    if not tensor.is_contiguous():
        tensor.detach().copy_(work.view(tensor.shape))
    record("ring_all_reduce", group, tensor.numel() * tensor.element_size(), sent)
    return tensor


def ring_broadcast(tensor: torch.Tensor, src: int = 0, group=None,
                   num_chunks: int | None = None) -> torch.Tensor:
    """Copy `tensor` from global rank `src` to every rank of `group`, in place, down a pipelined
    chain: the ranks in ring order from src are positions p = 0, ..., N-1, the tensor is cut into
    `num_chunks` pieces (default N), and at step t position p forwards piece t - p while
    receiving piece t - p + 1. N - 2 + num_chunks steps; every position but the last sends S."""
    ring = _Ring(group)
    n = ring.size
    if src not in ring.ranks:
        raise ValueError(f"src={src} is not a rank of the group {ring.ranks}")
    k = n if num_chunks is None else int(num_chunks)
    if k < 1:
        raise ValueError(f"num_chunks must be at least 1, got {num_chunks}")
    pos = (ring.rank - ring.ranks.index(src)) % n              # place on the chain; src is 0
    work = tensor.detach().reshape(-1)  # (numel,): a view, or a copy when tensor is not contiguous
    pieces = torch.tensor_split(work, k)
    sent = 0
    for t in range(n - 2 + k):  # (nothing to send or receive on a single rank)
        out_p, in_p = t - pos, t - pos + 1
        send = pieces[out_p] if pos < n - 1 and 0 <= out_p < k else None
        recv = pieces[in_p] if pos > 0 and 0 <= in_p < k else None
        sent += ring.step(send, recv)
    if not tensor.is_contiguous():
        tensor.detach().copy_(work.view(tensor.shape))
    record("ring_broadcast", group, tensor.numel() * tensor.element_size(), sent)
    return tensor
