"""Mixture of experts with Megatron sequence parallelism equals one process.

Each MoE layer all-gathers the sequence over tp, routes it whole and keeps this rank's
T / tp rows (`reference.expert_parallel.sequence_parallel`). The capacity factor 1.0 here
drops assignments, so routing a shard instead of the whole sequence would differ from one
process; the balance and z coefficients are large, so an aux loss counted tp times (or a
router gradient left partial over tp) would show in the weights. K AdamW steps; losses
rtol 1e-5, weights atol 5e-6 (`reference.parallel.sweep_run.TOLERANCES["fp32"]`).
"""
from __future__ import annotations

import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.runtime import launch

pytestmark = pytest.mark.timeout(300)

K, LR, EPS = 3, 1e-3, 1e-6
CFG = GPTConfig.tiny(n_layer=4, block_size=16)
B, T = 8, 16
TOL = dict(loss_rtol=1e-5, atol=5e-6)


def _factory():
    from reference.expert_parallel import moe_factory

    return moe_factory(4, k=2, capacity_factor=1.0, balance_coef=0.5, z_coef=0.05)


def _batches():
    g = torch.Generator().manual_seed(99)
    data = torch.randint(0, 256, (K, B, T + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _configs():
    from reference.parallel.config import ParallelConfig

    return [ParallelConfig(dp=2, tp=2, ep=2, sequence_parallel=True),
            ParallelConfig(tp=2, pp=2, sequence_parallel=True, microbatches=2),
            ParallelConfig(tp=2, pp=2, sequence_parallel=True, microbatches=2,
                           activation_checkpointing=True)]


def _single_process(chunks: int):
    torch.manual_seed(0)
    model = GPT(CFG, ffn_factory=_factory())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, dropped = [], 0
    for idx, tgt in _batches():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(idx.chunk(chunks), tgt.chunk(chunks)):
            _, with_aux = model(x, y)
            (with_aux / chunks).backward()
            total += float(model.last_lm_loss) / chunks
            dropped += sum(b.ffn.last_dropped for b in model.h)
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, dropped


def _rank(configs):
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step

    out = []
    for config in configs:
        torch.manual_seed(0)
        model = GPT(CFG, ffn_factory=_factory())
        mesh = config.mesh().build_groups()
        pm = parallelize(model, mesh, config, batch=(B, T))
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses = [float(train_step(pm, opt, idx, tgt).loss) for idx, tgt in _batches()]
        state = full_state_dict(pm)
        out.append((losses, state if torch.distributed.get_rank() == 0 else None))
    return out


def test_validate_accepts_experts_with_sequence_parallelism():
    from reference.parallel.config import ParallelConfig

    for config in _configs():
        config.validate(4, CFG, batch=(B, T), n_experts=4)


def test_experts_with_sequence_parallelism_equal_one_process(record_property):
    configs = _configs()
    ranks = launch(_rank, 4, configs, timeout=240)
    figures = {}
    for i, config in enumerate(configs):
        for r in ranks[1:]:
            assert r[i][0] == ranks[0][i][0], f"{config}: ranks disagree on the loss"
        want_losses, want_state, dropped = _single_process(config.dp * config.microbatches)
        assert dropped > 0  # capacity binds: routing a shard would drop other assignments
        got_losses, got_state = ranks[0][i]
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses))
        weight_abs = 0.0
        for name, value in want_state.items():
            if name == "lm_head.weight" and name not in got_state:  # tied to wte
                continue
            assert name in got_state, f"{config}: {name} missing"
            weight_abs = max(weight_abs, float((got_state[name] - value).abs().max()))
        figures[str(config)] = dict(loss_rel=loss_rel, weight_abs=weight_abs)
        assert loss_rel <= TOL["loss_rtol"], (str(config), got_losses, want_losses)
        assert weight_abs <= TOL["atol"], (str(config), weight_abs)
    record_property("parity", figures)
    print(figures)
