"""`RunPlan`: what the loop needs from a `TrainConfig` at one world size, resolved once.

The loop, the parity check and the ranks read only this: the model and its layout, the global
batch B (DeepSpeed's `train_batch_size`, whatever pair of the three batch keys the file gave),
the optimizer class and its arguments, the schedule, fp16's scaler settings, the data, the
checkpoint folder and the log. It pickles to the ranks with the configuration inside.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunPlan", "settings"]


@dataclass
class RunPlan:
    config: object      # the TrainConfig
    world_size: int
    log_prepared: bool = False   # the caller has already made the log ready (`prepare_log`)

    def __post_init__(self):
        self.train_batch_size, self.micro_batch, self.accumulation = \
            self.config.batch_sizes(self.world_size)

    # the model and its layout
    def parallel_config(self, world_size=None):
        return self.config.parallel_config(world_size or self.world_size)

    def gpt_config(self):
        return self.config.gpt_config()

    def ffn_factory(self):
        return self.config.ffn_factory()

    # optimisation
    @property
    def optimizer_class(self):
        return self.config.optimizer.torch_class()

    @property
    def optimizer_kwargs(self) -> dict:
        return self.config.optimizer.kwargs()

    def make_scheduler(self, optimizer):
        from reference.train.lr_schedules import make_scheduler

        return make_scheduler(optimizer, self.config)

    @property
    def gradient_clipping(self):
        return self.config.gradient_clipping or None  # 0 = off

    def loss_scaler_kwargs(self) -> dict:
        return self.config.fp16.scaler_kwargs()

    # data, length, seeds
    @property
    def seq_len(self) -> int:
        return self.config.seq_len()

    @property
    def data_source(self) -> str:
        return self.config.data.source

    @property
    def data_seed(self) -> int:
        return self.config.data.seed

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def steps(self) -> int:
        return self.config.steps

    # checkpoints and logs
    @property
    def checkpoint_dir(self):
        return self.config.checkpoint.dir

    @property
    def checkpoint_every(self) -> int:
        return self.config.checkpoint.every

    @property
    def resume_if_possible(self) -> bool:
        """`checkpoint.resume: true`: continue from the latest checkpoint when there is one."""
        return bool(self.config.checkpoint.resume)

    @property
    def log_path(self):
        return self.config.log.path

    @property
    def log_every(self) -> int:
        return self.config.log.every

    @property
    def sample_tokens(self) -> int:
        return self.config.log.sample_tokens


def settings(config, world_size: int) -> RunPlan:
    return RunPlan(config, world_size)
