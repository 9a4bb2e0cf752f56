"""The workshop trainer's loop, run on every rank: the 3D GPT from a `TrainConfig`.

`run_rank(plan, world_size, resume)` is what each rank executes, whether started by
`reference.runtime.launch` or by torchrun (``plan``: a `reference.train.settings.RunPlan`):

1. the layout, the mesh, the plain GPT built from `cfg.seed` on every rank and `parallelize`d;
2. the optimizer (`pm.make_optimizer`), the learning-rate schedule and fp16's loss scaler;
3. with `--resume` (a checkpoint must exist) or `checkpoint.resume: true` (a requeued SLURM
   job's case: a fresh start when there is none), the latest checkpoint, to continue exactly;
4. per step: global batch number `step`, `train_step`, the schedule's step (not after an fp16
   overflow: DeepSpeed's rule); every `log.every` steps rank 0 appends the record to the JSONL
   log; every `checkpoint.every` steps and at the end, a checkpoint;
5. at the end, a sample of generated text.
"""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from reference import comms
from reference.data import ByteCorpus, decode, get_batch, padded_documents, synthetic_batch
from reference.model import GPT
from reference.parallel import parallelize, train_step
from reference.parallel.generate import generate
from reference.parallel.golden import debug_data, text_windows
from reference.parallel.scaler import DynamicLossScaler
from reference.runtime import device
from reference.train.lr_schedules import make_scheduler

__all__ = ["run_rank", "batch_at", "peak_memory_bytes", "prepare_log", "show_progress"]


def batch_at(source: str, batch: int, seq_len: int, step: int, seed: int, corpus=None):
    """Global batch number ``step``, a function of (source, seed, step) alone: the same on every rank."""
    if source == "stdlib":
        return get_batch(corpus.train, batch, seq_len, step, seed)
    if source == "arithmetic":
        return text_windows(batch, seq_len, torch.Generator().manual_seed(seed * 1_000_003 + step))
    if source == "synthetic":
        return synthetic_batch(batch, seq_len, seed=seed, step=step)
    if source == "documents":  # the arithmetic text as documents of many lengths, padded
        return padded_documents(debug_data(), batch, seq_len, step, seed)
    raise ValueError(f"unknown data source {source!r}; expected stdlib, arithmetic, synthetic or documents")


def peak_memory_bytes() -> int:
    """This process's peak memory: the CUDA allocator's high-water mark, or ru_maxrss (KiB on Linux)."""
    if device().type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def prepare_log(log: Path, resumed_at=None):
    """Make ``log`` ready; returns where a non-empty earlier log was moved (``<name>.1``, ...) or None.
    A run resumed at step s keeps the lines of steps <= s instead (the later ones run again)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if resumed_at is not None:
        kept = []
        for line in (log.read_text().splitlines() if log.exists() else []):
            try:
                if json.loads(line)["step"] <= resumed_at:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a line cut short by the kill: the rest is not trusted
        log.write_text("".join(line + "\n" for line in kept))
        return None
    moved = None
    if log.exists() and log.stat().st_size:
        n = 1
        while log.with_name(f"{log.name}.{n}").exists():
            n += 1
        moved = log.with_name(f"{log.name}.{n}")
        log.rename(moved)
    log.write_text("")
    return moved


def _build(plan, world_size: int):
    """Steps 1-2: this rank's part of the 3D GPT, its optimizer, the schedule and the scaler."""
    cfg = plan.config
    pconfig = cfg.parallel_config(world_size)
    mesh = pconfig.mesh().build_groups()
    torch.manual_seed(cfg.seed)  # the same plain GPT on every rank
    model = GPT(cfg.gpt_config(), ffn_factory=cfg.ffn_factory()).to(device())
    pm = parallelize(model, mesh, pconfig, batch=(plan.train_batch_size, plan.seq_len), seed=cfg.seed)
    optimizer = pm.make_optimizer(cfg.optimizer.torch_class(), **cfg.optimizer.kwargs())
    if pconfig.precision == "fp16":
        pm.scaler = DynamicLossScaler(**cfg.fp16.scaler_kwargs())
    return pm, optimizer, make_scheduler(optimizer, cfg)


