"""The 3D GPT equals one process: every (dp, tp, pp) in {1, 2}^3, with and without SP, and more.

Each combination trains K = 5 AdamW steps from the same initial weights (seed 0) on the
same global batches as a single process, then gathers its parameters back into the plain
GPT's (`full_state_dict`). The single process accumulates gradients over the same
dp x microbatches chunks the parallel run splits the batch into (the MoE's balance loss
is computed per chunk, so the chunks must match; for a dense model this is the
full-batch gradient).

Tolerances: the course's policy (`reference.tolerance`, which says why). Losses within
`loss()` (rtol 1e-5 in fp32); parameters after K AdamW steps within `adamw_weights(K, LR)`:
every weight within AdamW's whole steps (a gradient near zero can take its step either way on
a last-bit difference, whatever the CPU's kernels), and the mean difference, over all the
weights and over each tensor, within 1/1000 of that: what a wrong reduction would move. bf16:
see `test_dropout_checkpointing_and_bf16`.

One launch per world size runs all of that size's combinations in turn, to keep the
8-rank cases quick (about 10-20 s each launch on a 2-core machine).
"""
from __future__ import annotations


import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.tolerance import adamw_weights, loss
from reference.train.single import accumulated_step

pytestmark = pytest.mark.timeout(600)

K = 5
LR, EPS = 1e-3, 1e-6
CFG = GPTConfig.tiny(n_layer=4, block_size=16)
B, T = 8, 16
LOSS_TOL, WEIGHT_TOL = loss(), adamw_weights(K, LR)  # fp32 losses; weights after K AdamW steps


def batches(k: int = K, vocab: int = 256):
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, vocab, (k, B, T + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def single_process(config, chunks: int, cfg=CFG, ffn_factory=None, precision="fp32"):
    """Losses and final parameters of one process accumulating over `chunks` chunks."""
    torch.manual_seed(0)
    model = GPT(cfg, ffn_factory=ffn_factory) if ffn_factory else GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = [accumulated_step(model, opt, idx, tgt, chunks, precision=precision)[0] for idx, tgt in batches()]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(configs, cfg, ffn_factory):
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step

    out = []
    for config in configs:
        torch.manual_seed(0)  # the same initial weights on every rank, as in the single process
        model = GPT(cfg, ffn_factory=ffn_factory) if ffn_factory else GPT(cfg)
        mesh = config.mesh().build_groups()
        pm = parallelize(model, mesh, config, batch=(B, T))
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses = [float(train_step(pm, opt, idx, tgt).loss) for idx, tgt in batches()]
        state = full_state_dict(pm)
        out.append((losses, state if torch.distributed.get_rank() == 0 else None))
    return out


def run_all(world_size, configs, cfg=CFG, ffn_factory=None):
    return launch(_rank, world_size, configs, cfg, ffn_factory, timeout=300)


def assert_parity(config, ranks, i, expected_losses, expected_state):
    losses = [r[i][0] for r in ranks]
    for rank_losses in losses:  # every rank reports the same global mean
        assert rank_losses == losses[0], f"{config}: ranks disagree on the loss"
    LOSS_TOL.assert_losses(losses[0], expected_losses, f"{config} losses")
    state = ranks[0][i][1]
    if "lm_head.weight" not in state:  # tied: the same tensor as wte, gathered once
        expected_state = {k: v for k, v in expected_state.items() if k != "lm_head.weight"}
    WEIGHT_TOL.assert_weights(state, expected_state, str(config))
    return max(abs(a - b) for a, b in zip(losses[0], expected_losses))


def _combos(world_size):
    from reference.parallel.config import ParallelConfig

    out = []
    for dp in (1, 2):
        for tp in (1, 2):
            for pp in (1, 2):
                if dp * tp * pp != world_size:
                    continue
                for sp in ((False, True) if tp > 1 else (False,)):
                    out.append(ParallelConfig(dp=dp, tp=tp, pp=pp, sequence_parallel=sp,
                                              microbatches=2 if pp > 1 else 1))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_3d_combination_equals_one_process(world_size, record_property):
    configs = _combos(world_size)
    ranks = run_all(world_size, configs)
    table = {}
    for i, config in enumerate(configs):
        losses, state = single_process(config, config.dp * config.microbatches)
        table[str(config)] = assert_parity(config, ranks, i, losses, state)
    record_property("max_loss_difference", table)
    print(table)


def test_zero_interleaved_checkpointing_equal_one_process():
    from reference.parallel.config import ParallelConfig

    configs = [ParallelConfig(dp=2, zero_stage=1, microbatches=2),
               ParallelConfig(dp=2, zero_stage=3, microbatches=1),
               ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2, microbatches=2),
               ParallelConfig(pp=2, activation_checkpointing=True, microbatches=2)]
    ranks = run_all(2, configs)
    for i, config in enumerate(configs):
        losses, state = single_process(config, config.dp * config.microbatches)
        assert_parity(config, ranks, i, losses, state)


