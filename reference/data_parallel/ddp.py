"""Data parallelism: every rank holds the whole model and a slice of the batch.

The loss is a mean, so the full-batch gradient is the mean of the N ranks' local gradients:
once every rank holds it (an all-reduce divided by N), the N optimizer steps are one step and
the replicas stay equal to one process training on the whole batch. Two versions:

* `naive_all_reduce_gradients(module)`, after ``loss.backward()``: one blocking all-reduce per
  gradient, paying a call's latency per parameter, and only once backward has finished;
* `DDP(module)`, as ``torch.nn.parallel.DistributedDataParallel``: gradients packed into
  buckets (`reference.data_parallel.buckets`), each all-reduced asynchronously from inside
  backward as soon as its last gradient is in, overlapping the rest of backward.

Per step a rank sends 2(N-1)/N times the gradient bytes (counted by `comms.meter()`).
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms
from reference.data_parallel.buckets import Bucket, format_buckets, plan_buckets
from reference.data_parallel.device import StepClock, check_module_device

__all__ = ["naive_all_reduce_gradients", "DDP", "Bucket", "plan_buckets", "format_buckets"]


def naive_all_reduce_gradients(module: nn.Module, group=None) -> None:
    """Average every gradient of `module` over `group`, one blocking all-reduce each (the naive
    version the notebook starts from: `DDP` buckets them, `comms.all_reduce_coalesced` makes them
    one). Parameters without a gradient are skipped, so every rank must have gradients for the
    same ones (or its peers wait forever); `DDP` handles a parameter unused on some ranks."""
    world_size = dist.get_world_size(group)
    for p in module.parameters():
        if p.grad is None:
            continue
        comms.all_reduce(p.grad, group=group)  # sum over ranks, in place
        p.grad.div_(world_size)  # the mean: the full-batch gradient


def _grad_ready_hook(ddp_ref, bucket_index: int, position: int, param) -> None:
    # A weak reference, so that a dropped DDP does not live on through its hooks.
    ddp = ddp_ref()
    if ddp is not None:
        ddp._mark_ready(bucket_index, position)


def remove_handles(handles) -> None:
    """Remove every hook of ``handles`` (a list, emptied): the end of a DDP or of a ZeRO-2 reducer."""
    for h in handles:
        h.remove()
    handles.clear()


class DDP(nn.Module):
    """Distributed data parallel with bucketed all-reduces that overlap backward.

        ddp = DDP(model.to(device()), bucket_cap_mb=25, group=dp_group)   # then train ddp as the model

    After ``backward()`` returns, every gradient is the mean over the group.

    * Wrapping broadcasts every parameter and buffer from the group's first rank.
    * Buckets of at most `bucket_cap_mb` MiB, bucket 0 of `first_bucket_cap_mb` (`plan_buckets`),
      are launched strictly in bucket order, so every rank issues the same all-reduces in the
      same order whatever order autograd finishes the gradients in.
    * A parameter's gradient is marked ready by ``register_post_accumulate_grad_hook``, not by a
      hook on the gradient itself. It fires once per backward, after autograd has added every
      use into ``.grad``. So a tied weight, used twice (the embedding and the LM head), joins
      its bucket once, with both uses summed.
    * ``with ddp.no_sync():`` backward accumulates locally; the next backward whose forward ran
      outside ``no_sync`` all-reduces the sum.
    * A parameter with no gradient on this rank contributes zeros (its bucket launches only at
      the end of backward). By default every rank then holds the mean, zero where no rank used
      it, which momentum or weight decay would move; ``find_unused_parameters=True`` adds one
      small all-reduce counting the users and leaves ``p.grad`` None where none did, as a
      single process would.
    * ``overlap=False``: the same buckets launched one after another at the end of backward,
      to measure what overlap alone is worth.
    * ``ddp.trace``: the last synchronised step's moments (forward end, each launch, backward
      end, each wait; ``perf_counter`` seconds, on a GPU when the GPU got there, `StepClock`).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None,
                 find_unused_parameters: bool = False, first_bucket_cap_mb: float = 1,
                 trace: bool = True, overlap: bool = True):
        super().__init__()
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_cap_mb", first_bucket_cap_mb)):
            # 0 is allowed, as in PyTorch: one bucket per parameter.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number of MiB >= 0 (0: one bucket per "
                                 f"parameter), got {value!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DDP needs torch.distributed initialised: build it inside a function "
                               "run by reference.runtime.launch (or under torchrun)")
        device = check_module_device(module, group)
        self._clock = StepClock(device) if trace else None
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = bool(find_unused_parameters)
        self.overlap = bool(overlap)  # False: every bucket launched after backward
        self.require_backward_grad_sync = True  # False inside no_sync()
        self._sync_this_backward = True  # decided by the latest forward
        self._broadcast_module_states()

        cap_bytes = int(bucket_cap_mb * 2**20)
        first_cap_bytes = min(cap_bytes, int(first_bucket_cap_mb * 2**20))
        self.buckets: list[Bucket] = plan_buckets(module.named_parameters(), cap_bytes, first_cap_bytes)
        # One flat communication buffer per bucket, reused every step: (bucket.numel,)
        self._flat = [torch.zeros(b.numel, dtype=b.dtype, device=b.device) for b in self.buckets]

        self._step_open = False
        self._pending: list[set[int]] = []  # positions in each bucket still waiting for a gradient
        self._next_bucket = 0  # buckets before it have been launched
        self._work: list = []
        self._forward_end = None  # a moment of self._clock
        self.trace: list[dict] = []

        self._hook_handles = []
        me = weakref.ref(self)
        for b in self.buckets:
            for position, p in enumerate(b.params):
                hook = functools.partial(_grad_ready_hook, me, b.index, position)
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
        weakref.finalize(self, remove_handles, self._hook_handles)

    # ------------------------------------------------------------------ set-up
    @torch.no_grad()
    def _broadcast_module_states(self) -> None:
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            comms.broadcast(t.detach(), group=self.group, group_src=0)

    def remove_hooks(self) -> None:
        """Detach this DDP from the module's parameters (to wrap the module again)."""
        remove_handles(self._hook_handles)

    # ---------------------------------------------------------------- training
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._sync_this_backward = self.require_backward_grad_sync
        out = self.module(*args, **kwargs)
        if self._clock is not None:
            self._forward_end = self._clock.now()
        return out

    @contextlib.contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _event(self, event: str, bucket: int | None = None, at=None) -> None:
        if self._clock is not None:
            self.trace.append({"event": event, "bucket": bucket,
                               "time": self._clock.now() if at is None else at})

    def _open_step(self) -> None:
        """First gradient of a synchronised backward: reset the step, queue the end-of-backward callback
        (it runs before backward() returns: the optimizer never sees unsynchronised gradients)."""
        self._step_open = True
        self._pending = [set(range(len(b.params))) for b in self.buckets]
        self._next_bucket = 0
        self._work = [None] * len(self.buckets)
        self.trace = []
        if self._forward_end is not None:
            self._event("forward_end", at=self._forward_end)
            self._forward_end = None
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _mark_ready(self, bucket_index: int, position: int) -> None:
        """The gradient at `position` of bucket `bucket_index` is fully accumulated."""
        if not self._sync_this_backward:
            return
        if not self._step_open:
            self._open_step()
        self._pending[bucket_index].discard(position)
        if self.overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # In bucket order: every rank issues its collectives in the same order.
        while self._next_bucket < len(self.buckets) and not self._pending[self._next_bucket]:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, i: int) -> None:
        b, flat = self.buckets[i], self._flat[i]
        for p, offset, numel in zip(b.params, b.offsets, b.numels):
            dst = flat[offset:offset + numel]  # (numel,) view of the flat buffer
            if p.grad is None:
                dst.zero_()  # unused on this rank: contributes nothing to the sum
            else:  # divide before summing, as PyTorch: a 16-bit sum of N full gradients could overflow
                torch.div(p.grad.reshape(-1), self.world_size, out=dst)
        self._work[i] = self._all_reduce_bucket(flat)
        self._event("launch", i)

    def _all_reduce_bucket(self, flat: torch.Tensor):
        """Start one bucket's all-reduce (`flat`: g / N); ``wait()`` on the result leaves the sum in it.

        The seam a compression overrides (`reference.data_parallel.compression`)."""
        return comms.all_reduce(flat, group=self.group, async_op=True)

    def _end_of_backward(self) -> None:
        self._event("backward_end")
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Launch what is left, wait for every bucket, write the means into ``p.grad``; calling
        it again (or after a ``no_sync`` backward) does nothing."""
        if not self._step_open:
            return
        for pending in self._pending:  # parameters unused on this rank
            pending.clear()
        self._launch_ready_buckets()
        users = self._count_users() if self.find_unused_parameters else None
        k = 0  # index of a parameter over all buckets, as in `users`
        for i, (b, flat, work) in enumerate(zip(self.buckets, self._flat, self._work)):
            self._event("wait_start", i)
            work.wait()
            self._event("wait_end", i)
            for p, offset, numel in zip(b.params, b.offsets, b.numels):
                mean = flat[offset:offset + numel].view_as(p)
                if p.grad is not None:
                    p.grad.copy_(mean)
                elif users is None or users[k] > 0:
                    p.grad = mean.clone()
                k += 1
        self._step_open = False
        if self._clock is not None:
            self._clock.resolve(self.trace)  # GPU events -> perf_counter seconds

    def _count_users(self) -> torch.Tensor:
        """Per bucketed parameter, the number of ranks holding a gradient for it: (n_params,) int32."""
        used = [p.grad is not None for b in self.buckets for p in b.params]
        device = self.buckets[0].device if self.buckets else torch.device("cpu")
        users = torch.tensor(used, dtype=torch.int32, device=device)
        comms.all_reduce(users, group=self.group)
        return users.cpu()

    # -------------------------------------------------------------- inspection
    @property
    def bucket_nbytes(self) -> int:
        """Bytes of the flat communication buffers: one more copy of the trainable gradients."""
        return sum(f.numel() * f.element_size() for f in self._flat)

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, bucket_cap_mb={self.bucket_cap_mb}, "
                f"buckets={len(self.buckets)}, find_unused_parameters={self.find_unused_parameters}")
