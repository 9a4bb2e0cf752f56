"""Golden losses: the debug run's first steps by one process, committed, so a numerical change shows.

    python -m reference.train.golden            # recompute, compare with the file, exit 1 if shifted
    python -m reference.train.golden --write    # regenerate tests/golden/debug_3d_losses.json

The debug run (`reference.parallel.golden`: its model, configuration, data and its 8-rank run) is
trained here by the oracle, `reference.train.single.accumulated_step`, accumulating gradients over
the 4 chunks `ParallelConfig.debug_3d()` splits each batch into. The test suite runs the debug
configuration on 8 ranks, which must reproduce these losses within `reference.tolerance.loss()`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from reference.model import GPT
from reference.parallel.golden import CONFIG, LR, MODEL, STEPS, debug_batches
from reference.tolerance import loss
from reference.train.single import accumulated_step

__all__ = ["GOLDEN_PATH", "single_process_losses", "read_golden"]

GOLDEN_PATH = Path(__file__).resolve().parents[2] / "tests" / "golden" / "debug_3d_losses.json"


def single_process_losses(steps: int = STEPS, chunks: int = CONFIG.dp * CONFIG.microbatches) -> list[float]:
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return [accumulated_step(model, opt, idx, tgt, chunks)[0] for idx, tgt in debug_batches(steps)]


def read_golden(path: Path = GOLDEN_PATH) -> list[float]:
    return json.loads(path.read_text())["losses"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference.train.golden", description=__doc__.split("\n")[0])
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
