"""Data parallelism: every rank holds the whole model and a slice of the batch.

    from reference.data_parallel import DDP, naive_all_reduce_gradients
    model = DDP(GPT(config).to(device()), bucket_cap_mb=1)   # inside a rank; device from reference.runtime
    loss = lm_loss(model(idx), targets); loss.backward()   # buckets all-reduced during backward

Where each part lives:

* `reference.data_parallel.ddp`: `naive_all_reduce_gradients` (one blocking
  all-reduce per gradient, after backward) and `DDP` (gradients packed into
  buckets, each bucket all-reduced asynchronously from inside backward, `no_sync`
  for gradient accumulation, an overlap trace of each step);
* `reference.data_parallel.buckets`: how gradients are grouped into buckets, the
  layout alone (`plan_buckets`, `format_buckets`), testable without processes;
* `reference.data_parallel.compression`: sending fewer bytes per step:
  `CompressedDDP` (buckets all-reduced in bf16, half the bytes), PyTorch's DDP
  comm hooks measured with `metered_comm_hook` (bf16, PowerSGD's low-rank
  P and Q), `powersgd_bytes`, PowerSGD's bytes per step, and
  `gpt_gradient_shapes`, a GPT's gradient shapes without building it;
* `reference.data_parallel.device`: the wrapped module must sit on the device its
  process group communicates (`reference.runtime.device()`: the GPU under NCCL,
  the CPU under gloo), and the step's clock on that device (CUDA events on a GPU,
  where ``work.wait()`` returns before the all-reduce has run);
* `reference.data_parallel.viz`: one step drawn, the overlap of all-reduces with
  backward from a real trace, and why data parallelism alone stops scaling.

Per step a rank sends 2(N-1)/N times the gradient bytes, in one call per bucket;
every collective goes through `reference.comms`, so a meter counts it. Pictures
are imported from `reference.data_parallel.viz` (matplotlib stays out of the ranks).
"""
from reference.data_parallel.buckets import Bucket, format_buckets, plan_buckets
from reference.data_parallel.compression import (
    CompressedDDP, PowerSGDBytes, gpt_gradient_shapes, metered_comm_hook, powersgd_bytes,
)
from reference.data_parallel.ddp import DDP, naive_all_reduce_gradients

__all__ = [
    "naive_all_reduce_gradients", "DDP", "Bucket", "plan_buckets", "format_buckets",
    "CompressedDDP", "metered_comm_hook", "powersgd_bytes", "PowerSGDBytes", "gpt_gradient_shapes",
]
