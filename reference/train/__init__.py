"""Training: the single-process run every parallel version is compared with, and the
workshop trainer that runs the 3D GPT from a JSON configuration.

    from reference.train import make_optimizer, train_step, evaluate, train   # one process

Where each part lives:

* `reference.train.single`: the single-process loop (`make_optimizer`, `train_step`,
  `evaluate`, `train`): AdamW on reproducible batches, the oracle of the parity tests.
  Importing this package loads only it (no `torch.distributed` code of the course);
* `reference.train.config`, `reference.train.loop`, `reference.train.checkpoint` and
  `python -m reference.train` (`__main__`): the workshop trainer (see the README's
  "Workshop" section).
"""
from reference.train.single import evaluate, make_optimizer, train, train_step

__all__ = ["make_optimizer", "train_step", "evaluate", "train"]
