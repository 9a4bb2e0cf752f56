"""How DDP groups gradients into buckets: the layout alone, no processes needed.

One all-reduce per parameter pays the per-call latency (the alpha of the
alpha-beta cost model) dozens of times per step; one all-reduce of every
gradient at the end cannot start before backward ends. Buckets sit in between: a few
flat buffers of at most `cap_bytes`, each all-reduced as soon as its gradients are ready.
Backward produces the last layers' gradients first, so buckets are filled walking the
parameters backwards: bucket 0 holds the last layers, the last bucket the embeddings.

PyTorch's DDP differs in three ways (notebook 01 measures them side by side): it closes a
bucket once it has reached the cap, so a bucket may pass the cap by one tensor; its 1 MiB first
bucket applies only when `bucket_cap_mb` is left at its default; and it rebuilds its buckets
after the first iteration in the order the gradients arrived. The course keeps one layout,
each bucket under its cap, planned from the registration order.

    buckets = plan_buckets(model.named_parameters(), cap_bytes=2**20)
    print(format_buckets(buckets))
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "plan_buckets", "format_buckets"]


@dataclass
class Bucket:
    """One flat buffer's worth of gradients: `names[k]` lives in ``offsets[k] : offsets[k] + numels[k]``."""

    index: int
    names: list[str] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    params: list[torch.nn.Parameter] = field(default_factory=list, repr=False)
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def _add(self, name: str, param: torch.nn.Parameter) -> None:
        self.offsets.append(self.numel)
        self.names.append(name)
        self.numels.append(param.numel())
        self.params.append(param)


def plan_buckets(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 cap_bytes: int, first_cap_bytes: int | None = None) -> list[Bucket]:
    """Group the trainable parameters into buckets of at most `cap_bytes`, last parameter first.

    `first_cap_bytes` (default: `cap_bytes`) caps bucket 0 alone: a small first bucket, as
    PyTorch's 1 MiB, starts communication as soon as the last layers' gradients exist. A cap of 0
    gives every parameter its own bucket, as does a parameter larger than the cap. Frozen
    parameters get none; a bucket, one flat tensor, holds one dtype on one device.
    """
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    for name, value in (("cap_bytes", cap_bytes), ("first_cap_bytes", first_cap_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (0: one bucket per parameter), got {value!r}")
    trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
    buckets: list[Bucket] = []
    current: Bucket | None = None
    for name, p in reversed(trainable):
        if p.layout != torch.strided:
            raise ValueError(f"parameter {name!r} has layout {p.layout}; DDP buckets hold dense tensors only")
        size = p.numel() * p.element_size()
        cap = first_cap_bytes if current is not None and current.index == 0 else cap_bytes
        starts_new = (
            current is None
            or p.dtype != current.dtype
            or p.device != current.device
            or (current.params and (cap == 0 or current.nbytes + size > cap))
        )
        if starts_new:
            current = Bucket(index=len(buckets), dtype=p.dtype, device=p.device)
            buckets.append(current)
        current._add(name, p)
    return buckets


def format_buckets(buckets: list[Bucket]) -> str:
    """A text table of the layout: one line per bucket, its bytes and its parameters."""
    if not buckets:
        return "(no trainable parameters: no buckets)"
    return "\n".join(f"bucket {b.index}: {b.nbytes:>12,} bytes  {len(b.names):>3} params  "
                     f"[{', '.join(b.names)}]" for b in buckets)