def _resume(cfg, pm, optimizer, scheduler, resume: bool) -> int:
    """Step 3: the step to start from, 0 or the latest checkpoint's (loaded)."""
    from reference.train.checkpoint import latest_checkpoint, load_checkpoint

    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    path = latest_checkpoint(ckpt_dir) if ckpt_dir is not None else None
    if resume and path is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir} (checkpoint.dir of "
                                f"the config); train without --resume first")
    if (resume or cfg.checkpoint.resume) and path is not None:
        return load_checkpoint(path, pm, optimizer, scheduler=scheduler, scaler=pm.scaler)["step"]
    return 0


def _one_step(plan, pm, optimizer, scheduler, step: int, corpus, world_size: int) -> dict:
    """Step 4 for global batch number ``step``: its record (what the log's line holds)."""
    cfg, B, T = plan.config, plan.train_batch_size, plan.seq_len
    idx, tgt = batch_at(cfg.data.source, B, T, step, cfg.data.seed, corpus)
    lr = float(optimizer.param_groups[0]["lr"])
    t0 = time.perf_counter()
    with comms.meter() as meter:
        result = train_step(pm, optimizer, idx, tgt, max_norm=cfg.gradient_clipping or None)
    if device().type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if scheduler is not None and not result.skipped:
        scheduler.step()  # DeepSpeed does not step the schedule on an fp16 overflow
    record = dict(step=step + 1, loss=float(result.loss), lr=lr, seconds=round(seconds, 5),
                  tokens=result.tokens,  # the counted tokens the loss is the mean over
                  tokens_per_s=round(B * T / seconds, 1),
                  grad_norm=None if result.grad_norm is None else float(result.grad_norm),
                  loss_scale=result.loss_scale, skipped=result.skipped)
    if (step + 1) % cfg.log.every == 0 or step + 1 == cfg.steps:
        peaks = [peak_memory_bytes()]
        if world_size > 1:
            peaks = [None] * world_size
            dist.all_gather_object(peaks, peak_memory_bytes())
        record["peak_memory_bytes"] = peaks
        groups = sorted({r["group"] for r in meter.records()})
        record["sent_bytes_rank0"] = {g: meter.sent_bytes(group=g) for g in groups}
    return record


def show_progress(bar, record: dict) -> None:
    """Move the tqdm ``bar`` to the step of ``record`` (a log line) and show its numbers."""
    bar.n = record["step"]
    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                    tok_s=f"{record['tokens_per_s']:.0f}", refresh=False,
                    **({"scale": f"{record['loss_scale']:g}"} if record.get("loss_scale") else {}))
    bar.refresh()


def run_rank(plan, world_size: int, resume: bool = False, sample_prompt: str = "12+7=") -> dict:
    """Steps 1-5 on this rank; returns its records (rank 0's view) and the sample."""
    from reference.runtime import under_torchrun
    from reference.train.checkpoint import save_checkpoint

    cfg = plan.config
    pm, optimizer, scheduler = _build(plan, world_size)
    start = _resume(cfg, pm, optimizer, scheduler, resume)
    corpus = ByteCorpus.load() if cfg.data.source == "stdlib" else None
    log = Path(cfg.log.path) if (cfg.log.path and pm.mesh.rank == 0) else None
    if log is not None and not plan.log_prepared:
        prepare_log(log, start if start else None)
    bar = None
    if pm.mesh.rank == 0 and under_torchrun():  # torchrun shows rank 0's output live
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="training", unit="step")
    records = []
    for step in range(start, cfg.steps):
        record = _one_step(plan, pm, optimizer, scheduler, step, corpus, world_size)
        if log is not None and "peak_memory_bytes" in record:
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
        records.append(record)
        if bar is not None:
            show_progress(bar, record)
        if cfg.checkpoint.dir and (step + 1 == cfg.steps or (
                cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0)):
            save_checkpoint(Path(cfg.checkpoint.dir), step + 1, pm, optimizer, scheduler=scheduler,
                            scaler=pm.scaler, extra={"data_position": step + 1})
    if bar is not None:
        bar.close()
    sample = ""
    if cfg.log.sample_tokens:
        prompt = torch.tensor([list(sample_prompt.encode())])
        tokens = generate(pm, prompt, cfg.log.sample_tokens, temperature=0.8,
                          generator=torch.Generator().manual_seed(cfg.seed))
        sample = decode(tokens[0].cpu())
    return dict(rank=pm.mesh.rank, records=records, sample=sample, start=start)
