"""ZeRO stages 1 and 2 (Rajbhandari et al., 2020): `ZeroOptimizer`, for a model every rank holds whole.

The trainable parameters live in the flat, padded layout of `reference.zero.shard` (Psi
numbers padded to P = N * S, rank r owning shard r of S numbers). Per step:

    reduce-scatter the gradients (averaged)   each rank: (N-1)/N * P numbers sent
    inner optimizer step on its own shard      state only for S numbers
    all-gather the updated shards              each rank: (N-1)/N * P numbers sent

Together 2 (N-1)/N * P, the all-reduce of plain data parallelism (an all-reduce *is* a
reduce-scatter then an all-gather): sharding the optimizer costs no extra communication.
The stages differ in where the gradients live: stage 1 keeps a full-size gradient buffer
(the `.grad`s are views of it) reduce-scattered in `step()`; stage 2 keeps only its shard's,
reduce-scattered bucket by bucket during backward (`reference.zero.reducer`).

    bytes per rank, fp32 Adam     params    grads     optimizer state
    plain data parallel           4 Psi     4 Psi     8 Psi
    stage 1                       4 P       4 P       8 S
    stage 2                       4 P       4 S       8 S

(`reference.memory` holds these formulas.) Inside a step stage 2 also holds the bucket
being reduced, B numbers: its gradient memory peaks at 4 (S + B) bytes
(`memory.zero_peak_grad_bytes`) against 4 (P + S) for stage 1; smaller buckets (`bucket_cap_mb`)
lower the peak at the price of more, smaller collectives (the alpha of the cost model).

Weight-decay groups (GPT-2 decays the matrices, not biases and LayerNorm gains) differ in
`weight_decay` only; `ZeroOptimizer` applies each group's decay itself on its contiguous ranges
of the shard (`reference.zero.groups`): decoupled `p *= 1 - lr * wd` for AdamW and `Adam8bit`,
coupled `grad += wd * p` for SGD, Adam, Adagrad, RMSprop, and runs the inner step with
`weight_decay=0`; the numbers equal torch's optimizer over those groups.

Limits: stage 2 communicates once per backward (gradient accumulation sends the bytes once
per backward, as DeepSpeed's stage 2). Autograd's own memory (the gradient just computed,
the activations' gradients) comes on top of the peak, which assumes gradients arrive roughly
in reverse order of the parameters. The inner optimizer sees the shard as one 1-D tensor:
only element-wise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop) match unsharded training;
one that uses a tensor's shape or norm (Adafactor, LBFGS) would see the shard's.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from reference import comms
from reference.zero.groups import decay_kind as _decay_kind
from reference.zero.groups import parse_groups as _parse_groups
from reference.zero.reducer import BucketReducer
from reference.zero.shard import FlatLayout, trainable_unique

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any `torch.optim` optimizer class.

        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)

    `params`: tensors (frozen ones never updated nor communicated, a tied weight stored once)
    or torch-style groups differing only in `weight_decay`. The trainable parameters are
    broadcast from the group's rank 0 at construction; after `step()` every rank holds all the
    updated ones. `bucket_cap_mb` (MiB, stage 2) caps the buckets reduced during backward.
    `param_groups` and `state` are the inner optimizer's (an LR scheduler works as usual).

    Attributes: `optimizer` (the inner one, over `shard`), `shard` (this rank's S numbers),
    `layout` (`FlatLayout`), `flat_param` (the P numbers the module's parameters view), and for
    stage 2 `buckets` (`FlatBucket`s, bucket 0 reduced first).
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class, stage: int = 1,
                 group=None, bucket_cap_mb: float = 25, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements ZeRO stages 1 and 2, got stage={stage!r}; "
                             f"stage 3 shards the parameters too: use reference.zero.FSDP")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass "
                            f"(e.g. torch.optim.AdamW), got {optimizer_class!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        params, decay_of, optimizer_kwargs = _parse_groups(params, optimizer_kwargs)
        self.params, self.frozen = trainable_unique(params)
        if not self.params:
            raise ValueError("ZeroOptimizer got no trainable parameter (all frozen or none given)")
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(f"all trainable parameters must share one dtype and device to be "
                             f"flattened, got {sorted(str(k) for k in kinds)}")
        self.stage, self.group = stage, group
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.layout = FlatLayout([p.numel() for p in self.params], self.dp_size)
        dtype, device = self.params[0].dtype, self.params[0].device

        # Every module parameter becomes a view of flat_param (P,): step()'s all-gather writes into the module.
        self.flat_param = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            self.layout.flatten([p.detach() for p in self.params], self.flat_param)
            comms.broadcast(self.flat_param, group=self.group, group_src=0)
        for p, view in zip(self.params, self.layout.views(self.flat_param, [p.shape for p in self.params])):
            p.data = view

        # This rank's shard (S,), a view of flat_param: the inner optimizer updates the module in place.
        self.shard = torch.nn.Parameter(self.layout.shard(self.flat_param, self.dp_rank))
        self.optimizer = optimizer_class([self.shard], **optimizer_kwargs)
        # Weight decay by group: ((start, end, wd), ...) over the shard, applied in step().
        self.decay_kind, self.decay_ranges = None, ()
        default_wd = self.optimizer.defaults.get("weight_decay", 0.0)
        decays = [decay_of.get(id(p), default_wd) for p in self.params]
        self.weight_decays = sorted(set(decays))
        if len(self.weight_decays) == 1 and decay_of:  # groups with one decay: the inner step's
            if "weight_decay" in self.optimizer.defaults:
                for g in self.optimizer.param_groups:
                    g["weight_decay"] = self.weight_decays[0]
            elif self.weight_decays[0] != 0:
                raise ValueError(f"{optimizer_class.__name__} has no weight_decay, but the groups "
                                 f"ask for {self.weight_decays[0]}")
        if len(self.weight_decays) > 1:
            self.decay_kind = _decay_kind(optimizer_class, self.optimizer.defaults)
            self.decay_ranges = self._shard_ranges(decays)
            for g in self.optimizer.param_groups:
                g["weight_decay"] = 0.0  # the inner step must not decay again
        # torch.optim.Optimizer's own set-up, then the inner optimizer's groups and state.
        super().__init__([self.shard], self.optimizer.defaults)
        self._share_inner()

        self.flat_grad = None
        self.reducer = None
        self.gradients_reduced = False  # set by reduce_gradients(), cleared by step() / zero_grad()
        if stage == 1:  # a full gradient buffer (P,): the .grads are views of it
            self.flat_grad = torch.zeros_like(self.flat_param)
            self._bind_grad_views()
        else:
            cap_numel = max(1, int(bucket_cap_mb * 2**20) // self.flat_param.element_size())
            self.reducer = BucketReducer(self.params, self.layout, self.shard, group, cap_numel)

    def _shard_ranges(self, decays: list[float]) -> tuple[tuple[int, int, float], ...]:
        """((start, end, wd), ...): this rank's shard cut where the parameters' decay changes."""
        lo, hi = self.layout.shard_range(self.dp_rank)
        ranges = []
        for offset, numel, wd in zip(self.layout.offsets, self.layout.numels, decays):
            start, end = max(offset, lo), min(offset + numel, hi)
            if start >= end or wd == 0:
                continue
            if ranges and ranges[-1][2] == wd and ranges[-1][1] == start - lo:
                ranges[-1] = (ranges[-1][0], end - lo, wd)  # merge neighbours with one decay
            else:
                ranges.append((start - lo, end - lo, wd))
        return tuple(ranges)

    @torch.no_grad()
    def _apply_weight_decay(self) -> None:
        """The groups' decay on this rank's shard, in torch's own operations (exact)."""
        lr = self.param_groups[0]["lr"]
        for start, end, wd in self.decay_ranges:
            if self.decay_kind == "decoupled":  # AdamW: p *= 1 - lr * wd, before the update
                self.shard[start:end].mul_(1 - lr * wd)
            else:                               # L2 (SGD, Adam): grad += wd * p
                self.shard.grad[start:end].add_(self.shard[start:end], alpha=wd)

    def _share_inner(self) -> None:
        # The same dicts: what a scheduler writes into self.param_groups is what the inner step reads.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults
        self._groups_shared = True

    @property
    def buckets(self):
        """Stage 2's buckets (`FlatBucket`s of the flat layout), in the order they are reduced."""
        return self.reducer.buckets if self.reducer is not None else []

    # ------------------------------------------------------------------ gradients
    def _bind_grad_views(self):
        shapes = [p.shape for p in self.params]
        for p, view in zip(self.params, self.layout.views(self.flat_grad, shapes)):
            p.grad = view
        self.shard.grad = self.layout.shard(self.flat_grad, self.dp_rank)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Leave the averaged gradient of this rank's shard in `shard.grad` (called by `step()`).

        Stage 2 reduced during backward; here it only reduces `.grad`s set by hand. Call it
        yourself to clip the shard's gradient before `step()` (`reference.parallel.clip`);
        `gradients_reduced` is then True until the next `step()` or `zero_grad()`.
        """
        if self.gradients_reduced:
            return
        self.gradients_reduced = True
        if self.stage == 2:
            self.reducer.finish()
            self.reducer.reduce_leftovers()
            return
        grads = [p.grad for p in self.params]
        flat = self.layout.flatten(grads, self.flat_grad)  # views already in place: no copy
        self._bind_grad_views()  # in case zero_grad(set_to_none) or the user replaced a .grad
        reduced = torch.empty(self.layout.shard_numel, dtype=flat.dtype, device=flat.device)  # (S,)
        comms.reduce_scatter_tensor(reduced, flat, op=dist.ReduceOp.AVG, group=self.group)
        self.shard.grad.copy_(reduced)

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter gradients (stage 1), update this rank's shard, all-gather the parameters."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure: run backward before step()")
        self.reduce_gradients()  # a no-op when the caller already reduced (to clip)
        if self.decay_ranges and self.shard.grad is not None:
            self._apply_weight_decay()  # groups' decays; the inner step runs with weight_decay=0
        self.optimizer.step()
        self.gradients_reduced = False
        # A copy in: the output contains the shard, and overlapping input and output is not portable.
        comms.all_gather_into_tensor(self.flat_param, self.shard.detach().clone(), group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; stage 1 zeroes its full buffer (the memory it keeps) whatever `set_to_none` says."""
        self.gradients_reduced = False
        if self.stage == 1:
            self.flat_grad.zero_()
            self._bind_grad_views()
            return
        for p in self.params + [self.shard]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict:
        """This rank's state (the inner optimizer's) and its layout: load it into the same rank and layout."""
        state = self.optimizer.state_dict()
        state["zero"] = dict(dp_rank=self.dp_rank, dp_size=self.dp_size, numel=self.layout.numel)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("zero", None)
        mine = dict(dp_rank=self.dp_rank, dp_size=self.dp_size, numel=self.layout.numel)
        if saved is not None and saved != mine:
            raise ValueError(f"this state holds the shard of dp_rank={saved['dp_rank']} of "
                             f"dp_size={saved['dp_size']} over {saved['numel']} numbers; this "
                             f"optimizer is dp_rank={self.dp_rank} of dp_size={self.dp_size} "
                             f"over {self.layout.numel}")
        self.optimizer.load_state_dict(state_dict)
        self._share_inner()  # loading gives the inner optimizer new group dicts
        if self.decay_ranges:  # a state saved by a one-group optimizer would bring its decay back
            for g in self.param_groups:
                g["weight_decay"] = 0.0

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_groups_shared", False):
            raise ValueError("ZeroOptimizer keeps all its parameters in one flat buffer and one "
                             "group: build it over every parameter at once (groups that differ "
                             "in weight_decay go to the constructor as a list of dicts)")
        super().add_param_group(param_group)  # torch.optim.Optimizer.__init__'s own group, replaced

    def __repr__(self) -> str:
        buckets = f", buckets={len(self.buckets)}" if self.stage == 2 else ""
        decays = f", weight_decays={self.weight_decays}" if self.decay_ranges else ""
        return (f"ZeroOptimizer(stage={self.stage}, dp_rank={self.dp_rank}, dp_size={self.dp_size}, "
                f"{self.layout}{buckets}{decays}, inner={type(self.optimizer).__name__})")
