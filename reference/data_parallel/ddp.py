"""Data parallelism: every rank holds the whole model and a slice of the batch.

Each of the N ranks of the data-parallel group runs forward and backward on its
own B / N examples. The loss is a mean, so the full-batch gradient is the mean
of the N local gradients; once every rank holds that mean (an all-reduce of the
gradients, divided by N), the N optimizer steps are the same step and the
replicas stay identical, equal to one process training on the whole batch.

Two versions, the second built from the first:

* `naive_all_reduce_gradients(module)`, called after ``loss.backward()``: one
  blocking all-reduce per gradient. Correct, but it pays a call's latency per
  parameter and communicates only once backward has finished.
* `DDP(module)`, what ``torch.nn.parallel.DistributedDataParallel`` does:
  gradients are packed into buckets (`reference.data_parallel.buckets`) and
  each bucket's all-reduce is launched asynchronously from inside backward, as
  soon as its last gradient is accumulated, so the all-reduce of the last
  layers runs while backward is still computing the first layers' gradients.

Per step a rank sends 2(N-1)/N times the gradient bytes, in one call per bucket
(every collective goes through `reference.comms`, so `comms.meter()` counts it).
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
    """Average every gradient of `module` over `group`, one blocking all-reduce each.

    Call it after ``loss.backward()`` and before ``optimizer.step()``.
    Parameters without a gradient (frozen ones) are skipped, so every rank must
    have gradients for the same parameters, or its peers wait forever in a
    collective it never joins; `DDP` handles a parameter unused on some ranks.
    """
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


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class DDP(nn.Module):
    """Distributed data parallel with bucketed all-reduces that overlap backward.

    ``ddp = DDP(model, bucket_cap_mb=25, group=dp_group)`` then train ``ddp``
    as the model itself: ``loss = ddp(x, y)[1]; loss.backward(); opt.step()``.
    After ``backward()`` returns, every gradient is the mean over the group.

    * Wrapping broadcasts every parameter (frozen ones too) and buffer from the
      group's first rank, so all replicas start equal.
    * The module must already be on the device the group communicates
      (``DDP(model.to(device()))``, `reference.data_parallel.device`).
    * Buckets of at most `bucket_cap_mb` MiB (2**20 bytes), bucket 0 of at most
      `first_bucket_cap_mb` (`plan_buckets`); ``ddp.buckets`` lists them.
    * A hook on each parameter (``register_post_accumulate_grad_hook``) marks
      its gradient ready; it fires once per backward even for a tied weight
      used twice, after both uses are summed. Buckets are launched strictly in
      bucket order, so every rank issues the same all-reduces in the same order
      even if autograd finishes gradients in a different order on another rank.
    * At the end of backward (a callback queued on the autograd engine)
      `finish_gradient_synchronization` runs.
    * ``with ddp.no_sync():`` forward and backward accumulate gradients locally
      without communicating; the next synchronised backward all-reduces the
      accumulated sum. As in PyTorch, a backward is synchronised when its
      forward ran outside ``no_sync``.
    * Unused parameters. A parameter that received no gradient on this rank by
      the end of backward is marked ready then and contributes zeros, so its
      bucket still completes (a bucket holding it launches only at the end of
      backward, with every bucket after it, so the overlap shrinks). With the
      default ``find_unused_parameters=False`` every rank then holds the mean
      in ``p.grad``, zero where no rank used the parameter; an optimizer with
      momentum or weight decay moves such a parameter, which a single process
      (whose ``p.grad`` stays None) would not. ``find_unused_parameters=True``
      adds one small all-reduce per step counting, per parameter, the ranks
      that produced a gradient, and leaves ``p.grad`` None where the count is
      zero, exactly as a single process would.
    * ``overlap=False`` keeps the same buckets but launches them only at the end of
      backward, one after the other: the same calls and bytes as the default, nothing
      hidden behind backward. The pair measures what overlap alone is worth.
    * ``ddp.trace`` records the last synchronised step: when forward ended, when
      each bucket's all-reduce was launched, when backward ended, and when each
      wait started and ended (``time.perf_counter`` seconds; on a GPU the moments
      the GPU reached them, `StepClock`); ``trace=False`` records nothing.
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

        # Per-step state, reset when a synchronised backward starts.
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
        weakref.finalize(self, _remove_hooks, self._hook_handles)

    # ------------------------------------------------------------------ set-up
    @torch.no_grad()
    def _broadcast_module_states(self) -> None:
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            comms.broadcast(t.detach(), group=self.group, group_src=0)

    def remove_hooks(self) -> None:
        """Detach this DDP from the module's parameters (to wrap the module again)."""
        _remove_hooks(self._hook_handles)

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
        """First gradient of a synchronised backward: reset the step, queue the end-of-backward callback."""
        self._step_open = True
        self._pending = [set(range(len(b.params))) for b in self.buckets]
        self._next_bucket = 0
        self._work = [None] * len(self.buckets)
        self.trace = []
        if self._forward_end is not None:
            self._event("forward_end", at=self._forward_end)
            self._forward_end = None
        # Runs once the whole backward graph has been executed, before
        # backward() returns: the optimizer never sees unsynchronised gradients.
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
        # In bucket order only: collectives on a group must be issued in the
        # same order on every rank, whatever order gradients arrived in here.
        while self._next_bucket < len(self.buckets) and not self._pending[self._next_bucket]:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, i: int) -> None:
        b, flat = self.buckets[i], self._flat[i]
        for p, offset, numel in zip(b.params, b.offsets, b.numels):
            dst = flat[offset:offset + numel]  # (numel,) view of the flat buffer
            if p.grad is None:
                dst.zero_()  # unused on this rank: contributes nothing to the sum
            else:
                # Divide before summing, as PyTorch does: a half-precision sum of
                # N full gradients could overflow where the sum of g / N does not.
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
    def bucket_table(self) -> str:
        """The bucket layout as text (see `format_buckets`)."""
        return format_buckets(self.buckets)

    @property
    def bucket_nbytes(self) -> int:
        """Bytes of the flat communication buffers: one more copy of the trainable gradients."""
        return sum(f.numel() * f.element_size() for f in self._flat)

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, bucket_cap_mb={self.bucket_cap_mb}, "
                f"buckets={len(self.buckets)}, find_unused_parameters={self.find_unused_parameters}")
