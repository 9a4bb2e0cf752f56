"""The debug run, whose first losses are committed as golden losses (`reference.train.golden`).

The debug run: `GPTConfig.tiny(n_layer=4)`, AdamW, 20 steps of 8 sequences of 32 bytes of a
fixed arithmetic text, trained by one process that accumulates gradients over the 4 chunks
`ParallelConfig.debug_3d()` splits each batch into. The test suite runs the debug
configuration on 8 ranks (`parallel_losses`), which must reproduce the single process's losses,
committed in tests/golden/debug_3d_losses.json, within `reference.tolerance.loss()`.
The single process and the file live one layer up, in `reference.train.golden`, beside the oracle."""
from __future__ import annotations

import functools

import torch

from reference.model import GPT, GPTConfig
from reference.parallel.config import ParallelConfig

__all__ = ["MODEL", "CONFIG", "STEPS", "BATCH", "LR", "debug_text", "debug_batches", "parallel_losses",
           "debug_data", "text_windows"]

MODEL = GPTConfig.tiny(n_layer=4)          # block_size 32, 4 heads, C = 32
CONFIG = ParallelConfig.debug_3d()         # dp 2 x tp 2 x pp 2, SP, 1F1B over 2 micro-batches
STEPS, BATCH, LR = 20, (8, 32), 3e-3


def debug_text() -> bytes:
    """Sums written out ("17+25=42;"): structure a tiny model learns within 20 steps."""
    return "".join(f"{i}+{j}={i + j};" for i in range(60) for j in range(0, 60, 7)).encode()


@functools.lru_cache(maxsize=1)
def debug_data() -> torch.Tensor:
    """`debug_text` as int64 token ids (built once per process)."""
    return torch.tensor(list(debug_text()), dtype=torch.int64)


def text_windows(B: int, T: int, generator: torch.Generator):
    """B windows of T + 1 tokens of `debug_data` at offsets drawn from ``generator``:
    (inputs, targets), each (B, T)."""
    data = debug_data()
    starts = torch.randint(0, len(data) - T - 1, (B,), generator=generator)
    windows = torch.stack([data[s: s + T + 1] for s in starts.tolist()])  # (B, T + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def debug_batches(steps: int = STEPS, batch=BATCH):
    """The same global batches on every process: windows at offsets drawn from a fixed seed."""
    g = torch.Generator().manual_seed(2024)
    return [text_windows(*batch, g) for _ in range(steps)]


def parallel_losses(config: ParallelConfig = CONFIG, steps: int = STEPS) -> list[float]:
    """Inside every rank of a launch of config.world_size ranks: the debug run, in parallel."""
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from reference.runtime import device

    torch.manual_seed(0)
    mesh = config.mesh().build_groups()
    pm = parallelize(GPT(MODEL).to(device()), mesh, config, batch=BATCH)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR)
    return [float(train_step(pm, opt, idx, tgt).loss) for idx, tgt in debug_batches(steps)]
