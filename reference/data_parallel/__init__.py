"""Data parallelism: every rank holds the whole model and a slice of the batch.

    from reference.data_parallel import DDP, naive_all_reduce_gradients
    model = DDP(GPT(config).to(device()), bucket_cap_mb=1)   # inside a rank; device from reference.runtime
    logits, loss = model(idx, targets); loss.backward()     # buckets all-reduced during backward

Where each part lives:

* `reference.data_parallel.ddp`: `naive_all_reduce_gradients` and `DDP` (buckets
  all-reduced from inside backward, `no_sync`, an overlap trace of each step);
* `reference.data_parallel.buckets`: the bucket layout alone (`plan_buckets`,
  `format_buckets`), testable without processes;
* `reference.data_parallel.compression`: fewer bytes per step: `CompressedDDP`
  (bf16 buckets), PyTorch's comm hooks measured (`metered_comm_hook`),
  `powersgd_bytes`, `gpt_gradient_shapes`;
* `reference.data_parallel.device`: the device the wrapped module must sit on,
  and the step's clock on that device;
* `reference.data_parallel.viz`: one step drawn, the overlap of all-reduces with
  backward from a real trace, and why data parallelism alone stops scaling
  (imported from there: matplotlib stays out of the ranks).
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