def _moe_factory():
    from reference.expert_parallel import moe_factory

    # capacity per sequence; every chunk of the batch holds whole sequences, so routing and
    # the balance loss per chunk are the same on one process and on the ranks
    return moe_factory(4, k=2, capacity_factor=2.0)


@pytest.mark.parametrize("world_size, config", [
    (2, "dp=2 ep=2"),
    (8, "moe_4d"),
])
def test_experts_equal_one_process(world_size, config):
    from reference.parallel.config import ParallelConfig

    config = ParallelConfig(dp=2, ep=2) if config == "dp=2 ep=2" else ParallelConfig.moe_4d()
    ranks = run_all(world_size, [config], ffn_factory=_moe_factory())
    losses, state = single_process(config, config.dp * config.microbatches, ffn_factory=_moe_factory())
    assert_parity(config, ranks, 0, losses, state)


def _runs(configs, cfg):
    """Losses only, for runs that cannot equal one process bit for bit."""
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step

    out = []
    for config in configs:
        torch.manual_seed(0)
        pm = parallelize(GPT(cfg), config.mesh().build_groups(), config, batch=(B, T))
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        out.append([float(train_step(pm, opt, idx, tgt).loss) for idx, tgt in batches()])
    return out


def test_dropout_checkpointing_and_bf16():
    """Dropout: the masks of a TP-sharded region are drawn per tp rank (Megatron's RNG
    tracker), so no single process draws the same ones; what must hold is that recomputing
    a checkpointed stage replays the masks (losses equal with and without checkpointing,
    to the bit) and that a run is reproducible.
    bf16: equal to one process under bf16 autocast within `loss(torch.bfloat16)`: bf16 keeps
    8 bits of mantissa (4e-3 relative per rounding) and TP rounds its partial sums at other
    places than one process does, but the loss is a mean over 512 tokens of roundings that do
    not line up, so it moves far less than one rounding."""
    from reference.parallel.config import ParallelConfig

    dropout = GPTConfig.tiny(n_layer=4, block_size=16, dropout=0.1)
    base = ParallelConfig(tp=2, pp=2, sequence_parallel=True, microbatches=2)
    configs = [base, base.with_(activation_checkpointing=True), base]
    plain, ckpt, again = launch(_runs, 4, configs, dropout, timeout=300)[0]
    assert plain == ckpt == again
    no_dropout = single_process(base, 2)[0]
    assert any(not LOSS_TOL.allows(a - b, b) for a, b in zip(plain, no_dropout))  # dropout did act

    bf16 = ParallelConfig(dp=2, tp=2, microbatches=1, precision="bf16")
    got = launch(_runs, 4, [bf16], CFG, timeout=300)[0][0]
    want = single_process(bf16, 2, precision="bf16")[0]
    fp32 = single_process(bf16, 2)[0]
    loss(torch.bfloat16).assert_losses(got, want, f"{bf16} losses against bf16 on one process")
    assert want != fp32  # autocast really computed in bf16
