"""python -m reference.train: the workshop trainer (and `plot`, `parity` for its logs).

    python -m reference.train --config configs/debug_3d.json --world-size 8     # a laptop
    torchrun --standalone --nproc_per_node 8 -m reference.train --config configs/debug_3d.json
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \\
        -m reference.train --config configs/debug_3d.json                       # two nodes
    python -m reference.train --config configs/article_ds_config.json --check \\
        --world-size 8 --tensor 2 --pipeline 4                                  # explain, no training
    python -m reference.train plot runs/debug_3d.jsonl --out loss.png
    python -m reference.train parity runs/debug_3d.jsonl --config configs/debug_3d.json --world-size 8

Standalone, the trainer starts its own gloo ranks (`--world-size N`); under torchrun it joins
torchrun's process group, on one node or many. Flags override the configuration's keys
(`--set KEY=VALUE` for any dotted key).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m reference.train",
                                description="Train the 3D-parallel GPT from a JSON configuration.")
    p.add_argument("--config", required=True, type=Path, help="the JSON configuration")
    p.add_argument("--world-size", type=int, help="ranks to start (standalone; torchrun sets it)")
    p.add_argument("--check", action="store_true", help="explain the configuration and stop")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--tensor", type=int, help="parallelism.tensor")
    p.add_argument("--pipeline", type=int, help="parallelism.pipeline")
    p.add_argument("--expert", type=int, help="parallelism.expert")
    p.add_argument("--steps", type=int, help="steps")
    p.add_argument("--log-file", help="log.path (JSONL)")
    p.add_argument("--checkpoint-dir", help="checkpoint.dir")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any dotted key, e.g. --set optimizer.params.lr=1e-3")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a hung run is stopped")
    return p


def _overrides(args) -> dict:
    """The configuration's keys that the flags given and each ``--set KEY=VALUE`` override."""
    flags = (("tensor", "parallelism.tensor"), ("pipeline", "parallelism.pipeline"),
             ("expert", "parallelism.expert"), ("steps", "steps"), ("log_file", "log.path"),
             ("checkpoint_dir", "checkpoint.dir"))
    out = {key: getattr(args, flag) for flag, key in flags if getattr(args, flag, None) is not None}
    for item in args.set:
        if "=" not in item:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _follow(log: Path, total: int, start: int, stop: threading.Event) -> None:
    """The caller's progress bar, fed by rank 0's log (a rank's own output shows only after the run)."""
    from tqdm.auto import tqdm

    from reference.train.loop import show_progress

    bar = tqdm(total=total, initial=start, desc="training", unit="step", dynamic_ncols=True)
    seen = 0
    while not stop.is_set() or log.exists():
        lines = log.read_text().splitlines() if log.exists() else []
        for line in lines[seen:]:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line being written: read it next time
            seen += 1
            show_progress(bar, record)
        if stop.is_set():
            break
        time.sleep(0.2)
    bar.close()


def _plot_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m reference.train plot")
    p.add_argument("log", type=Path)
    p.add_argument("--out", type=Path, help="PNG to write (default: LOG with .png)")
    args = p.parse_args(argv)
    from reference.train.plot import plot_log, read_log

    records = read_log(args.log)
    out = args.out or args.log.with_suffix(".png")
    plot_log(records, title=args.log.name).savefig(out, dpi=100)
    print(f"wrote {out}: {len(records)} steps, loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}")
    return 0


def _parity_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m reference.train parity",
                                description="A run's logged losses against one process.")
    p.add_argument("log", type=Path)
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--world-size", required=True, type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from reference.train.config import load_config
    from reference.train.parity import HELD, compare, single_process_losses, tolerance
    from reference.train.plot import read_log
    from reference.train.settings import settings

    records = read_log(args.log)
    plan = settings(load_config(args.config, _overrides(args)), args.world_size)
    steps = max(r["step"] for r in records)
    reference = single_process_losses(plan, args.world_size, steps)
    held, worst = compare(records, reference, HELD), compare(records, reference)
    tol = tolerance(plan.config.precision)
    print(f"parity: {args.world_size} ranks against one process, largest relative loss difference "
          f"{held:.1e} over the first {min(HELD, steps)} steps (tolerance: {tol.summary()}); "
          f"{worst:.1e} over all {steps} (not held: AdamW's steps let last-bit differences grow, "
          f"see reference/train/parity.py)")
    return 0 if held <= tol.rtol else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        return _plot_main(argv[1:])
    if argv and argv[0] == "parity":
        return _parity_main(argv[1:])
    args = _parser().parse_args(argv)
    from reference.runtime import launch, under_torchrun
    from reference.train.config import describe, load_config

    cfg = load_config(args.config, _overrides(args))
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world_size):
            raise SystemExit(f"--world-size {args.world_size} but torchrun started WORLD_SIZE={world_size}")
    else:
        world_size = args.world_size or 1
    if args.check:
        print(describe(cfg, world_size))
        return 0
    cfg.parallel_config(world_size)  # every degree checked before any rank starts
    from reference.train.checkpoint import check_checkpoint, check_checkpoint_dir, latest_checkpoint
    from reference.train.loop import prepare_log, run_rank
    from reference.train.settings import settings

    plan = settings(cfg, world_size)
    folder = cfg.checkpoint.dir
    if folder is not None:
        check_checkpoint_dir(folder)  # not found at the first save, after training: one line, exit 2
    latest = latest_checkpoint(Path(folder)) if folder is not None else None
    if args.resume and latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {folder} (checkpoint.dir of "
                                f"{args.config}); train without --resume first")
    resuming = (args.resume or cfg.checkpoint.resume) and latest is not None
    start = check_checkpoint(latest) if resuming else 0  # a corrupt one: one line, exit 2
    stop, follower = threading.Event(), None
    lead = not under_torchrun() or int(os.environ.get("RANK", "0")) == 0
    if not under_torchrun() and cfg.log.path:
        log = Path(cfg.log.path)
        moved = prepare_log(log, start if resuming else None)
        if moved is not None:
            print(f"the earlier log {log} was moved to {moved}")
        plan.log_prepared = True
        follower = threading.Thread(target=_follow, args=(log, cfg.steps, start, stop), daemon=True)
        follower.start()
    try:
        results = launch(run_rank, world_size, plan, world_size, args.resume, timeout=args.timeout)
    finally:
        stop.set()
        if follower is not None:
            follower.join(timeout=5)
    if lead:
        records = results[0]["records"]
        if records:
            last = records[-1]
            print(f"step {last['step']}: loss {last['loss']:.4f}, {last['tokens_per_s']:.0f} tokens/s"
                  + (f"; log {cfg.log.path}" if cfg.log.path else ""))
        if results[0]["sample"]:
            print("sample:", repr(results[0]["sample"]))
    return 0


def _main_with_clear_errors() -> int:
    """Bad input is one line on stderr and exit status 2, not a traceback."""
    from reference.runtime.errors import RankError
    from reference.train.checkpoint import CorruptCheckpointError, UnwritableCheckpointDirError

    try:
        return main()
    except (ValueError, FileNotFoundError, CorruptCheckpointError, UnwritableCheckpointDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RankError as err:
        # bytes overwritten inside a checkpoint are found only as the ranks read: said once
        last = err.traceback.strip().splitlines()[-1] if err.traceback.strip() else ""
        if "CorruptCheckpointError: " in last:
            print(f"error: {last.split('CorruptCheckpointError: ', 1)[1]}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(_main_with_clear_errors())
