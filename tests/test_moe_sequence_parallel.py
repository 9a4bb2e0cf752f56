"""Mixture of experts with Megatron sequence parallelism equals one process.

Each MoE layer all-gathers the sequence over tp, routes it whole and keeps this rank's
T / tp rows (`reference.expert_parallel.sequence_parallel`). The capacity factor 1.0 here
drops assignments, so routing a shard instead of the whole sequence would differ from one
process; the balance and z coefficients are large, so an aux loss counted tp times (or a
router gradient left partial over tp) would show in the weights. The parity test's oracle
(tests/test_parallel_parity.py: its batches, its single process, its ranks, its tolerances
from the course's policy: the losses, every weight and the mean weight differences, overall and
per tensor, after its AdamW steps).
"""
from __future__ import annotations

import pytest
import torch

from reference.model import GPT
from reference.runtime import launch
from test_parallel_parity import CFG, LOSS_TOL, WEIGHT_TOL, B, T, _rank, batches, single_process  # the oracle

pytestmark = pytest.mark.timeout(300)


def _factory():
    from reference.expert_parallel import moe_factory

    return moe_factory(4, k=2, capacity_factor=1.0, balance_coef=0.5, z_coef=0.05)


def _configs():
    from reference.parallel.config import ParallelConfig

    return [ParallelConfig(dp=2, tp=2, ep=2, sequence_parallel=True),
            ParallelConfig(tp=2, pp=2, sequence_parallel=True, microbatches=2),
            ParallelConfig(tp=2, pp=2, sequence_parallel=True, microbatches=2,
                           activation_checkpointing=True)]


def _dropped(chunks: int) -> int:
    """Assignments one process drops at capacity on the first batch, in `chunks` chunks."""
    torch.manual_seed(0)
    model = GPT(CFG, ffn_factory=_factory())
    idx, tgt = batches()[0]
    dropped = 0
    with torch.no_grad():
        for x, y in zip(idx.chunk(chunks), tgt.chunk(chunks)):
            model(x, y)
            dropped += sum(b.ffn.last_dropped for b in model.h)
    return dropped


def test_validate_accepts_experts_with_sequence_parallelism():
    for config in _configs():
        config.validate(4, CFG, batch=(B, T), n_experts=4)


def test_experts_with_sequence_parallelism_equal_one_process(record_property):
    configs = _configs()
    ranks = launch(_rank, 4, configs, CFG, _factory(), timeout=240)
    figures = {}
    for i, config in enumerate(configs):
        for r in ranks[1:]:
            assert r[i][0] == ranks[0][i][0], f"{config}: ranks disagree on the loss"
        chunks = config.dp * config.microbatches
        want_losses, want_state = single_process(config, chunks, ffn_factory=_factory())
        assert _dropped(chunks) > 0  # capacity binds: routing a shard would drop other assignments
        got_losses, got_state = ranks[0][i]
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses))
        if "lm_head.weight" not in got_state:  # tied to wte: one tensor, gathered once
            want_state = {k: v for k, v in want_state.items() if k != "lm_head.weight"}
        diffs = [(got_state[name] - value).abs() for name, value in want_state.items() if name in got_state]
        figures[str(config)] = dict(loss_rel=loss_rel, weight_abs=max(float(d.max()) for d in diffs),
                                    weight_mean=float(sum(d.sum() for d in diffs)) / sum(d.numel() for d in diffs))
        LOSS_TOL.assert_losses(got_losses, want_losses, f"{config} losses")
        WEIGHT_TOL.assert_weights(got_state, want_state, str(config))
    record_property("parity", figures)
    print(figures)


def test_tensor_parallelism_alone_still_refuses_experts_with_sequence_parallelism():
    """Without the gather, SP would hand each MoE layer a T/tp shard to route: a silently
    different run. `apply_tensor_parallel` refuses it unless told the caller gathers."""
    from reference.mesh import Mesh
    from reference.tensor_parallel import apply_tensor_parallel

    model = GPT(CFG, ffn_factory=_factory())
    with pytest.raises(ValueError, match="mixture of experts.*sequence_parallel_experts"):
        apply_tensor_parallel(model, Mesh(tp=2), sequence_parallel=True)
