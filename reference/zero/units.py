"""ZeRO-3's one engine: a unit of parameters, sharded at rest, gathered whole only while used.

A unit is a list of parameters gathered, freed and reduce-scattered together: a block
(`FSDP`, `ReshardAfterForward`) or a whole pipeline stage (`ShardedParameters`). Its moves:

    gather()          this rank's shard (S,) all-gathered: every parameter whole in ``full`` (P,)
    free()            ``full``'s storage shrunk to 0 bytes; the parameters' views of it stay
    reduce_scatter()  the whole gradients packed (N S,) and dropped, reduce-scattered to this
                      rank's mean gradient (S,)

The parameters are views of ``full``, so the module's parameters and the tensors autograd
saved see the numbers again after a re-gather without being rebuilt. `p.data = view` gives
each parameter its own version counter and the writes go through ``full``, so autograd does
not mistake a re-gather for an in-place change.

A layout object says where the numbers go: `FlatShards` (`reference.zero.fsdp`) lays the
tensors end to end (`FlatLayout`), the all-gather writing into ``full`` itself; `RowShards`
(`reference.zero.rows`) cuts each tensor along dim 0, as FSDP2's `Shard(0)`, so a
tensor-parallel slice can be sharded again. A layout gives ``full_numel`` (P), ``shard_numel``
(S), ``whole_views``, ``pack``, ``gather_buffer``, ``unpack`` and ``pack_grads``; the
per-parameter shards (`to_whole`, `to_shards`, below) need the row layout's ``c_shapes`` and
``rows_of`` too.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from reference import comms

__all__ = ["Unit", "on_output_grad"]


def on_output_grad(output, fn) -> None:
    """Call ``fn()`` when the gradient of a tensor of ``output`` arrives: just before the backward
    of the module that made it, the moment to gather that module's unit again."""
    if torch.is_grad_enabled():
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: fn())


