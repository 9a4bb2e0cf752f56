"""The router's bias is state: `expert_bias` is saved and loaded like a weight.

A run balanced by a bias (DeepSeek-V3's loss-free balancing) that loses its bias at a checkpoint
routes the same batch differently after the resume. The bias is a persistent buffer (as in
torchtitan and Megatron-Core; only the step's token counts are not), so it is in `state_dict`,
in `full_state_dict`, and in the trainer's sharded checkpoints under the plain GPT's name,
replicated like a LayerNorm gain: any layout (dp, ep, pp) loads it.
"""
from __future__ import annotations

import pytest
import torch

from reference.expert_parallel import MoE, moe_factory
from reference.model import GPT, GPTConfig
from reference.parallel import ParallelConfig
from reference.runtime import launch

pytestmark = pytest.mark.timeout(300)

CFG = GPTConfig.tiny(n_layer=2, block_size=16)
B, T = 8, 16
LR, EPS = 1e-3, 1e-6
RATE = 0.05  # large enough to move the routing within a few steps
SAVED, STEPS = 3, 5


def _gpt() -> GPT:
    torch.manual_seed(0)  # the same plain GPT on every rank
    # capacity 2.0: no token dropped, so routing per chunk is the same in every layout
    return GPT(CFG, moe_factory(4, k=2, capacity_factor=2.0, bias_update_rate=RATE))


def _batches():
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, CFG.vocab_size, (STEPS, B, T + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _biases(pm) -> dict:
    return {name: b.detach().clone() for stage in pm.stages for name, b in stage.named_buffers()
            if name.endswith("expert_bias")}


def test_the_bias_is_in_the_state_dict_and_the_counts_are_not():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, k=2, capacity_factor=None, bias_update_rate=RATE)
    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1))
    moe.router.expert_bias.copy_(torch.tensor([-0.3, 0.2, -0.1, 0.4]))
    want = moe.router(x).tokens_per_expert()
    state = moe.state_dict()
    assert "router.expert_bias" in state and "router.step_tokens_per_expert" not in state
    torch.manual_seed(0)
    again = MoE(8, 16, 4, k=2, capacity_factor=None, bias_update_rate=RATE)
    again.load_state_dict(state)
    assert torch.equal(again.router.expert_bias, moe.router.expert_bias)
    assert torch.equal(again.router(x).tokens_per_expert(), want)  # the same batch, the same loads


def _run(configs, root, save):
    """Per config: (losses, biases after each step, whole state at the end, bias right after
    the load). Saving: SAVED steps, a checkpoint, then the rest; loading: the rest from it."""
    from reference.parallel import parallelize, train_step
    from reference.parallel.gather import full_state_dict
    from reference.train.checkpoint import load_checkpoint, save_checkpoint

    out = []
    for config in configs:
        pm = parallelize(_gpt(), config.mesh().build_groups(), config, batch=(B, T))
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        data, losses, trajectory, loaded = _batches(), [], [], None
        if save:
            for idx, tgt in data[:SAVED]:
                losses.append(float(train_step(pm, opt, idx, tgt).loss))
                trajectory.append(_biases(pm))
            save_checkpoint(root, SAVED, pm, opt)
        else:
            assert load_checkpoint(root, pm, opt)["step"] == SAVED
            loaded = _biases(pm)
        for idx, tgt in data[SAVED:]:
            losses.append(float(train_step(pm, opt, idx, tgt).loss))
            trajectory.append(_biases(pm))
        out.append((losses, trajectory, full_state_dict(pm), loaded))
    return out


SOURCE = ParallelConfig(dp=2, ep=2)  # experts 0-1 on ep rank 0, 2-3 on ep rank 1
TARGETS = [SOURCE,                                         # the same layout: bit for bit
           ParallelConfig(pp=2, microbatches=2),             # the same chunks, a block per stage
           ParallelConfig(dp=2, zero_stage=1)]               # every expert on both dp ranks


def test_a_bias_balanced_run_resumes_bit_for_bit_and_reshards(tmp_path):
    """Saved from dp 2 x ep 2 after 3 steps: the same layout continues bit for bit (losses,
    weights, bias); pp 2 and ZeRO-1 over dp 2 load the very bias that was saved and move it
    exactly as the run that never stopped (the bias moves by +-u from integer counts), their
    losses within rtol 1e-5 (the same numbers reduced in another order, as in
    `tests/test_train_checkpoint.py`'s resharding)."""
    (losses, trajectory, state, _), = launch(_run, 2, [SOURCE], tmp_path, True, timeout=240)[0]
    assert any("expert_bias" in k for k in state)
    assert any(float(b.abs().max()) > 0 for b in trajectory[SAVED - 1].values())  # it moved
    ranks = launch(_run, 2, TARGETS, tmp_path, False, timeout=240)
    for i, config in enumerate(TARGETS):
        for rank in ranks:
            got_losses, got_trajectory, got_state, loaded = rank[i]
            for name, bias in loaded.items():
                assert torch.equal(bias, trajectory[SAVED - 1][name]), (config, name, bias)
            for step, got in enumerate(got_trajectory, start=SAVED):
                for name, bias in got.items():
                    assert torch.equal(bias, trajectory[step][name]), (config, step, name)
            if config == SOURCE:
                assert got_losses == losses[SAVED:], (got_losses, losses[SAVED:])
                assert all(torch.equal(got_state[k], v) for k, v in state.items())
            else:
                assert got_losses == pytest.approx(losses[SAVED:], rel=1e-5, abs=0), config
            assert {k for k in got_state if "expert_bias" in k} == {k for k in state if "expert_bias" in k}
