"""`fully_shard`: the course's ZeRO-3 on any `nn.Module`, in the shape of PyTorch's FSDP2.

    from reference.zero import fully_shard, MixedPrecisionPolicy, full_state_dict
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    norms = {m.weight for m in model.modules() if isinstance(m, RMSNorm)}
    for block in model.blocks:                         # bottom-up: one unit per block ...
        fully_shard(block, mp_policy=mp, replicate_params=norms)
    fully_shard(model, mp_policy=mp, replicate_params=norms)   # ... then the root: the rest
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)       # steps on the fp32 shards
    model(idx, targets).backward(); opt.step(); opt.zero_grad()   # (the model returns its loss)
    weights = full_state_dict(model)                            # whole, by the original names

Each call makes one `reference.zero.units.Unit` of ``module.parameters()`` not claimed by an
earlier call on a submodule (FSDP2's parameter group), laid out per tensor (`RowShards`, FSDP2's
``Shard(0)``): parameter p (d0, *rest) keeps rows [r c, (r + 1) c) on rank r, c = ceil(d0 / N).
Between steps ``p.data`` *is* that shard in its original dtype (the fp32 master) and, after a
backward, ``p.grad`` is this rank's rows of the mean gradient: **the optimizer steps on the
shards**, as with FSDP2, so any element-wise torch optimizer over ``model.parameters()`` holds
1/N of its state. `full_state_dict` all-gathers every parameter whole under its own name.

One step, driven by hooks on the wrapped modules (the model's code is unchanged):

    root pre-forward    every unit's parameters become views of its (freed) buffer; floating
                        inputs cast to ``param_dtype`` (``cast_forward_inputs``)
    unit pre-forward    all-gather the shards cast to ``param_dtype``: (S,) -> (N, S) -> whole
    unit post-forward   free the whole parameters if ``reshard_after_forward``
    unit pre-backward   (its output's gradient arrives) all-gather again if freed
    grads all in        the whole gradients cast to ``reduce_dtype``, reduce-scattered to their
                        mean (S,), freed; the unit freed if ``reshard_after_forward``
    end of backward     replicated parameters' gradients all-reduced to their mean; every
                        parameter its fp32 shard again, ``.grad`` its fp32 rows (added to a
                        gradient already there: accumulation over backward passes)

Names and defaults as in `torch.distributed.fsdp.fully_shard` (torch 2.13):
``reshard_after_forward=None`` is True for every unit but the root (the first wrapped module to
run forward), which stays whole to the end of the backward; `MixedPrecisionPolicy`'s
``param_dtype`` None computes in the parameters' own dtype, ``reduce_dtype`` None reduces in
``param_dtype`` (the compute dtype), ``output_dtype`` casts floating outputs, and
``cast_forward_inputs`` casts floating inputs to ``param_dtype``.

Where the course differs. ``replicate_params`` (no PyTorch name): parameters left whole on every
rank (a norm's gain), their gradients all-reduced to the mean, as DDP would (FSDP2's
``ignored_params`` would leave them unreduced). Rank 0's initial parameters and buffers are
broadcast at wrap time (FSDP2 assumes equal initial weights; DDP broadcasts). Gathers are
synchronous, with no prefetch (`reference.zero.fsdp.FSDP` shows the overlap); an int
``reshard_after_forward`` (resharding to a smaller group) is refused; a forward is followed by
one backward before the next forward (a forward whose output needs no gradient ends the step).
Every rank must use the same parameters in a step, and a parameter only inside the forward of
the module whose unit holds it (a tied weight: in the unit of a module around both its uses).
With the same policy, losses, gradients and weights equal FSDP2's bit for bit on 2 gloo ranks
(tests/test_fully_shard.py); bench/fully_shard_vs_fsdp2.py compares bytes, peak and time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from reference import comms
from reference.runtime import device as rank_device
from reference.zero.rows import RowShards, ZeroRows, shard_rows
from reference.zero.units import Unit, on_output_grad

__all__ = ["fully_shard", "MixedPrecisionPolicy", "full_state_dict", "ShardState"]

_STATE = "_fully_shard_state"  # the attribute holding a wrapped module's `ShardState`


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision, per unit: compute and all-gather in ``param_dtype`` (None: the
    parameters' dtype), reduce gradients in ``reduce_dtype`` (None: ``param_dtype``), cast
    floating outputs to ``output_dtype`` (None: no cast), floating inputs to ``param_dtype``
    when ``cast_forward_inputs``. The shards, their gradients and the optimizer stay in the
    parameters' own dtype (fp32 master weights)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def _cast(dtype):
    """A function casting floating-point tensors to ``dtype`` and leaving anything else alone."""
    return lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


class ShardState:
    """What `fully_shard` attached to one module (``module._fully_shard_state``): its `Unit` of
    ``sharded`` parameters (None when every parameter was claimed below), its ``replicated``
    ones, its policy; on the root, ``tree`` (every state under it, itself first) and the step."""

    def __init__(self, module, unit, sharded, replicated, group, mp_policy, reshard_after_forward):
        self.module, self.unit, self.sharded, self.replicated = module, unit, sharded, replicated
        self.group, self.mp, self.reshard_arg = group, mp_policy, reshard_after_forward
        self.reshard = True if reshard_after_forward is None else reshard_after_forward
        self.orig_dtype = sharded[0].dtype if sharded else None
        self.is_root: bool | None = None   # set by the first forward through a wrapped module
        self.root: ShardState | None = None
        self.tree: list[ShardState] = []
        self.in_step = self.in_backward = False   # (on the root)
        self.masters: list = []            # the replicated parameters' own tensors during a step
        self.stashed: dict[int, torch.Tensor] = {}  # gradients of earlier backward passes

    @property
    def params(self) -> list:
        return self.sharded + self.replicated

    # ------------------------------------------------------------------ the root: a step's ends
    def lazy_init(self) -> None:
        """The first state to run forward is the root: every state below it joins its tree."""
        self.is_root, self.root, self.tree = True, self, [self]
        for sub in self.module.modules():
            state = getattr(sub, _STATE, None)
            if state is None or state is self:
                continue
            if state.is_root is not None:
                raise RuntimeError("fully_shard: a wrapped submodule ran forward before the module "
                                   "wrapping it; run the outermost wrapped module first")
            state.is_root, state.root = False, self
            self.tree.append(state)
        if self.reshard_arg is None:  # FSDP2: the root is needed again as soon as backward starts
            self.reshard = False

    def begin_step(self) -> None:
        """Every sharded parameter a view of its unit's freed buffer (in ``param_dtype``), every
        replicated one a ``param_dtype`` copy of its master; earlier gradients set aside."""
        for state in self.tree:
            for p in state.params:
                if p.grad is not None:
                    state.stashed[id(p)] = p.grad
                    p.grad = None
            if state.unit is not None:
                state.unit.to_whole(keep_shards=True)  # the fp32 shards stay: every gather's source
            state.masters = [p.data for p in state.replicated]
            if state.mp.param_dtype is not None:
                for p in state.replicated:
                    p.data = p.data.to(state.mp.param_dtype)
        self.in_step, self.in_backward = True, False

    def end_step(self, with_grads: bool) -> None:
        """Every parameter its master shard (or whole master) again, ``.grad`` this backward's mean
        gradient in the master dtype where it gave one, added to any set aside."""
        for state in self.tree:
            if state.unit is not None:
                if state.unit.grad is not None:  # (S,) in reduce_dtype -> the shards' dtype
                    state.unit.grad = state.unit.grad.to(state.orig_dtype)
                state.unit.to_shards(with_grads=with_grads)
            grads = state.reduce_replicated() if with_grads else [None] * len(state.replicated)
            for p, master, g in zip(state.replicated, state.masters, grads):
                p.grad = None
                p.data = master
                p.grad = g
            state.masters = []
            for p in state.params:
                old = state.stashed.pop(id(p), None)
                if old is not None:
                    p.grad = old if p.grad is None else old.add_(p.grad)
        self.in_step = self.in_backward = False

    def finish_backward(self) -> None:
        """Queued by the first pre-backward hook: runs once autograd has finished the backward."""
        for state in self.tree:
            unit = state.unit
            # A unit with an unused parameter never completed: reduce it now (missing = zeros).
            if unit is not None and not unit.reduced and any(p.grad is not None for p in unit.params):
                unit.reduce_into_grad()
        self.end_step(with_grads=True)

    # ------------------------------------------------------------------ every state: the hooks
    def gather(self) -> None:
        """All-gather this unit's shards cast to the compute dtype (FSDP2's copy-in)."""
        unit = self.unit
        if unit is not None and not unit.gathered:
            unit.gather([s.to(unit.dtype) for s in unit.shards])

    def pre_forward(self, module, args, kwargs):
        if self.is_root is None:
            self.lazy_init()
        if self.is_root:
            if self.in_step:  # the last forward had no backward: its step ends without gradients
                self.end_step(with_grads=False)
            self.begin_step()
        elif not self.root.in_step:
            raise RuntimeError("fully_shard: a wrapped submodule ran forward on its own; run it "
                               "through the root module")
        self.gather()
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            cast = _cast(self.mp.param_dtype)
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def post_forward(self, module, args, output):
        # (A forward inside the backward is activation checkpointing's recomputation: its
        # backward follows at once, and the unit is freed when its gradients are reduced.)
        if self.reshard and self.unit is not None and not self.root.in_backward:
            self.unit.free()
        on_output_grad(output, self.pre_backward)  # its backward gathers it again
        if self.mp.output_dtype is not None:
            output = tree_map(_cast(self.mp.output_dtype), output)
        if self.is_root and not any(isinstance(t, torch.Tensor) and t.requires_grad
                                    for t in tree_flatten(output)[0]):
            self.end_step(with_grads=False)  # no backward will follow (eval, no_grad)
        return output

    def pre_backward(self) -> None:
        root = self.root
        if not root.in_backward:
            root.in_backward = True
            for state in root.tree:
                if state.unit is not None:
                    state.unit.expect_grads()
            torch.autograd.Variable._execution_engine.queue_callback(root.finish_backward)
        self.gather()

    def grad_arrived(self, p) -> None:
        """A sharded parameter's whole gradient is in: reduce-scatter the unit once complete."""
        if self.root is not None and self.root.in_backward and self.unit.grad_arrived(p):
            self.unit.reduce_into_grad()  # cast to reduce_dtype while packing, (N S,) -> (S,)
            if self.reshard:
                self.unit.free()

    def reduce_replicated(self) -> list:
        """The replicated parameters' gradients averaged over the group in ``reduce_dtype`` (one
        all-reduce of them all), in their masters' dtype; None where no gradient came."""
        params = [p for p in self.replicated if p.grad is not None]
        if not params:
            return [None] * len(self.replicated)
        dtype = self.mp.reduce_dtype or self.mp.param_dtype or params[0].grad.dtype
        flat = torch.cat([p.grad.reshape(-1).to(dtype) for p in params])
        comms.all_reduce(flat, group=self.group)
        flat.div_(dist.get_world_size(self.group))
        mean, offset = {}, 0
        for p in params:
            mean[id(p)] = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        return [mean[id(p)].to(m.dtype, copy=True) if id(p) in mean else None
                for p, m in zip(self.replicated, self.masters)]


