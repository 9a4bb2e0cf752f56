"""Training: the single-process run every parallel version is compared with, and the
workshop trainer that runs the 3D GPT from a JSON configuration.

    from reference.train import make_optimizer, train_step, evaluate, train   # one process

* `single`: the single-process loop, the oracle of the parity tests; importing this package
  loads only it;
* the workshop trainer, `python -m reference.train` (`__main__`; docs/trainer.md):
  `config` (the JSON configuration), `jsonconfig` (dataclasses from JSON, errors naming the
  dotted key), `deepspeed_blocks`, `lr_schedules` (DeepSpeed's schedules as a LambdaLR),
  `describe` (what a configuration means on N ranks), `settings` (`RunPlan`, a configuration at
  one world size), `loop` (what each rank runs), `parity` (a run's losses against one process)
  and `plot` (curves from the JSONL log); `golden`, the debug run's committed losses by one
  process; `dualpipe`, DualPipeV's pairs
  overlapped (`reference.pipeline_parallel.overlap`) against the same pairs one after the other and
  ZB-V, with experts and the all-to-all as long as the MLP;
* checkpoints on torch.distributed.checkpoint that any layout loads: `checkpoint`,
  `checkpoint_publish` (the atomic publish), `checkpoint_groups` (param groups by parameter
  name), `checkpoint_shards` (each rank's boxes) and `reshard` (the state without its layout).
"""
from reference.train.single import evaluate, make_optimizer, train, train_step

__all__ = ["make_optimizer", "train_step", "evaluate", "train"]
