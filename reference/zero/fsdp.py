"""ZeRO stage 3 (P_os+g+p) by blocks, also known as fully sharded data parallelism (FSDP).

Each rank keeps 1/N of every parameter, gradient and optimizer state. The model is cut into
units, one per GPT block `model.h[i]` plus a root unit with the rest (embeddings, final
LayerNorm and the tied `lm_head`, the same tensor as `wte`). A training step:

    forward    root: all-gather            (embedding, then head at the end)
               block i: all-gather  ->  compute  ->  free
    backward   root: all-gather again      (held until the end of backward)
               block i: all-gather again  ->  compute gradients  ->  free,
                        reduce-scatter its gradients into the shard (block i+1's,
                        in flight meanwhile, waited on first and its full gradient freed)
    step       any torch.optim optimizer over `fsdp.parameters()` (the shards)

While block i computes, block i+1's all-gather (i-1's in backward) is on the wire: a
prefetch. Per step a rank sends 3 (N-1)/N P per unit of P numbers (two all-gathers and a
reduce-scatter), 1.5 times plain data parallelism's all-reduce: the price of holding 1/N.
Hooks do the work, so the model's code is unchanged; frozen parameters stay whole on every
rank. Every rank must use the same parameters in a step (data-dependent use, as in a mixture
of experts, would leave ranks in different collectives).

    fsdp = FSDP(GPT(config))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    weights = fsdp.full_state_dict()       # the whole model, for inspection

`mixed_precision=True`: the fp32 shard is the master copy, cast to bf16 before the all-gather
(half the bytes), the block computes in bf16, and gradients are reduce-scattered and applied in
fp32. `offload=True`: the master shard, its gradient and so the optimizer state live on the CPU,
a compute copy on the device: on a GPU 12 bytes of device memory saved per parameter; on a
CPU-only machine two real copies kept in step, which shows the data movement, not a saving.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms
from reference.model import saved_buffers
from reference.runtime import device as rank_device
from reference.zero.shard import FlatLayout
from reference.zero.units import Unit, on_output_grad

__all__ = ["FSDP", "FSDPUnit", "FlatShards"]


class FlatShards(FlatLayout):
    """The flat layout of a unit (`FlatLayout`) of tensors of ``shapes``, with the moves a
    `Unit` asks of its layout: the all-gather writes straight into ``full``."""

    def __init__(self, shapes, world_size: int):
        super().__init__([s.numel() for s in shapes], world_size)
        self.shapes, self.full_numel = list(shapes), self.padded_numel

    def whole_views(self, full):
        return self.views(full, self.shapes)

    def pack(self, shard):
        return shard                                            # (S,) already

    def gather_buffer(self, full):
        return full                                             # (P,) = (N S,)

    def unpack(self, gathered, views):
        pass                                                    # gathered into full itself

    def pack_grads(self, params, dtype, device):
        flat = self.flatten([None if p.grad is None else p.grad.to(dtype) for p in params],
                            torch.empty(self.padded_numel, dtype=dtype, device=device))
        for p in params:
            p.grad = None
        return flat, [True] * len(params)


class FSDPUnit(Unit):
    """A block's parameters as a `Unit` in the flat layout: the master shard ``shard`` (S,) an
    `nn.Parameter` the optimizer steps on, the module's parameters views of ``full`` (P,)."""

    def __init__(self, name: str, params, group, device, param_dtype=None, offload: bool = False):
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"unit {name!r}: parameters of several dtypes {sorted(map(str, dtypes))} "
                             f"cannot share one flat buffer")
        self.master_dtype, self.offload = params[0].dtype, offload
        self.dp_size, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)
        layout = FlatShards([p.shape for p in params], self.dp_size)
        self.shapes = layout.shapes
        # Flatten once, make every rank start from group rank 0's numbers, keep our shard.
        with torch.no_grad():
            flat = layout.flatten([p.detach() for p in params],
                                  torch.empty(layout.padded_numel, dtype=self.master_dtype, device=device))
            comms.broadcast(flat, group=group, group_src=0)
            mine = layout.shard(flat, self.dp_rank).to("cpu" if offload else device, copy=True)  # (S,)
        self.shard = torch.nn.Parameter(mine)
        self.compute_shard = torch.empty_like(mine, device=device) if offload else None
        del flat
        super().__init__(name, params, layout, group, param_dtype or self.master_dtype, device,
                         grad_dtype=self.master_dtype)
        for p, view in zip(params, self.views):
            p.data = view

    def gather(self, shards=None, async_op: bool = False) -> None:
        """All-gather the master shard, in the compute dtype (a no-op when already there)."""
        if self.gathered:
            return
        with torch.no_grad():
            src = self.shard.detach()
            if self.offload:  # "host to device": the optimizer updated the CPU master copy
                src = self.compute_shard.copy_(src)
            super().gather(src.to(self.full.dtype), async_op)  # the bf16 copy under mixed precision

    def reduce_grads(self, async_op: bool = False):
        """`reduce_scatter`, then (in the returned callable) add the mean into ``shard.grad``."""
        finish = self.reduce_scatter(async_op)

        def add():
            grad, _ = finish()
            with torch.no_grad():
                # offload: "device to host", a real separate copy even on a CPU
                grad = grad.to(self.shard.device, copy=True) if self.offload else grad
                if self.shard.grad is None:
                    self.shard.grad = grad
                else:  # gradient accumulation over several backward passes
                    self.shard.grad.add_(grad)

        return add

    def full_flat(self) -> torch.Tensor:
        """A fresh (P,) tensor of the whole parameters in the master dtype (for inspection)."""
        return self.gathered_copy(self.shard.detach().to(self.full.device))

    def __repr__(self) -> str:
        return (f"FSDPUnit({self.name!r}, tensors={len(self.params)}, numel={self.layout.numel}, "
                f"shard_numel={self.layout.shard_numel}, gathered={self.is_gathered})")