def fully_shard(module: nn.Module, *, group=None, reshard_after_forward: bool | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                replicate_params=None) -> nn.Module:
    """Shard ``module``'s parameters not claimed by an earlier call on a submodule into one unit
    over ``group`` (default: every rank), in place; returns ``module``. Call it bottom-up, the
    root last. ``replicate_params``: parameters kept whole on every rank (those of this call's
    parameters among them), their gradients all-reduced to the mean."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard wraps an nn.Module, got {type(module).__name__}")
    if getattr(module, _STATE, None) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if reshard_after_forward not in (None, True, False):
        raise ValueError(f"reshard_after_forward must be None, True or False, got "
                         f"{reshard_after_forward!r} (the course does not reshard to a smaller group)")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    group = group if group is not None else dist.group.WORLD
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = rank_device()
    claimed = {id(p) for sub in module.modules() if getattr(sub, _STATE, None) is not None
               for p in getattr(sub, _STATE).params}
    replicate = {id(p) for p in (replicate_params or ())}
    mine = [p for p in module.parameters() if id(p) not in claimed]  # (a tied weight once)
    module.to(dev)
    with torch.no_grad():  # every rank starts from rank 0's numbers
        for t in mine + list(module.buffers()):
            comms.broadcast(t.data, group=group, group_src=0)
    sharded = [p for p in mine if id(p) not in replicate]
    replicated = [p for p in mine if id(p) in replicate]
    if {p.dtype for p in sharded} - {sharded[0].dtype if sharded else None}:
        raise ValueError(f"fully_shard packs one buffer per unit: parameters of dtypes "
                         f"{sorted({str(p.dtype) for p in sharded})}")
    for p in sharded:
        if p.dim() == 0:
            raise ValueError("fully_shard cuts parameters along dim 0: pass a 0-dim parameter in "
                             "replicate_params")
    unit = None
    if sharded:
        shapes = [p.shape for p in sharded]
        with torch.no_grad():
            for p, shape in zip(sharded, shapes):
                p.data = shard_rows(p.data, rank, n)            # (c, *rest): the whole tensor freed
                p.zero_rows = ZeroRows(rank, n, shape)           # where it was cut (clip, checkpoints)
        unit = Unit(type(module).__name__, sharded, RowShards(shapes, rank, n), group,
                    mp_policy.param_dtype or sharded[0].dtype, dev, grad_dtype=mp_policy.reduce_dtype)
    state = ShardState(module, unit, sharded, replicated, group, mp_policy, reshard_after_forward)
    setattr(module, _STATE, state)
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    for p in sharded:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(state.grad_arrived)
    return module


def _state_of(module: nn.Module) -> ShardState | None:
    """The `ShardState` `fully_shard` attached to ``module``, or None (FSDP2's
    ``fully_shard.state(module)``)."""
    return getattr(module, _STATE, None)


fully_shard.state = _state_of


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` by its original name (a tied weight once), whole, in its
    master dtype, as fresh CPU tensors: one all-gather per unit (call it on every rank, between
    steps)."""
    values: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        state = getattr(sub, _STATE, None)
        if state is None:
            continue
        if state.root is not None and state.root.in_step:
            raise RuntimeError("full_state_dict between steps only (after the backward)")
        unit = state.unit
        if unit is not None:
            gathered = unit.gathered_copy(unit.layout.pack([p.data for p in unit.params]))  # (N S,)
            whole = unit.layout.whole_views(torch.empty(unit.layout.full_numel, dtype=state.orig_dtype,
                                                        device=gathered.device))
            unit.layout.unpack(gathered, whole)
            values.update((id(p), w.cpu().clone()) for p, w in zip(unit.params, whole))
    return {name: values[id(p)] if id(p) in values else p.detach().cpu().clone()
            for name, p in module.named_parameters()}
