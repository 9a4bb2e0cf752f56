"""ZeRO-2's gradient path: reduce-scatter bucket by bucket from hooks, during backward.

Reducing once after backward would need every module gradient (Psi numbers) and a flat copy
(P) alive together; `BucketReducer`, as DeepSpeed, reduces during backward instead:

    backward produces    ... p7.grad  p6.grad | p5.grad  p4.grad | ...
    flat layout          | ...  bucket 1      |    bucket 0      | pad |

Each parameter's gradient, once complete, is copied into its bucket's (B,) buffer and freed;
a full bucket is reduce-scattered, rank r keeping the mean of the bucket's piece inside shard
r, and freed before the next one is made. So a rank holds its shard's gradient and at most one
bucket (`reference.memory.zero_peak_grad_bytes`). Buckets go strictly in order, the same on
every rank; a gradient that arrives early waits in ``.grad``, one that never arrives counts
as zeros. A rank sends every piece but its own, 4 (L - l_r) bytes per bucket: over the buckets
4 (P - S) = (N-1)/N * 4P per backward, stage 1's single reduce-scatter.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist

from reference import comms
from reference.data_parallel.ddp import remove_handles
from reference.zero.shard import FlatLayout

__all__ = ["BucketReducer"]


def _grad_ready(reducer_ref, index: int, param) -> None:
    # A weak reference, so that a dropped optimizer does not live on through its hooks. (DDP's
    # hook is the same pattern; each marks its own buckets: an all-reduce there, a reduce-scatter here.)
    reducer = reducer_ref()
    if reducer is not None:
        reducer._grad_ready(index)


class BucketReducer:
    """Reduce-scatter the gradients of `params`, laid out by `layout`, into `shard.grad` (S,), in
    buckets of at most `cap_numel` numbers. Every rank builds it over the same parameters."""

    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, shard: torch.nn.Parameter,
                 group, cap_numel: int):
        self.params, self.layout, self.shard, self.group = params, layout, shard, group
        self.rank = dist.get_rank(group)
        self.buckets = layout.buckets(cap_numel)
        self._bucket_of = {i: b.index for b in self.buckets for i in b.tensors}
        self._open = False
        handles = []
        me = weakref.ref(self)
        for i, p in enumerate(params):
            handles.append(p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, me, i)))
        self._handles = handles
        weakref.finalize(self, remove_handles, handles)

    @property
    def bucket_numel(self) -> int:
        """The largest bucket: the B of the peak memory formula."""
        return max(b.numel for b in self.buckets)

    # ------------------------------------------------------------------ one backward
    def _open_round(self, in_backward: bool) -> None:
        self._open = True
        self._arrived = [set() for _ in self.buckets]  # tensors whose gradient is complete
        self._current = 0                               # buckets before it are reduced
        self._buffer = None                             # the current bucket's (B,), made on demand
        self._filled: set[int] = set()                  # tensors already copied into it
        # Accumulate (a second backward before step), or write straight into a fresh shard gradient.
        self._accumulate = self.shard.grad is not None
        if not self._accumulate:
            self.shard.grad = torch.empty_like(self.shard)  # (S,)
        if in_backward:  # runs once autograd has finished the whole backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _grad_ready(self, i: int) -> None:
        """Hook: parameter i's gradient is complete."""
        if not self._open:
            self._open_round(in_backward=True)
        b = self._bucket_of[i]
        if b < self._current:
            raise RuntimeError(f"the gradient of parameter {i} arrived after its bucket {b} was reduced: "
                               f"one backward must produce each gradient once")
        self._arrived[b].add(i)
        if b == self._current:
            self._stash(i)
        self._reduce_ready()

    def _stash(self, i: int) -> None:
        """Copy parameter i's gradient into the current bucket's buffer and free the gradient."""
        bucket = self.buckets[self._current]
        if self._buffer is None:
            p0 = self.params[i]
            self._buffer = torch.empty(bucket.numel, dtype=p0.dtype, device=p0.device)  # (B,)
            if bucket.end > self.layout.numel:  # the padding (bucket 0 only) stays zero
                self._buffer[self.layout.numel - bucket.start:].zero_()
        p, o = self.params[i], self.layout.offsets[i] - bucket.start
        self._buffer[o:o + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        self._filled.add(i)

    def _reduce_ready(self, final: bool = False) -> None:
        """Reduce, in bucket order, every bucket whose gradients are all in (all of them if `final`)."""
        while self._current < len(self.buckets):
            bucket = self.buckets[self._current]
            if not final and len(self._arrived[bucket.index]) < len(bucket.tensors):
                return
            for i in bucket.tensors:
                if i not in self._filled and self.params[i].grad is not None:
                    self._stash(i)  # set outside a hook (by hand, or before this backward)
            if self._buffer is None:  # nothing arrived here: reduce zeros
                self._buffer = torch.zeros(bucket.numel, dtype=self.shard.dtype, device=self.shard.device)
            for i in bucket.tensors:
                if i not in self._filled:  # no gradient on this rank: contributes zeros
                    o, n = self.layout.offsets[i] - bucket.start, self.layout.numels[i]
                    self._buffer[o:o + n].zero_()
            self._reduce(bucket)
            self._buffer, self._filled = None, set()
            self._current += 1
            if self._current < len(self.buckets):  # gradients that came early move in now
                for i in sorted(self._arrived[self._current]):
                    self._stash(i)

    def _reduce(self, bucket) -> None:
        start, ranges = bucket.start, self.layout.pieces(bucket)
        pieces = [self._buffer[lo - start:hi - start] for lo, hi in ranges]  # N views, some empty
        lo, hi = ranges[self.rank]
        s0 = self.layout.shard_range(self.rank)[0]
        mine = self.shard.grad[lo - s0:hi - s0]  # (hi - lo,) view of this rank's shard gradient
        # rank r receives the mean over ranks of pieces[r] (metered: it sends every piece but its own)
        out = torch.empty_like(mine) if self._accumulate else mine
        comms.reduce_scatter(out, pieces, op=dist.ReduceOp.AVG, group=self.group)
        if self._accumulate:
            mine.add_(out)

    def finish(self) -> None:
        """Reduce every bucket not yet reduced in this backward (end of backward; safe to call again)."""
        if self._open:
            self._reduce_ready(final=True)
            self._open = False

    def reduce_leftovers(self) -> None:
        """Reduce gradients that reached `.grad` without a hook (set by hand): on every rank or none."""
        if any(p.grad is not None for p in self.params):
            self._open_round(in_backward=False)
            self.finish()

    def remove_hooks(self) -> None:
        remove_handles(self._handles)