class FSDP(nn.Module):
    """Shard `module`'s parameters over `group` by unit, gather them only while used.

    `units`: the submodules sharded separately, in forward order (default: GPT's blocks
    `module.h`); the rest is the root unit. `prefetch=False` turns off the overlap.
    """

    def __init__(self, module: nn.Module, group=None, units: Iterable[nn.Module] | None = None,
                 mixed_precision: bool = False, offload: bool = False, prefetch: bool = True):
        super().__init__()
        self.module = module
        self.group, self.prefetch = group, prefetch
        dev = rank_device()
        module.to(dev)
        param_dtype = torch.bfloat16 if mixed_precision else None
        if units is None:
            units = list(module.h) if isinstance(getattr(module, "h", None), nn.ModuleList) else []
        units = list(units)

        # Each trainable parameter in one unit; one reached from two units goes to the root.
        owner: dict[int, int] = {}
        for i, sub in enumerate(units):
            for p in sub.parameters():
                if p.requires_grad:
                    owner[id(p)] = i if owner.get(id(p), i) == i else -1
        root_params, unit_params, seen = [], [[] for _ in units], set()
        for name, p in module.named_parameters(remove_duplicate=True):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            i = owner.get(id(p), -1)
            (root_params if i < 0 else unit_params[i]).append(p)

        if not root_params and not any(unit_params):
            raise ValueError("FSDP got a module with no trainable parameter: nothing to shard")
        self.block_units: list[FSDPUnit] = []
        for i, (sub, params) in enumerate(zip(units, unit_params)):
            if not params:
                continue
            unit = FSDPUnit(f"unit{i}", params, group, dev, param_dtype, offload)
            self.block_units.append(unit)
            sub.register_forward_pre_hook(
                lambda module, args, unit=unit: self._use(unit, self._next(unit, +1)))
            sub.register_forward_hook(lambda module, args, out, unit=unit: self._after_forward(unit, out))
        self.root = FSDPUnit("root", root_params, group, dev, param_dtype, offload) if root_params else None
        self.units = ([self.root] if self.root else []) + self.block_units
        self.shards = nn.ParameterList([u.shard for u in self.units])

        for unit in self.units:
            unit.expect_grads()
            for p in unit.params:
                p.register_post_accumulate_grad_hook(
                    lambda p, unit=unit: self._reduce(unit) if unit.grad_arrived(p) else None)
        self._pending = []                    # finish() of reduce-scatters in flight
        self._backward_gathered: set[int] = set()
        self._callback_queued = False

    # ------------------------------------------------------------------ what the optimizer sees
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The shards only (`shards.0`, ...): build the optimizer on these."""
        for i, p in enumerate(self.shards):
            yield f"{prefix}{'.' if prefix else ''}shards.{i}", p

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters():
            yield p

    # ------------------------------------------------------------------ forward
    def _next(self, unit, step):
        i = self.block_units.index(unit) + step
        return self.block_units[i] if 0 <= i < len(self.block_units) else None

    def _prefetch(self, unit):
        if self.prefetch and unit is not None:
            unit.gather(async_op=True)

    def _use(self, unit, following):
        """Make `unit` whole (waiting for its prefetch), and start fetching `following`."""
        unit.gather()  # no-op when a prefetch is already on the way
        self._prefetch(following)
        unit.wait_gather()

    def _after_forward(self, unit, output):
        unit.free()
        self._hook_outputs(output, unit)

    def forward(self, *args, **kwargs):
        if self.root is not None:
            self._use(self.root, self.block_units[0] if self.block_units else None)
        elif self.block_units:
            self._prefetch(self.block_units[0])
        try:
            output = self.module(*args, **kwargs)
        finally:
            if self.root is not None:
                self.root.free()
        self._hook_outputs(output, self.root)  # (None: only to learn when backward starts)
        return output

    # ------------------------------------------------------------------ backward
    def _hook_outputs(self, output, unit):
        """Gather `unit` again when the gradient of its outputs arrives (just before its backward)."""
        on_output_grad(output, lambda: self._pre_backward(unit))

    def _pre_backward(self, unit):
        if not self._callback_queued:
            # Runs once autograd has finished the whole backward pass.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        if unit is None or id(unit) in self._backward_gathered:
            return
        self._backward_gathered.add(id(unit))
        if unit is self.root:
            following = self.block_units[-1] if self.block_units else None
        else:
            following = self._next(unit, -1)
        self._use(unit, following)

    def _reduce(self, unit):
        unit.free()
        # One reduce-scatter in flight, as FSDP2: backward holds at most two units' full gradients.
        self._finish_pending()
        self._pending.append(unit.reduce_grads(async_op=True))

    def _finish_pending(self):
        for finish in self._pending:
            finish()
        self._pending = []

    def _finish_backward(self):
        # Units with an unused parameter never completed: reduce them now, in unit order.
        for unit in self.units:
            if not unit.reduced and id(unit) in self._backward_gathered:
                self._reduce(unit)
        self._finish_pending()
        for unit in self.units:
            unit.free()
            unit.expect_grads()
        self._backward_gathered = set()
        self._callback_queued = False

    # ------------------------------------------------------------------ inspection
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the module by its name (a tied weight once), whole, in the master
        dtype, and the buffers state_dict saves (never sharded), as fresh CPU tensors."""
        values: dict[int, torch.Tensor] = {}
        for unit in self.units:
            flat = unit.full_flat()
            for p, v in zip(unit.params, unit.layout.views(flat, unit.shapes)):
                values[id(p)] = v.cpu().clone()
        # (A frozen parameter is never freed, so reading it directly is safe.)
        return {**{name: values[id(p)] if id(p) in values else p.detach().cpu().clone()
                   for name, p in self.module.named_parameters(remove_duplicate=True)},
                **{name: b.detach().cpu().clone() for name, b in saved_buffers(self.module).items()}}

    def state_dict(self, *args, **kwargs):
        raise RuntimeError("FSDP's module parameters are freed between uses, so state_dict() "
                           "would save empty tensors: use fsdp.full_state_dict() for the whole "
                           "model, or the shards in fsdp.parameters()")

    @contextlib.contextmanager
    def summon_full_params(self):
        """Inside the block every module parameter is whole (compute dtype), for reading: changes
        are not written back to the shards."""
        for unit in self.units:
            unit.gather()
        try:
            yield self.module
        finally:
            for unit in self.units:
                unit.free()

    def extra_repr(self) -> str:
        n = dist.get_world_size(self.group)
        return f"units={len(self.units)}, dp_size={n}, prefetch={self.prefetch}"
