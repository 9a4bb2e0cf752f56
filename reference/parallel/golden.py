"""Golden losses: the debug configuration's first steps, committed, so a numerical change shows.

    python -m reference.parallel.golden            # recompute, compare with the file, exit 1 if shifted
    python -m reference.parallel.golden --write    # regenerate tests/golden/debug_3d_losses.json

The debug run: `GPTConfig.tiny(n_layer=4)`, AdamW, 20 steps of 8 sequences of 32 bytes of a
fixed arithmetic text, trained by one process that accumulates gradients over the 4 chunks
`ParallelConfig.debug_3d()` splits each batch into. The test suite runs the debug
configuration on 8 ranks, which must reproduce these losses within `reference.tolerance.loss()`."""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from reference.model import GPT, GPTConfig
from reference.parallel.config import ParallelConfig
from reference.tolerance import loss

__all__ = ["MODEL", "CONFIG", "STEPS", "BATCH", "debug_text", "debug_batches",
           "single_process_losses", "parallel_losses", "GOLDEN_PATH", "debug_data", "text_windows"]

MODEL = GPTConfig.tiny(n_layer=4)          # block_size 32, 4 heads, C = 32
CONFIG = ParallelConfig.debug_3d()         # dp 2 x tp 2 x pp 2, SP, 1F1B over 2 micro-batches
STEPS, BATCH, LR = 20, (8, 32), 3e-3
GOLDEN_PATH = Path(__file__).resolve().parents[2] / "tests" / "golden" / "debug_3d_losses.json"


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


def single_process_losses(steps: int = STEPS, chunks: int = CONFIG.dp * CONFIG.microbatches) -> list[float]:
    from reference.train.single import accumulated_step

    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return [accumulated_step(model, opt, idx, tgt, chunks)[0] for idx, tgt in debug_batches(steps)]


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


def read_golden(path: Path = GOLDEN_PATH) -> list[float]:
    return json.loads(path.read_text())["losses"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference.parallel.golden", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate the golden file")
    parser.add_argument("--path", type=Path, default=GOLDEN_PATH)
    args = parser.parse_args(argv)
    losses = single_process_losses()
    if args.write:
        args.path.parent.mkdir(parents=True, exist_ok=True)
        args.path.write_text(json.dumps({
            "what": "single-process losses of reference.parallel.golden's debug run",
            "model": "GPTConfig.tiny(n_layer=4)", "config": str(CONFIG), "steps": STEPS,
            "losses": losses}, indent=1) + "\n")
        print(f"wrote {args.path}: {STEPS} losses, {losses[0]:.4f} -> {losses[-1]:.4f}")
        return 0
    golden = read_golden(args.path)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, golden))
    tol = loss()
    print(f"largest relative difference from {args.path.name}: {worst:.2e} (tolerance: {tol.summary()})")
    ok = len(golden) == len(losses) and all(tol.allows(a - b, b) for a, b in zip(losses, golden))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
