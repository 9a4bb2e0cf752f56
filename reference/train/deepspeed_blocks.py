"""DeepSpeed's blocks of the trainer's configuration as plain dataclasses, with DeepSpeed's names
and defaults (docs/config-json): `optimizer`, `fp16`, `bf16`, `zero_optimization`,
`activation_checkpointing`. Keys DeepSpeed documents that have no effect here (ZeRO's bucket
sizes, `fp16.auto_cast`, ...) are accepted, so that a DeepSpeed file loads, and `describe`
lists each one set.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from reference.train.jsonconfig import spec

__all__ = ["OFFLOAD_REFUSED", "OPTIMIZERS", "OptimizerParams", "OptimizerConfig", "FP16Config", "BF16Config",
           "OffloadConfig", "ZeroConfig", "ActivationCheckpointingConfig"]

# Why zero_optimization.offload_optimizer is refused (`--check` and docs/trainer.md say it too).
OFFLOAD_REFUSED = ("zero_optimization.offload_optimizer (device {device!r}) is not implemented by this "
                   "trainer: the optimizer state and its step stay on each rank's device. DeepSpeed "
                   "would keep them, and the reduced gradients, in CPU memory and step there "
                   "(ZeRO-Offload); to train here, remove the block or set its device to \"none\"")

OPTIMIZERS = ("AdamW", "Adam", "SGD")
ADAM_KEYS, SGD_KEYS = ("betas", "eps", "adam_w_mode"), ("momentum",)


@dataclass
class OptimizerParams:
    """torch's keyword arguments; None is DeepSpeed's default: weight_decay 0 (its FusedAdam's,
    for "Adam" and "AdamW" alike; torch.optim.AdamW's is 0.01), the rest equal to torch's
    (lr 1e-3, betas (0.9, 0.999), eps 1e-8)."""
    lr: Optional[float] = spec(None, min=0.0)
    betas: Optional[tuple[float, float]] = None
    eps: Optional[float] = spec(None, min=0.0)
    weight_decay: Optional[float] = spec(None, min=0.0)
    momentum: Optional[float] = spec(None, min=0.0)   # SGD's
    adam_w_mode: Optional[bool] = None                 # DeepSpeed "Adam": true (default) = AdamW


@dataclass
class OptimizerConfig:
    type: str = spec("AdamW", choices=OPTIMIZERS)
    params: OptimizerParams = field(default_factory=OptimizerParams)

    def __post_init__(self):
        wrong = SGD_KEYS if self.type != "SGD" else ADAM_KEYS
        given = [k for k in wrong if getattr(self.params, k) is not None]
        if given:
            raise ValueError(f"optimizer.params.{given[0]}={getattr(self.params, given[0])!r} is not "
                             f"a parameter of {self.type!r}")

    def torch_class(self):
        import torch

        if self.type == "SGD":
            return torch.optim.SGD
        adam_w = self.type == "AdamW" or self.params.adam_w_mode is not False
        return torch.optim.AdamW if adam_w else torch.optim.Adam

    def kwargs(self) -> dict:
        """`torch_class()(params, **kwargs())`: the keys given, and DeepSpeed's weight_decay 0 if unset."""
        out = {k: getattr(self.params, k) for k in ("lr", "eps", "weight_decay", "momentum")
               if getattr(self.params, k) is not None}
        out.setdefault("weight_decay", 0.0)
        if self.params.betas is not None:
            out["betas"] = tuple(self.params.betas)
        return out


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = spec(0.0, min=0.0)            # 0 = dynamic; s > 0 a fixed scale s
    initial_scale_power: int = spec(16, min=0)         # the dynamic scale starts at 2^power
    loss_scale_window: int = spec(1000, min=1)        # clean steps before the scale doubles
    hysteresis: int = spec(2, min=1)                   # overflows in a row before it halves
    min_loss_scale: float = spec(1.0, min=0.0, exclusive=True)
    auto_cast: bool = False                            # DeepSpeed's; no effect here
    consecutive_hysteresis: bool = False               # refill the budget after every good step

    def scaler_kwargs(self) -> dict:
        """Keyword arguments of `reference.parallel.scaler.DynamicLossScaler`."""
        return dict(initial_scale_power=self.initial_scale_power, window=self.loss_scale_window,
                    hysteresis=self.hysteresis, min_scale=self.min_loss_scale,
                    static=self.loss_scale or None,
                    consecutive_hysteresis=self.consecutive_hysteresis)


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class OffloadConfig:
    device: str = spec("cpu", choices=("cpu", "nvme", "none"))
    pin_memory: bool = True


@dataclass
class ZeroConfig:
    stage: int = spec(0, choices=(0, 1, 2, 3))
    offload_optimizer: Optional[OffloadConfig] = None
    # DeepSpeed's tuning knobs, accepted so that a DeepSpeed file loads; no effect here
    overlap_comm: Optional[bool] = None
    contiguous_gradients: Optional[bool] = None
    reduce_scatter: Optional[bool] = None
    reduce_bucket_size: Optional[float] = None
    allgather_bucket_size: Optional[float] = None

    @property
    def offload(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.device != "none"


@dataclass
class ActivationCheckpointingConfig:
    enabled: bool = False                   # a block without "enabled" turns it on
    partition_activations: bool = False     # DeepSpeed's (split saved inputs over tp): see describe
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
