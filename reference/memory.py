"""Memory per rank of data parallelism and ZeRO: the paper's formulas, and the real bytes.

The ZeRO paper (Rajbhandari et al., 2020, section 3 and figure 1) counts, for a
model of Psi parameters trained with Adam on N data-parallel ranks, the bytes
each rank holds for the model states:

    bytes per parameter      params   grads   optimizer state (K)
    fp32 training              4        4      8   Adam's two moments
    mixed precision            2        2     12   fp32 master copy + two moments
    ... optimizer offloaded    2        0      0   on the device: the reduced gradients and
                                                the 12 bytes live on the CPU (ZeRO-Offload)

    per rank                 params     grads      optimizer state
    plain data parallel      p Psi      g Psi      K Psi
    stage 1  (P_os)          p Psi      g Psi      K Psi / N
    stage 2  (P_os+g)        p Psi      g Psi / N  K Psi / N
    stage 3  (P_os+g+p)      p Psi / N  g Psi / N  K Psi / N

The paper's example: Psi = 7.5B, mixed precision, N = 64 gives 120 GB, 31.4 GB, 16.6 GB and
1.9 GB per rank. Activations, buffers and temporary all-gathered parameters are not model states.

An implementation shards flat buffers padded to a multiple of N (`reference.zero.shard`): a
buffer of Psi numbers becomes N shards of S = ceil(Psi / N), and one kept whole holds the padded
P = N * S. `model_state_bytes(..., units=...)` applies that padding so that it equals what
`measure` finds in a live run. The table is what a rank holds between steps; inside a step the
gradients peak higher (`zero_peak_grad_bytes`). `PeakMemory` measures a peak, `SavedBytes` what
autograd saves for backward (a pipeline stage's or a context-parallel rank's activations).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Precision", "MemoryBytes", "model_state_bytes", "measure", "human_bytes", "STAGE_NAMES",
           "zero_peak_grad_bytes", "PeakMemory", "SavedBytes"]

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
    def mixed_adam_offload(cls) -> "Precision":
        """Device bytes of mixed-precision Adam with the optimizer offloaded to the CPU (ZeRO-Offload):
        2 + 0 + 0. Each gradient, once reduced, is copied to host memory, where the step runs."""
        return cls(2, 0, 0)

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


def _check_counts(num_params: int, dp: int) -> None:
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params!r}")


def model_state_bytes(num_params: int, dp: int, stage: int,
                      precision: Precision | None = None,
                      units: Sequence[int] | None = None) -> MemoryBytes:
    """The ZeRO formula: bytes per rank of `num_params` parameters over `dp` ranks at `stage` (0: plain
    data parallelism), fp32 Adam by default. `units`: the numel of each flat buffer sharded
    separately (FSDP: one per block; ZeRO-1/2: one of all parameters), each padded; default one."""
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0 (data parallel), 1, 2 or 3, got {stage!r}")
    _check_counts(num_params, dp)
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


def zero_peak_grad_bytes(num_params: int, dp: int, stage: int, bucket_numel: int | None = None,
                         grad_bytes: int = 4) -> int:
    """Peak bytes of gradient a rank of `ZeroOptimizer` holds through backward and step, with
    S = ceil(Psi / N) and P = N * S:

    * stage 1, g (P + S): the full gradient buffer (the module's `.grad` are views of it) and
      the (S,) output of the reduce-scatter in `step()`;
    * stage 2, g (S + B): its shard and the one bucket of B numbers being reduce-scattered during
      backward (`bucket_numel`, the largest bucket; default P, a single bucket).

    Autograd's own working memory (the gradient not yet copied into the bucket, the activations'
    gradients) is not counted. Reducing everything once after backward would hold about g (2P + S).
    """
    if stage not in (1, 2):
        raise ValueError(f"zero_peak_grad_bytes covers ZeroOptimizer's stages 1 and 2, got stage={stage!r}")
    _check_counts(num_params, dp)
    shard = -(-num_params // dp)  # S
    padded = dp * shard           # P
    if stage == 1:
        return grad_bytes * (padded + shard)
    bucket = padded if bucket_numel is None else bucket_numel
    if not 0 < bucket <= padded:
        raise ValueError(f"bucket_numel must be in 1..P={padded} (the padded flat buffer), "
                         f"got {bucket_numel!r}")
    return grad_bytes * (shard + bucket)


class PeakMemory(TorchDispatchMode):
    """The most bytes alive at once among the tensors created inside the block.

        with memory.PeakMemory() as peak:
            loss.backward()
            optimizer.step()
        peak.peak_bytes     # the maximum, over the block, of the bytes below
        peak.live_bytes     # bytes created in the block and still alive

    A dispatch mode sees every operator in the block (forward, backward, optimizer, collectives):
    a result whose storage is new (not an input's, as views and in-place results are) counts
    until that storage is freed. What existed before the block never counts, and memory an
    operator takes and gives back inside itself (a kernel's workspace) is not seen.

    `also`, a function returning bytes, adds memory no operator creates (FSDP's units, regrown in
    place by `gather()`): sampled after every operator, it joins the peak, and `peak_parts` gives
    (new tensors, `also`) at that moment.
    """

    def __init__(self, also: Callable[[], int] | None = None):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_parts = (0, 0)
        self._also = also
        self._alive: dict[tuple[str, int], weakref.ref] = {}

    def _freed(self, key, nbytes, _ref=None) -> None:
        self.live_bytes -= nbytes
        self._alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t)[:2] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = _storage_key(t)[:2]   # (device, address)
            nbytes = storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._alive:
                continue
            # The callback runs when the storage itself is freed, whatever tensors viewed it.
            self._alive[key] = weakref.ref(storage, lambda ref, key=key, n=nbytes: self._freed(key, n, ref))
            self.live_bytes += nbytes
        also = self._also() if self._also is not None else 0
        if self.live_bytes + also > self.peak_bytes:
            self.peak_bytes, self.peak_parts = self.live_bytes + also, (self.live_bytes, also)
        return out


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward inside the block. Parameters are
    left out, being stored whatever the schedule (`param_ptrs`, and ``params`` looked up as each
    tensor is saved: ZeRO-3 frees and regathers their storage between actions), and so is
    ``exclude`` (counted elsewhere)."""

    def __init__(self, param_ptrs: set, exclude: Sequence[torch.Tensor] = (), params=None):
        self.skip = set(param_ptrs) | {t.untyped_storage().data_ptr() for t in exclude}
        self.params = params
        self.storages: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.data_ptr() in self.skip or (self.params is not None and st.data_ptr() in
                                          {p.untyped_storage().data_ptr() for p in self.params}):
            return
        self.storages[st.data_ptr()] = st.nbytes()

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        def pack(t):
            self.add(t)
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


def _optimizers(obj) -> list[torch.optim.Optimizer]:
    if obj is None:
        return []
    if isinstance(obj, torch.optim.Optimizer):  # ZeroOptimizer too: its groups and state are its inner's
        return [obj]
    inner = getattr(obj, "optimizer", None)  # other wrappers
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    if isinstance(obj, Iterable):
        return [o for x in obj for o in _optimizers(x)]
    raise TypeError(f"expected an optimizer (or a wrapper with .optimizer), got {type(obj).__name__}")


def measure(model: torch.nn.Module | Iterable[torch.Tensor], optimizer=None) -> MemoryBytes:
    """Bytes this process holds for `model`'s parameters and gradients and `optimizer`'s state.

    `model`: a module (every `nn.Parameter` registered in it, FSDP's shards included) or tensors;
    `optimizer`: a torch optimizer, a `ZeroOptimizer` or a list of them, whose parameters count
    too. Each storage counts once (ZeRO-1's module gradients view its shard's buffer), under the
    first kind it is found in: params, grads, then state of a parameter's shape (Adam's moments,
    the K), then `other` (Adam's `step`).
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