class Unit:
    """Parameters ``params`` gathered, freed and reduce-scattered together over ``group``.

    Args:
        dtype: the dtype the whole parameters compute in (bf16 under mixed precision).
        grad_dtype: the dtype the gradients are averaged in. Under mixed precision it is fp32:
            a sum of N bf16 gradients would round away the low bits of each; in fp32 the mean
            loses nothing the shards' fp32 master weights could use.
        mean_over: None averages with the collective's AVG. A number sums, then divides by it:
            experts sharded over their expert-data-parallel group divide by all of dp.
        replicate_group: HSDP. The reduce-scattered rows are then summed across the replicas,
            one all-reduce.

    Freeing shrinks ``full``'s storage to zero bytes (`untyped_storage().resize_(0)`) instead of
    dropping the tensor: the parameters are views of ``full``, and so are the tensors autograd
    saved for the backward. Gathering grows the same storage back and writes the numbers in,
    so every view sees them again without a module or a graph being rebuilt.
    """

    def __init__(self, name: str, params, layout, group, dtype, device, grad_dtype=None,
                 mean_over: int | None = None, replicate_group=None):
        self.name, self.params, self.layout, self.group = name, list(params), layout, group
        self.dtype, self.device, self.grad_dtype = dtype, device, grad_dtype or dtype
        self.mean_over, self.replicate_group = mean_over, replicate_group
        self.gathered = False                  # the whole numbers in ``full``, or on the way
        self.keep_shards = True                # per-parameter shards: see `to_whole`
        self.shards: list | None = None        # the shards while the parameters view ``full``
        self.grad: torch.Tensor | None = None  # their accumulated mean gradient (S,)
        self.with_grad = [False] * len(self.params)
        self.pending: set = set()              # in a backward: parameters awaiting a gradient
        self.reduced = True                    # in a backward: reduce-scattered already
        self._work = self._in_flight = None
        self.allocate()
        self.free()

    def allocate(self) -> None:
        """A new buffer ``full`` (P,) and its views, one per parameter in its whole shape."""
        self.full = torch.empty(self.layout.full_numel, dtype=self.dtype, device=self.device)
        self.views = self.layout.whole_views(self.full)

    @property
    def is_gathered(self) -> bool:
        return self.gathered and self._work is None

    # ------------------------------------------------------------------ the three moves
    @torch.no_grad()
    def gather(self, shards=None, async_op: bool = False) -> None:
        """All-gather ``shards`` (by default those `to_whole` took) into ``full``, unless there or
        on the way; with ``async_op`` the caller waits later, with `wait_gather`."""
        if self.gathered:
            return
        shards = self.shards if shards is None else shards
        if self.full.untyped_storage().nbytes() == 0:  # grown back under the views
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.gathered = True
        send = self.layout.pack(shards)                        # (S,)
        if not self.keep_shards:  # gathered once a step: the shards live on in `send` only
            shards.clear()
            self.shards = None
        out = self.layout.gather_buffer(self.full)             # (N S,)
        self._in_flight = (send, out)  # alive until every parameter is whole
        self._work = comms.all_gather_into_tensor(out, send, group=self.group, async_op=async_op)
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        """Block until a gather has landed; copy it out where the layout needs it."""
        if self._work is not None:
            self._work.wait()
        if self._in_flight is not None:  # (the flat layout gathered into ``full`` itself)
            with torch.no_grad():
                self.layout.unpack(self._in_flight[1], self.views)
        self._work = self._in_flight = None

    def free(self) -> None:
        """Drop the whole parameters' bytes; the views stay and come back with `gather`."""
        self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def reduce_scatter(self, async_op: bool = False):
        """Reduce-scatter the whole gradients (a missing one counts as zeros) to this rank's mean
        (S,). Returns a callable that waits and returns (the mean, which parameters had a gradient);
        the packed input lives until then."""
        self.reduced = True  # later gradients of this backward are not expected
        with torch.no_grad():
            send, had = self.layout.pack_grads(self.params, self.grad_dtype, self.device)
            out = torch.empty(self.layout.shard_numel, dtype=send.dtype, device=send.device)  # (S,)
            op = dist.ReduceOp.AVG if self.mean_over is None else dist.ReduceOp.SUM
            work = comms.reduce_scatter_tensor(out, send, op=op, group=self.group, async_op=async_op)
        in_flight = {"work": work, "send": send}
        del send, work

        def finish():
            if (work := in_flight.pop("work", None)) is not None:
                work.wait()
            in_flight.clear()
            with torch.no_grad():
                if self.mean_over is not None:
                    out.div_(self.mean_over)
                if self.replicate_group is not None:  # HSDP: every replica's share of the same rows
                    comms.all_reduce(out, group=self.replicate_group)
            return out, had

        return finish

    @torch.no_grad()
    def gathered_copy(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` (S,) all-gathered into a fresh (N S,) tensor, ``full`` untouched (to read a
        flat unit's master copy whole)."""
        out = send.new_empty(dist.get_world_size(self.group) * self.layout.shard_numel)
        comms.all_gather_into_tensor(out, send, group=self.group)
        return out

    # ------------------------------------------------------------------ one backward
    def expect_grads(self) -> None:
        """A backward starts: the unit is complete once every trainable parameter's gradient is in."""
        self.pending = {id(p) for p in self.params if p.requires_grad}
        self.reduced = not self.pending

    def grad_arrived(self, p) -> bool:
        """``p``'s gradient is in; True when that completes the unit (reduce it now)."""
        self.pending.discard(id(p))
        return not self.pending and not self.reduced

    # ------------------------------------------------------------------ per-parameter shards
    def to_whole(self, keep_shards: bool) -> None:
        """Each ``p.data``, its shard, becomes its view of ``full``. ``keep_shards``: the shards stay,
        the source of every re-gather; otherwise they go at the gather, ``full`` is a new buffer for
        this step, and `to_shards` cuts the shards again from the whole tensors."""
        self.shards, self.keep_shards = [p.data for p in self.params], keep_shards
        if not keep_shards:
            self.allocate()
        for p, view in zip(self.params, self.views):
            p.data = view  # (d0, *rest), no bytes until gathered
        self.grad, self.with_grad = None, [False] * len(self.params)

    def reduce_into_grad(self) -> None:
        """Reduce-scatter this backward's gradients, added into ``grad`` (micro-batches accumulate)."""
        out, had = self.reduce_scatter()()
        self.with_grad = [a or b for a, b in zip(self.with_grad, had)]
        if self.grad is None:
            self.grad = out
        else:
            self.grad += out

    @torch.no_grad()
    def to_shards(self, with_grads: bool) -> None:
        """``p.data`` its shard again (the kept one, or its rows of the whole tensor, which may
        have been overwritten), and ``p.grad`` a view of ``grad`` where a backward gave one."""
        shards = self.shards or [self.layout.rows_of(p.data) for p in self.params]
        self.free()
        if not self.keep_shards:
            self.full = self.views = None
        offsets = itertools.accumulate([c.numel() for c in self.layout.c_shapes], initial=0)
        for p, shard, o, c_shape, had in zip(self.params, shards, offsets, self.layout.c_shapes,
                                              self.with_grad):
            p.data = shard
            if with_grads and had:
                p.grad = self.grad[o:o + c_shape.numel()].view(c_shape)
        self.shards, self.grad = None, None
