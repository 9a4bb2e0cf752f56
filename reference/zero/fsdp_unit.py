"""One FSDP unit: the parameters of one block, sharded at rest, whole only while used.

A unit owns a list of a module's parameters (the tensors stay the module's own
`nn.Parameter` objects, so the module's code runs unchanged) and three buffers:

    shard        (S,)  fp32  this rank's numbers, an `nn.Parameter` the optimizer steps on
    full         (P,)  compute dtype; its storage exists only between gather() and free()
    shard.grad   (S,)  fp32  the averaged gradient of the shard, after reduce_grads()

Every module parameter's `.data` is a view of `full`. `free()` shrinks the
storage under `full` to zero bytes and `gather()` grows it back and all-gathers
into it, so the views (and the module's parameters, and the tensors autograd
saved for backward, which are those parameters) see the gathered numbers
again without being rebuilt. Writing through `full` does not bump the
parameters' version counters (`p.data = view` gives p its own), so autograd
does not mistake the regathered weights for an in-place change.

Options:

* `param_dtype=torch.bfloat16` (mixed precision): the fp32 shard is the master
  copy; it is cast to bf16 before the all-gather (half the bytes on the wire)
  and the block computes in bf16. Gradients are cast back to fp32 before the
  reduce-scatter, so the mean over ranks and the update are done in fp32.
* `offload=True`: the master shard, its gradient and so the optimizer state live
  on the CPU (`shard`), and a compute copy lives on the compute device
  (`compute_shard`): before each gather the updated master is copied to the
  device, after each reduce-scatter the gradient is copied back. On a GPU this
  frees device memory of 12 bytes per sharded parameter (fp32 master + Adam). On
  a CPU-only machine both copies sit in the same memory: the option then shows
  the data movement and the bookkeeping (two real, separate copies kept in
  step), not a saving.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference import comms
from reference.zero.shard import FlatLayout

__all__ = ["FSDPUnit"]


class FSDPUnit:
    """Parameters `params` of the module called `name`, flattened and sharded over `group`."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], group, device: torch.device,
                 param_dtype: torch.dtype | None = None, offload: bool = False):
        self.name, self.params, self.group = name, params, group
        self.dp_size, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = FlatLayout([p.numel() for p in params], self.dp_size)
        self.shapes = [p.shape for p in params]
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"unit {name!r}: parameters of several dtypes {sorted(map(str, dtypes))} "
                             f"cannot share one flat buffer")
        self.master_dtype = params[0].dtype
        self.param_dtype = param_dtype or self.master_dtype
        self.device, self.offload = device, offload

        # Flatten once, make every rank start from group rank 0's numbers, keep our shard.
        with torch.no_grad():
            flat = torch.empty(self.layout.padded_numel, dtype=self.master_dtype, device=device)
            self.layout.flatten([p.detach() for p in params], flat)
            comms.broadcast(flat, group=group, group_src=0)
            master_device = torch.device("cpu") if offload else device
            mine = self.layout.shard(flat, self.dp_rank).to(master_device, copy=True)  # (S,)
        self.shard = torch.nn.Parameter(mine)
        self.compute_shard = torch.empty_like(mine, device=device) if offload else None
        del flat

        # The gathered buffer (P,) and the parameters as views of it, then freed.
        self.full = torch.empty(self.layout.padded_numel, dtype=self.param_dtype, device=device)
        for p, view in zip(params, self.layout.views(self.full, self.shapes)):
            p.data = view
        self._gather_work = None
        self._gather_input = None
        self.free()

    # ------------------------------------------------------------------ parameters
    @property
    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0 and self._gather_work is None

    def gather(self, async_op: bool = False) -> None:
        """All-gather the full parameters into `full` (a no-op when already there or on the way)."""
        if self.full.untyped_storage().nbytes() > 0:
            return
        with torch.no_grad():
            self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
            src = self.shard.detach()
            if self.offload:
                # "Host to device": the optimizer updated the CPU master copy.
                src = self.compute_shard.copy_(src)
            if src.dtype != self.param_dtype:
                src = src.to(self.param_dtype)  # the bf16 copy sent by mixed precision
            self._gather_input = src  # kept alive until the async gather is waited on
            work = comms.all_gather_into_tensor(self.full, src, group=self.group, async_op=async_op)
        self._gather_work = work if async_op else None
        if not async_op:
            self._gather_input = None

    def wait_gather(self) -> None:
        """Block until an async gather started by `gather(async_op=True)` has landed."""
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
            self._gather_input = None

    def free(self) -> None:
        """Drop the full parameters' memory; the views stay and come back with `gather()`."""
        self.wait_gather()
        self.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self, async_op: bool = False):
        """Reduce-scatter the parameters' averaged gradients into this rank's shard.

        Drops the full gradients. Returns a callable that finishes the job (waits
        for the collective, adds into `shard.grad`); call it before the optimizer
        step. A parameter with no gradient (unused this step) counts as zeros.
        """
        with torch.no_grad():
            # fp32 even under mixed precision: the mean over ranks and the
            # update should not lose the bits bf16 drops.
            flat = self.layout.flatten(
                [None if p.grad is None else p.grad.to(self.master_dtype) for p in self.params],
                torch.empty(self.layout.padded_numel, dtype=self.master_dtype, device=self.device))
            for p in self.params:
                p.grad = None
            reduced = torch.empty(self.layout.shard_numel, dtype=self.master_dtype, device=self.device)
            work = comms.reduce_scatter_tensor(reduced, flat, op=dist.ReduceOp.AVG,
                                               group=self.group, async_op=async_op)

        # The full-size input stays alive until the collective is done (the work
        # object holds it too); finish() drops both, so a caller that finishes
        # each unit before reducing the next holds one full gradient in flight.
        in_flight = {"work": work, "flat": flat}
        del flat, work

        def finish():
            work = in_flight.pop("work", None)
            if work is not None:
                work.wait()
            in_flight.clear()
            with torch.no_grad():
                # offload: "device to host", a real separate copy even on a CPU
                grad = reduced.to(self.shard.device, copy=True) if self.offload else reduced
                if self.shard.grad is None:
                    self.shard.grad = grad
                else:  # gradient accumulation over several backward passes
                    self.shard.grad.add_(grad)

        return finish

    @torch.no_grad()
    def full_flat(self) -> torch.Tensor:
        """A fresh (P,) tensor of the full parameters in the master dtype (for inspection)."""
        out = torch.empty(self.layout.padded_numel, dtype=self.master_dtype, device=self.device)
        comms.all_gather_into_tensor(out, self.shard.detach().to(self.device), group=self.group)
        return out

    def __repr__(self) -> str:
        return (f"FSDPUnit({self.name!r}, tensors={len(self.params)}, numel={self.layout.numel}, "
                f"shard_numel={self.layout.shard_numel}, gathered={self.is_gathered})")
