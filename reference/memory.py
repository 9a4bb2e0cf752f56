"""Memory per rank of data parallelism and ZeRO: the paper's formulas, and the real bytes.

The ZeRO paper (Rajbhandari et al., 2020, section 3 and figure 1) counts, for a
model of Psi parameters trained with Adam on N data-parallel ranks, the bytes
each rank holds for the model states:

    bytes per parameter      params   grads   optimizer state (K)
    fp32 training              4        4      8   Adam's two moments
    mixed precision            2        2     12   fp32 master copy + two moments

    per rank                 params     grads      optimizer state
    plain data parallel      p Psi      g Psi      K Psi
    stage 1  (P_os)          p Psi      g Psi      K Psi / N
    stage 2  (P_os+g)        p Psi      g Psi / N  K Psi / N
    stage 3  (P_os+g+p)      p Psi / N  g Psi / N  K Psi / N

The paper's example: Psi = 7.5B, mixed precision, N = 64 gives 120 GB, 31.4 GB,
16.6 GB and 1.9 GB per rank. (Activations, buffers and temporary all-gathered
parameters are not model states and are not counted.)

An implementation shards flat buffers padded to a multiple of N (see
`reference.zero.shard`): a buffer of Psi numbers becomes N shards of
S = ceil(Psi / N), and what is kept whole is held as the padded P = N * S.
`model_state_bytes(..., units=...)` applies that padding, per flat buffer, so
that it equals exactly what `measure` finds in a live run; without padding
(every unit divisible by N) it is the paper's formula.

`measure(model, optimizer)` adds up the bytes of the distinct storages actually
held: parameters, their `.grad`, and the optimizer's state. A storage is counted
once, even when many tensors view it (ZeRO-1's module gradients and its shard
gradient share one buffer). Optimizer state of a parameter's own shape (Adam's
moments: the K of the formula) is `optimizer_state`; anything else (Adam's
`step` counter, one number per tensor) is reported apart as `other`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Precision", "MemoryBytes", "model_state_bytes", "measure", "human_bytes", "STAGE_NAMES"]

STAGE_NAMES = {0: "data parallel", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}


@dataclass(frozen=True)
class Precision:
    """Bytes held per parameter for its value, its gradient and its optimizer state (K)."""

    param: int
    grad: int
    optimizer: int

    @classmethod
    def fp32_adam(cls) -> "Precision":
        """fp32 weights and gradients, Adam's two fp32 moments: 4 + 4 + 8."""
        return cls(4, 4, 8)

    @classmethod
    def mixed_adam(cls) -> "Precision":
        """bf16/fp16 weights and gradients; fp32 master weights and moments: 2 + 2 + 12."""
        return cls(2, 2, 12)

    @classmethod
    def fp32_sgd_momentum(cls) -> "Precision":
        """fp32 weights and gradients, one momentum buffer: 4 + 4 + 4."""
        return cls(4, 4, 4)


@dataclass(frozen=True)
class MemoryBytes:
    """Bytes per rank, by kind. `other` is bookkeeping outside the formula (step counters)."""

    params: int
    grads: int
    optimizer_state: int
    other: int = 0

    @property
    def model_states(self) -> int:
        """params + grads + optimizer_state: what the ZeRO formula counts."""
        return self.params + self.grads + self.optimizer_state

    @property
    def total(self) -> int:
        return self.model_states + self.other

    def __str__(self) -> str:
        return (f"params {human_bytes(self.params)}, grads {human_bytes(self.grads)}, "
                f"optimizer state {human_bytes(self.optimizer_state)} "
                f"(model states {human_bytes(self.model_states)})")


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def model_state_bytes(num_params: int, dp: int, stage: int,
                      precision: Precision | None = None,
                      units: Sequence[int] | None = None) -> MemoryBytes:
    """The ZeRO formula: bytes per rank of `num_params` parameters over `dp` ranks at `stage`.

    `stage` 0 is plain data parallelism, 1 to 3 the ZeRO stages. `precision`
    defaults to fp32 Adam (4 + 4 + 8). `units` lists the numel of each flat
    buffer sharded separately (FSDP: one per block; ZeRO-1/2: one buffer of all
    parameters): each is padded to a multiple of `dp`. Without `units` the
    count is the paper's: one buffer, and exact when `dp` divides `num_params`.
    """
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0 (data parallel), 1, 2 or 3, got {stage!r}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params!r}")
    precision = precision or Precision.fp32_adam()
    if units is None:
        units = [num_params]
    if sum(units) != num_params:
        raise ValueError(f"units {list(units)} add up to {sum(units)}, not num_params={num_params}")
    shard = sum(-(-u // dp) for u in units)  # S: this rank's share, padding included
    padded = dp * shard                      # P: a sharded buffer held whole
    if stage == 0:  # nothing flattened, nothing padded
        return MemoryBytes(precision.param * num_params, precision.grad * num_params,
                           precision.optimizer * num_params)
    return MemoryBytes(
        params=precision.param * (shard if stage >= 3 else padded),
        grads=precision.grad * (shard if stage >= 2 else padded),
        optimizer_state=precision.optimizer * shard,
    )


# ---------------------------------------------------------------------------- measured

def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


def _optimizers(obj) -> list[torch.optim.Optimizer]:
    if obj is None:
        return []
    if isinstance(obj, torch.optim.Optimizer):
        return [obj]
    inner = getattr(obj, "optimizer", None)  # ZeroOptimizer and other wrappers
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    if isinstance(obj, Iterable):
        return [o for x in obj for o in _optimizers(x)]
    raise TypeError(f"expected an optimizer (or a wrapper with .optimizer), got {type(obj).__name__}")


def measure(model: torch.nn.Module | Iterable[torch.Tensor], optimizer=None) -> MemoryBytes:
    """Bytes this process holds for `model`'s parameters and gradients and `optimizer`'s state.

    `model`: a module (every `nn.Parameter` registered anywhere in it, FSDP's
    shards and the module's own, whole or freed) or an iterable of tensors.
    `optimizer`: a torch optimizer, a `ZeroOptimizer`, or a list of them; its
    parameters count as parameters too. Each storage is counted once, under the
    first kind it is found in (params, then grads, then state).
    """
    if isinstance(model, torch.nn.Module):
        params = [p for m in model.modules() for p in m._parameters.values() if p is not None]
    else:
        params = list(model)
    optimizers = _optimizers(optimizer)
    for opt in optimizers:
        params += [p for g in opt.param_groups for p in g["params"]]

    seen: set = set()

    def add(tensors) -> int:
        total = 0
        for t in tensors:
            key = _storage_key(t)
            if key[1] == 0 or key in seen:  # freed (FSDP) or already counted
                continue
            seen.add(key)
            total += key[2]
        return total

    param_bytes = add(params)
    grad_bytes = add(p.grad for p in params if p.grad is not None)
    shaped, other = [], []
    for opt in optimizers:
        for p, state in opt.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    (shaped if value.shape == p.shape else other).append(value)
    return MemoryBytes(param_bytes, grad_bytes, add(shaped), add(other))
