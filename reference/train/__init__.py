"""Training: the single-process run every parallel version is compared with, and the
workshop trainer that runs the 3D GPT from a JSON configuration.

    from reference.train import make_optimizer, train_step, evaluate, train   # one process

Where each part lives (modules of `reference.train`):

* `single`: the single-process loop (`make_optimizer`, `train_step`, `evaluate`, `train`):
  AdamW on reproducible batches, the oracle of the parity tests. Importing this package loads
  only it (no `torch.distributed` code of the course);
* the workshop trainer, `python -m reference.train` (`__main__`; the README's "Workshop"
  section): `config` (the JSON configuration), `jsonconfig` (plain dataclasses from JSON, every
  error naming its dotted key), `deepspeed_blocks` (DeepSpeed's blocks), `lr_schedules`
  (DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR as a LambdaLR), `describe` (what a
  configuration means on N ranks, and what in it is pointless), `settings` (`RunPlan`, a
  configuration resolved at one world size), `loop` (what each rank runs), `parity` (a run's
  losses against one process) and `plot` (loss and throughput curves from the JSONL log);
* checkpoints on torch.distributed.checkpoint: `checkpoint`, `checkpoint_publish` (the atomic
  publish every rank agrees on, and whether a folder can take a save at all),
  `checkpoint_groups` (the optimizer's hyper-parameters and the schedule stored by parameter
  name, rebuilt for any layout's groups), `checkpoint_shards` (each rank saves and loads only
  the boxes of the whole tensors it holds, with DCP planners for them) and `reshard` (the
  training state without its layout): any (dp, tp, pp, ZeRO) layout loads any checkpoint.
"""
from reference.train.single import evaluate, make_optimizer, train, train_step

__all__ = ["make_optimizer", "train_step", "evaluate", "train"]
