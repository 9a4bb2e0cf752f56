"""`python -m reference.train parity LOG.jsonl --config C`: a run's losses against one process.

One process trains the same model on the same batches with the same optimizer, schedule and
clipping, over the parallel run's dp x micro-batch chunks. The first `HELD` steps are held to
`reference.tolerance.loss(dtype)` in the run's precision (fp32: rtol 1e-5, only the order of
additions differs; bf16 and fp16: 1e-3): step 1 is the same weights' loss, and step 2 follows
one update, where a wrong gradient reduction already shows while AdamW's first step (lr times
the gradient's sign) differs only where a gradient is a rounding away from 0. Later steps are
printed, not held: each AdamW step can turn a last-bit difference into up to 2 lr of a weight
(`reference.tolerance.adamw_weights`), and the losses drift apart (2e-4 relative after 30 steps
of `configs/debug_3d.json` at lr 3e-3) with nothing wrong; the sweep and the parity tests
compare the weights instead.
"""
from __future__ import annotations

from typing import Optional

import torch

from reference.model import GPT
from reference.tolerance import Tolerance, loss

__all__ = ["single_process_losses", "compare", "tolerance", "HELD"]


def single_process_losses(plan, world_size: int, steps: int | None = None) -> list[float]:
    """One process's losses (`reference.train.single.accumulated_step`) for the run ``plan``
    describes at ``world_size``; the schedule does not advance on a skipped step."""
    from reference.data import ByteCorpus
    from reference.parallel.scaler import DynamicLossScaler
    from reference.train.loop import batch_at
    from reference.train.lr_schedules import make_scheduler
    from reference.train.single import accumulated_step

    cfg = plan.config
    pconfig = cfg.parallel_config(world_size)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config(), ffn_factory=cfg.ffn_factory())
    optimizer = cfg.optimizer.torch_class()(model.parameters(), **cfg.optimizer.kwargs())
    scheduler = make_scheduler(optimizer, cfg)
    scaler = DynamicLossScaler(**cfg.fp16.scaler_kwargs()) if pconfig.precision == "fp16" else None
    corpus = ByteCorpus.load() if cfg.data.source == "stdlib" else None
    losses = []
    for step in range(steps or cfg.steps):
        idx, tgt = batch_at(cfg.data.source, plan.train_batch_size, plan.seq_len, step,
                            cfg.data.seed, corpus)
        loss, skipped = accumulated_step(model, optimizer, idx, tgt, pconfig.dp * pconfig.microbatches,
                                         precision=pconfig.precision, scaler=scaler,
                                         max_norm=cfg.gradient_clipping or None,
                                         loss_mean=pconfig.loss_mean)
        if scheduler is not None and not skipped:
            scheduler.step()
        losses.append(loss)
    return losses


HELD = 2  # the steps held to the loss tolerance (the module's docstring says why)


def compare(logged: list[dict], reference: list[float], steps: Optional[int] = None) -> float:
    """Largest relative difference of the logged losses from one process's, over ``steps`` steps."""
    by_step = {r["step"]: r["loss"] for r in logged}
    diffs = [abs(by_step[s + 1] - ref) / abs(ref) for s, ref in enumerate(reference[:steps])
             if s + 1 in by_step]
    if not diffs:
        raise ValueError("the log and the single-process run share no step")
    return max(diffs)


def tolerance(precision: str) -> Tolerance:
    """The losses' tolerance for a run in `precision` ("fp32", "bf16" or "fp16")."""
    return loss({"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32))
