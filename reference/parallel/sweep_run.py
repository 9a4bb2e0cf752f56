"""Run the cases of `reference.parallel.sweep` on ranks and on one process, and compare.

    results = launch(run_cases, world_size, cases)             # every rank: losses, rank 0: weights
    row = compare(case, results[0][i], single_process(case))   # the largest differences

Each case trains `STEPS` AdamW steps (lr `LR`, eps `EPS`) from the same initial weights
(seed 0) on the same global batches, with the case's clipping (global norm 1.0) and
precision. The single process accumulates gradients over the same dp x microbatches
chunks the parallel run splits the batch into (the MoE's balance loss is per chunk), runs
the same precision under autocast, with fp16's `DynamicLossScaler` and its skips, and
clips with `torch.nn.utils.clip_grad_norm_`.

Tolerances, and why (`TOLERANCES`):

* fp32: losses rtol 1e-5. Weights atol 5e-6: a parallel run adds the same numbers in
  another order (tensor-parallel partial sums, the dp all-reduce, the vocab-parallel
  loss), a difference of a few units in the last place of a gradient coordinate, about
  1e-9 absolute here. AdamW divides the update by sqrt(v) + eps with eps = 1e-6, so a
  coordinate whose gradient is near zero turns that difference into up to lr x 1e-9 / eps
  = 1e-6 of weight per step: 3e-6 over three steps, whichever kernels (AVX-512, AVX2 or
  plain) the CPU picks.
* bf16 and fp16, against the single process in the same precision: losses rtol 1e-3, and the
  *mean* absolute weight difference at most 5e-4 (bf16) or 1e-4 (fp16). A half-precision
  rounding is 4e-3 (bf16) or 5e-4 (fp16) relative, and the parallel run rounds its partial
  sums at other places; the loss, a mean over thousands of roundings that do not line up,
  moves far less than one rounding. A single weight whose gradient is near zero can take
  AdamW's whole step in either direction: over three steps Adam's |m/sqrt(v)| is at most
  1.0036 (beta1 0.9, beta2 0.999), so one weight can differ by up to 3 x 2 x 1.0036 lr =
  6.02e-3, and the largest difference (atol 6.1e-3) only catches a weight that went astray
  beyond any step. What can fail is the mean: measured at most 1.4e-4 (bf16, ZeRO-3 with
  experts, where a rounding can send a token to another expert) and, in fp16, 1.2e-6 without
  experts but 2.5e-5 with them on PyTorch's plain kernels (ATEN_CPU_CAPABILITY=default: a
  token routed to another expert again); a wrong reduction moves most weights by a good
  fraction of lr = 1e-3.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["STEPS", "LR", "EPS", "TOLERANCES", "batches", "run_cases", "single_process",
           "compare", "model_for"]

STEPS, LR, EPS = 3, 1e-3, 1e-6
TOLERANCES = {"fp32": dict(loss_rtol=1e-5, atol=5e-6),
              "bf16": dict(loss_rtol=1e-3, atol=6.1e-3, mean_atol=5e-4),
              "fp16": dict(loss_rtol=1e-3, atol=6.1e-3, mean_atol=1e-4)}
FP16_POWER = 12   # the loss scale starts at 2^12: the tiny model's gradients stay finite


def batches(steps: int = STEPS):
    from reference.parallel.sweep import BATCH

    B, T = BATCH
    g = torch.Generator().manual_seed(4321)
    data = torch.randint(0, 256, (steps, B, T + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def model_for(case):
    from reference.expert_parallel import moe_factory
    from reference.model import GPT, GPTConfig
    from reference.parallel.sweep import MODEL_SIZES, N_EXPERTS

    torch.manual_seed(0)  # the same initial weights on every rank and in the single process
    cfg = GPTConfig.tiny(**MODEL_SIZES)
    # capacity 2.0: no token dropped, so routing per chunk is the same everywhere
    return GPT(cfg, ffn_factory=moe_factory(N_EXPERTS, k=2, capacity_factor=2.0)) if case.moe else GPT(cfg)


def _scaler():
    from reference.parallel.scaler import DynamicLossScaler

    return DynamicLossScaler(initial_scale_power=FP16_POWER)


def run_cases(cases, steps: int = STEPS):
    """On every rank: for each case, (losses, skipped flags, full weights on rank 0 else None)."""
    import torch.distributed as dist

    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from reference.parallel.sweep import BATCH
    from reference.runtime import device

    out = []
    for case in cases:
        model = model_for(case).to(device())
        mesh = case.config.mesh().build_groups()
        pm = parallelize(model, mesh, case.config, batch=BATCH)
        if pm.scaler is not None:
            pm.scaler = _scaler()
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses, skipped = [], []
        for idx, tgt in batches(steps):
            r = train_step(pm, opt, idx, tgt, max_norm=1.0 if case.clip else None)
            losses.append(float(r.loss))
            skipped.append(bool(r.skipped))
        state = full_state_dict(pm)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        out.append((losses, skipped, state if rank0 else None))
    return out


def _autocast(precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def single_process(case, steps: int = STEPS):
    """The oracle: (losses, skipped flags, weights) of one process training the same case."""
    model = model_for(case)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    config = case.config
    chunks = config.dp * config.microbatches
    scaler = _scaler() if config.precision == "fp16" else None
    losses, skipped = [], []
    for idx, tgt in batches(steps):
        opt.zero_grad(set_to_none=True)
        scale = scaler.scale if scaler is not None else 1.0
        total = 0.0
        for x, y in zip(idx.chunk(chunks), tgt.chunk(chunks)):
            with _autocast(config.precision):
                _, with_aux = model(x, y)  # the LM loss plus the MoE's balance loss (0 if dense)
            (with_aux * (scale / chunks)).backward()
            total += float(model.last_lm_loss.float()) / chunks
        losses.append(total)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        overflow = False
        if scaler is not None:
            overflow = scaler.unscale_and_check(grads)
            scaler.update(overflow)
        skipped.append(overflow)
        if overflow:
            continue
        if case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return losses, skipped, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(case, got, want) -> dict:
    """The largest loss (relative) and weight (absolute) differences, and whether they are
    within `TOLERANCES` for the case's precision. `got`, `want`: (losses, skipped, state)."""
    tol = TOLERANCES[case.config.precision]
    g_loss, g_skip, g_state = got
    w_loss, w_skip, w_state = want
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(g_loss, w_loss))
    weight_diff, total, count, missing = 0.0, 0.0, 0, []
    for name, value in w_state.items():
        if name not in g_state:
            if name != "lm_head.weight":  # tied: the same tensor as the embedding
                missing.append(name)
            continue
        diff = (g_state[name].float() - value.float()).abs()
        weight_diff = max(weight_diff, float(diff.max()))
        total, count = total + float(diff.sum()), count + diff.numel()
    mean_diff = total / max(count, 1)
    ok = (loss_diff <= tol["loss_rtol"] and weight_diff <= tol["atol"] and not missing
          and mean_diff <= tol.get("mean_atol", float("inf")) and g_skip == w_skip)
    return dict(case=str(case), world_size=case.world_size, loss_rel=loss_diff,
                weight_abs=weight_diff, weight_mean=mean_diff, skipped=g_skip,
                expected_skipped=w_skip, missing=missing, ok=ok)
