"""`RunPlan`: a `TrainConfig` (``plan.config``) resolved at one world size for the loop and the
parity check: the global batch (`train_batch_size`), the micro-batch and the accumulation steps."""
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

    @property
    def seq_len(self) -> int:
        return self.config.seq_len()


def settings(config, world_size: int) -> RunPlan:
    return RunPlan(config, world_size)
