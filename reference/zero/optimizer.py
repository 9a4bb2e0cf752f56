"""ZeRO: data parallelism that shards the training state instead of replicating it.

Plain data parallelism keeps on every one of the N ranks the parameters, the
gradients and the optimizer state of the whole model. ZeRO (Rajbhandari et al.,
2020) keeps only 1/N of some of them per rank, in three stages:

* **stage 1, P_os**   the optimizer state is sharded. Each rank updates only its
  shard of the parameters, then the shards are all-gathered.
* **stage 2, P_os+g** the gradients are sharded too: they are reduce-scattered,
  so each rank receives (and keeps) only the averaged gradient of its shard.
* **stage 3, P_os+g+p** the parameters are sharded as well, and each block's are
  all-gathered just before the block runs: `FSDP`, in `reference.zero.fsdp`.

Stages 1 and 2 are `ZeroOptimizer`, a drop-in for the optimizer of a model that
every rank holds whole. It stores the trainable parameters in the flat, padded
layout of `reference.zero.shard` (Psi numbers padded to P = N * S, rank r owning
shard r of S numbers) and does, per `step()`:

    reduce-scatter the gradients (averaged)   each rank: (N-1)/N * P numbers sent
    inner optimizer step on its own shard      state only for S numbers
    all-gather the updated shards              each rank: (N-1)/N * P numbers sent

Together 2 (N-1)/N * P, exactly the all-reduce of plain data parallelism
(an all-reduce *is* a reduce-scatter followed by an all-gather): sharding the
optimizer costs no extra communication. Stage 1 keeps a full-size gradient
buffer (the module's `.grad`s are views into it) and stage 2 does not; that is
the whole difference between them, as in the paper's memory table:

    bytes per rank, fp32 Adam     params    grads     optimizer state
    plain data parallel           4 Psi     4 Psi     8 Psi
    stage 1                       4 P       4 P       8 S
    stage 2                       4 P       4 S       8 S

(`reference.memory` holds these formulas and measures the real tensors.)

Honest limits. The reduce-scatter runs once, in `step()`, over the whole flat
buffer, so in stage 2 the full gradient still exists at the end of backward;
DeepSpeed reduces bucket by bucket during backward so it never does. What
stage 2 frees here is the gradient memory held between the reduction and the
next backward. The inner optimizer sees each rank's shard as one 1-D tensor, so
any `torch.optim` class works, but only element-wise ones (SGD, Adam, AdamW,
Adagrad, RMSprop) give the same numbers as unsharded training; an optimizer
that uses a tensor's shape or norm (Adafactor, LBFGS) would see the shard's.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from reference import comms
from reference.zero.fsdp import FSDP
from reference.zero.shard import FlatLayout, trainable_unique

__all__ = ["ZeroOptimizer", "FSDP", "FlatLayout"]


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any `torch.optim` optimizer class.

        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    `params` may hold frozen parameters (never updated nor communicated) and a
    tied weight reached twice (stored once). Every rank must hold the same model;
    at construction the trainable parameters are broadcast from the group's rank
    0, so they start equal even if the ranks initialised them differently. After
    `step()` every rank holds all the updated parameters.

    Attributes: `optimizer` (the inner optimizer, over this rank's shard only),
    `shard` (that 1-D parameter, S numbers), `layout` (the `FlatLayout`),
    `flat_param` (the P numbers the module's parameters are views of).
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class, stage: int = 1,
                 group=None, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements ZeRO stages 1 and 2, got stage={stage!r}; "
                             f"stage 3 shards the parameters too: use reference.zero.FSDP")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass "
                            f"(e.g. torch.optim.AdamW), got {optimizer_class!r}")
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

        # The flat parameter buffer (P,); every module parameter becomes a view
        # of it, so the all-gather at the end of step() writes straight into
        # the module, with no copy back.
        self.flat_param = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            self.layout.flatten([p.detach() for p in self.params], self.flat_param)
            comms.broadcast(self.flat_param, group=self.group, group_src=0)
        for p, view in zip(self.params, self.layout.views(self.flat_param, [p.shape for p in self.params])):
            p.data = view

        # This rank's shard (S,), a view of flat_param: the inner optimizer
        # updates the module's numbers in place.
        self.shard = torch.nn.Parameter(self.layout.shard(self.flat_param, self.dp_rank))
        self.optimizer = optimizer_class([self.shard], **optimizer_kwargs)

        # Stage 1 keeps a full gradient buffer (P,); the module's .grad are
        # views of it, so autograd accumulates into it in place.
        self.flat_grad = None
        if stage == 1:
            self.flat_grad = torch.zeros_like(self.flat_param)
            self._bind_grad_views()

    # ------------------------------------------------------------------ gradients
    def _bind_grad_views(self):
        shapes = [p.shape for p in self.params]
        for p, view in zip(self.params, self.layout.views(self.flat_grad, shapes)):
            p.grad = view
        self.shard.grad = self.layout.shard(self.flat_grad, self.dp_rank)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the averaged gradient into this rank's shard (`shard.grad`).

        Called by `step()`. Stage 1 reduces inside its full buffer and leaves the
        rest of it holding this rank's own (unreduced) gradient; stage 2 frees
        every full gradient and keeps only `shard.grad` (S,).
        """
        grads = [p.grad for p in self.params]
        if self.stage == 1:
            flat = self.layout.flatten(grads, self.flat_grad)  # views already in place: no copy
            self._bind_grad_views()  # in case zero_grad(set_to_none) or the user replaced a .grad
        else:
            flat = self.layout.flatten(grads, torch.empty_like(self.flat_param))
            for p in self.params:
                p.grad = None
        reduced = torch.empty(self.layout.shard_numel, dtype=flat.dtype, device=flat.device)  # (S,)
        # Each rank receives the mean over ranks of its shard: ZeRO's
        # reduce-scatter, the first half of data parallelism's all-reduce.
        comms.reduce_scatter_tensor(reduced, flat, op=dist.ReduceOp.AVG, group=self.group)
        if self.stage == 1:
            self.shard.grad.copy_(reduced)
        else:
            self.shard.grad = reduced

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter gradients, update this rank's shard, all-gather the parameters."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure: run backward before step()")
        self.reduce_gradients()
        self.optimizer.step()
        # The input is a copy: the output buffer contains the shard itself, and
        # a collective whose input and output overlap is not portable.
        comms.all_gather_into_tensor(self.flat_param, self.shard.detach().clone(), group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients.

        Stage 1 zeroes its full buffer in place whatever `set_to_none` says: the
        buffer is the gradient memory stage 1 keeps (the paper's 4 Psi bytes).
        Stage 2 drops every gradient, or zeroes them with `set_to_none=False`.
        """
        if self.stage == 1:
            self.flat_grad.zero_()
            self._bind_grad_views()
            return
        for p in self.params + [self.shard]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ------------------------------------------------------------------ the inner optimizer
    @property
    def param_groups(self):
        """The inner optimizer's groups (one, over the shard): set `lr` here, as schedulers do."""
        return self.optimizer.param_groups

    def state_dict(self):
        """This rank's inner optimizer state (its shard only)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, dp_rank={self.dp_rank}, dp_size={self.dp_size}, "
                f"{self.layout}, inner={type(self.optimizer).__name__})")
