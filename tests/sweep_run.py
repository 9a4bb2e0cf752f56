"""Run the cases of `sweep` (the all-pairs set of the tests) on ranks and on one process, and compare.

    results = launch(run_cases, world_size, cases)             # every rank: losses, rank 0: weights
    row = compare(case, results[0][i], single_process(case))   # the largest differences

Each case trains `STEPS` AdamW steps (lr `LR`, eps `EPS`) from the same initial weights
(seed 0) on the same global batches, with the case's clipping (global norm 1.0) and
precision. The single process accumulates gradients over the same dp x microbatches
chunks the parallel run splits the batch into (the MoE's balance loss is per chunk), runs
the same precision under autocast, with fp16's `DynamicLossScaler` and its skips, and
clips with `torch.nn.utils.clip_grad_norm_`.

Tolerances (`TOLERANCES`) are the course's policy, `reference.tolerance`, whose docstring gives
each bound's reason: the losses within `loss(dtype)`; the weights after `STEPS` AdamW steps at
`LR` within `adamw_weights(STEPS, LR, dtype=...)`, every weight, the mean over all of them and
each tensor's mean; the routers' biases, moved by `BIAS_RATE` times a sign, within
`expert_bias(STEPS, BIAS_RATE, dtype)` in the same three ways. A single weight may differ by
up to AdamW's whole steps (6.0e-3 here, eps or not), so the largest difference only catches a
weight gone astray; the means are what a wrong reduction moves. bf16 and fp16 runs are compared with one process in the same
precision; with experts a rounding there can also send a token to another expert, which
moves a few weights by more than a rounding and leaves the means far below what a wrong
reduction gives; when that expert's load is at the mean, its bias moves a step apart.
"""
from __future__ import annotations

import functools

import torch

from reference.tolerance import adamw_weights, expert_bias, loss

__all__ = ["STEPS", "LR", "EPS", "TOLERANCES", "batches", "full_batches", "run_cases", "single_process",
           "compare", "model_for"]

STEPS, LR, EPS = 3, 1e-3, 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_POWER = 12   # the loss scale starts at 2^12: the tiny model's gradients stay finite
BIAS_RATE = 0.05  # a bias-balanced MoE's step: large enough to move the routing in 3 steps
# per precision: the losses', the weights' and the routers' biases' tolerance (reference.tolerance says why)
TOLERANCES = {p: dict(loss=loss(dtype), weights=adamw_weights(STEPS, LR, dtype=dtype),
                      bias=expert_bias(STEPS, BIAS_RATE, dtype))
              for p, dtype in DTYPES.items()}


def full_batches(steps: int = STEPS):
    """Random tokens, every target counted: for measurements that assume balanced routing
    (padding's identical rows all go to the same experts)."""
    from sweep import BATCH

    B, T = BATCH
    data = torch.randint(0, 256, (steps, B, T + 1), generator=torch.Generator().manual_seed(4321))
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def batches(steps: int = STEPS):
    """Padded documents (`reference.data.padded_documents`): every row counts a different
    number of tokens, so a loss averaged over pieces instead of over counted tokens shows."""
    from reference.data import padded_documents
    from sweep import BATCH

    B, T = BATCH
    data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(4321))
    return [padded_documents(data, B, T, step, seed=4321) for step in range(steps)]


def model_for(case):
    return _model(case.moe, case.bias)


def _model(moe: bool, bias: bool):
    from reference.expert_parallel import moe_factory
    from reference.model import GPT, GPTConfig
    from sweep import MODEL_SIZES, N_EXPERTS

    torch.manual_seed(0)  # the same initial weights on every rank and in the single process
    cfg = GPTConfig.tiny(**MODEL_SIZES)
    # capacity 2.0: no token dropped, so routing per chunk is the same everywhere; with `bias`
    # the experts are balanced by a bias too (DeepSeek-V3), moved after each step
    rate = BIAS_RATE if bias else 0.0
    return GPT(cfg, ffn_factory=moe_factory(N_EXPERTS, k=2, capacity_factor=2.0, bias_update_rate=rate)) \
        if moe else GPT(cfg)


def _scaler():
    from reference.parallel.scaler import DynamicLossScaler

    return DynamicLossScaler(initial_scale_power=FP16_POWER)


def run_cases(cases, steps: int = STEPS):
    """On every rank: for each case, (losses, skipped flags, full weights on rank 0 else None)."""
    import torch.distributed as dist

    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep import BATCH
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


def single_process(case, steps: int = STEPS):
    """The oracle (`reference.train.single.accumulated_step`): (losses, skipped flags, weights)
    of one process training the same case over the parallel run's dp x micro-batch chunks.
    It reads only the arguments of `_single_process`: cases equal in them (86 cases of the
    sweep at this writing, 50 oracles) share one run, whose result the callers only read."""
    c = case.config
    return _single_process(case.moe, case.bias, c.precision, c.dp * c.microbatches, case.clip,
                           c.loss_mean, steps)


@functools.lru_cache(maxsize=None)
def _single_process(moe, bias, precision, chunks, clip, loss_mean, steps):
    from reference.train.single import accumulated_step

    model = _model(moe, bias)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    scaler = _scaler() if precision == "fp16" else None
    losses, skipped = [], []
    for idx, tgt in batches(steps):
        loss, skip = accumulated_step(model, opt, idx, tgt, chunks, precision=precision, scaler=scaler,
                                      max_norm=1.0 if clip else None, loss_mean=loss_mean)
        losses.append(loss)
        skipped.append(skip)
    return losses, skipped, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(case, got, want) -> dict:
    """The largest loss (relative) and weight (absolute) differences and the mean weight
    difference, and whether the run is within `TOLERANCES` for the case's precision: every
    loss, and the weights by `Tolerance.assert_weights` (every weight, the mean over all of
    them, each tensor's mean; `why` says what failed). `got`, `want`: (losses, skipped, state)."""
    tol = TOLERANCES[case.config.precision]
    g_loss, g_skip, g_state = got
    w_loss, w_skip, w_state = want
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(g_loss, w_loss))
    missing = [n for n in w_state if n not in g_state and n != "lm_head.weight"]  # lm_head: tied
    compared = {n: v for n, v in w_state.items() if n in g_state}
    diffs = [(g_state[n].double() - v.double()).abs() for n, v in compared.items()]
    weight_diff = max((float(d.max()) for d in diffs if d.numel()), default=0.0)
    mean_diff = sum(float(d.sum()) for d in diffs) / max(sum(d.numel() for d in diffs), 1)
    why = []
    try:
        tol["loss"].assert_losses(g_loss, w_loss, f"{case} losses")
    except AssertionError as err:
        why.append(str(err))
    biases = {n: v for n, v in compared.items() if n.endswith("expert_bias")}  # moved by a sign, not AdamW
    for kind, want_part in (("weights", {n: v for n, v in compared.items() if n not in biases}), ("bias", biases)):
        try:
            if want_part:
                tol[kind].assert_weights(g_state, want_part, str(case))
        except AssertionError as err:
            why.append(str(err))
    ok = not why and not missing and g_skip == w_skip
    return dict(case=str(case), world_size=case.world_size, loss_rel=loss_diff,
                weight_abs=weight_diff, weight_mean=mean_diff, skipped=g_skip,
                expected_skipped=w_skip, missing=missing, why=why, ok=ok)
