"""Training: the single-process run every parallel version is compared with, and the
workshop trainer that runs the 3D GPT from a JSON configuration.

    from reference.train import make_optimizer, train_step, evaluate, train   # one process

Where each part lives:

* `reference.train.single`: the single-process loop (`make_optimizer`, `train_step`,
  `evaluate`, `train`): AdamW on reproducible batches, the oracle of the parity tests.
  Importing this package loads only it (no `torch.distributed` code of the course);
* `reference.train.config`, `reference.train.loop`, `reference.train.checkpoint` and
  `python -m reference.train` (`__main__`): the workshop trainer (see the README's
  "Workshop" section). The configuration's parts: `reference.train.jsonconfig` (plain
  dataclasses from JSON, every error naming its dotted key), `reference.train.deepspeed_blocks`
  (DeepSpeed's blocks), `reference.train.lr_schedules` (DeepSpeed's WarmupLR, WarmupDecayLR,
  WarmupCosineLR as a LambdaLR) and `reference.train.describe` (what a configuration means
  on N ranks, and what in it is pointless). The run's parts: `reference.train.settings`
  (`RunPlan`, a configuration resolved at one world size), `reference.train.loop` (what
  each rank runs), `reference.train.parity` (a run's losses against one process) and
  `reference.train.plot` (loss and throughput curves from the JSONL log). Checkpoints:
  `reference.train.checkpoint` (on torch.distributed.checkpoint),
  `reference.train.checkpoint_publish` (the atomic publish every rank agrees on, and whether
  a folder can take a save at all), `reference.train.checkpoint_groups` (the optimizer's
  hyper-parameters and the schedule stored by parameter name, rebuilt for any layout's groups),
  `reference.train.checkpoint_shards` (each rank saves and loads only the boxes of the whole
  tensors it holds, with DCP planners for those boxes) and `reference.train.reshard` (the training state without its layout, and back: any
  (dp, tp, pp, ZeRO) layout loads any checkpoint).
"""
from reference.train.single import evaluate, make_optimizer, train, train_step

__all__ = ["make_optimizer", "train_step", "evaluate", "train"]
