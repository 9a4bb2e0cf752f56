"""Balancing experts without an auxiliary loss (`reference.expert_parallel.bias_balance`).

The bias moves by +-u per step from integer counts, so the parallel run's bias trajectory
is compared with one process's *exactly* (the same counts give the same signs, added in the
same order); the weights by the course's tolerance policy (`sweep_run.compare`).
"""
from __future__ import annotations

import pytest
import torch

from reference.expert_parallel import MoE, moe_factory, update_expert_bias
from reference.expert_parallel.router import Router
from reference.model import GPT, GPTConfig
from reference.parallel.config import ParallelConfig
from reference.runtime import launch
from sweep import BATCH, MODEL_SIZES, N_EXPERTS, SweepCase
from sweep_run import BIAS_RATE as RATE, EPS, LR, STEPS, batches, compare


def _model(gate="softmax"):
    """The sweep's MoE GPT, bias-balanced, with the softmax gate or DeepSeek-V3's sigmoid one."""
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(**MODEL_SIZES), ffn_factory=moe_factory(
        N_EXPERTS, k=2, capacity_factor=2.0, bias_update_rate=RATE, score_function=gate))


def _biases(modules) -> dict:
    """{router's name: its bias}, names as in the whole model (a stage keeps them)."""
    return {name: m.expert_bias.clone() for mod in modules for name, m in mod.named_modules()
            if getattr(m, "expert_bias", None) is not None}


def _ranks(configs):
    """On every rank, per config: (losses, bias after each step, full weights on rank 0)."""
    import torch.distributed as dist

    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from reference.runtime import device

    out = []
    for config, gate in configs:
        pm = parallelize(_model(gate).to(device()), config.mesh().build_groups(), config, batch=BATCH)
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses, trajectory = [], []
        for idx, tgt in batches():
            losses.append(float(train_step(pm, opt, idx, tgt).loss))
            trajectory.append({k: v.cpu() for k, v in _biases(pm.stages).items()})
        state = full_state_dict(pm)
        out.append((losses, trajectory, state if dist.get_rank() == 0 else None))
    return out


def _one_process(config, gate):
    from reference.train.single import accumulated_step

    model = _model(gate)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, trajectory = [], []
    for idx, tgt in batches():
        losses.append(accumulated_step(model, opt, idx, tgt, config.dp * config.microbatches)[0])
        trajectory.append(_biases([model]))
    return losses, trajectory, {k: v.detach().clone() for k, v in model.state_dict().items()}


# (layout, gate): both gates composed with dp, ep, tp (+ SP) and pp, in the same launches
TWO = [(ParallelConfig(dp=2, ep=2, microbatches=2), "softmax"),
       (ParallelConfig(pp=2, microbatches=2, activation_checkpointing=True), "softmax"),
       (ParallelConfig(pp=2, microbatches=2), "sigmoid")]
FOUR = [(ParallelConfig(dp=2, tp=2, sequence_parallel=True, ep=2, microbatches=2), "softmax"),
        (ParallelConfig(dp=2, pp=2, ep=2, microbatches=2), "softmax"),
        (ParallelConfig(dp=2, tp=2, sequence_parallel=True, ep=2, microbatches=2), "sigmoid")]


@pytest.mark.parametrize("configs", [TWO, FOUR], ids=["2 ranks", "4 ranks"])
def test_the_bias_and_the_weights_follow_one_process(configs):
    results = launch(_ranks, configs[0][0].world_size, configs)
    for i, (config, gate) in enumerate(configs):
        want_losses, want_bias, want_state = _one_process(config, gate)
        assert any(float(b.abs().max()) > 0 for b in want_bias[-1].values())  # the bias did move
        for rank in results:
            for step, (got, want) in enumerate(zip(rank[i][1], want_bias)):
                for name, bias in got.items():  # each rank's routers (a stage holds some)
                    assert torch.equal(bias, want[name]), (config, gate, step, name, bias, want[name])
        row = compare(SweepCase(config, moe=True, bias=True), (results[0][i][0], [False] * STEPS, results[0][i][2]),
                      (want_losses, [False] * STEPS, want_state))
        assert row["ok"], (gate, row["why"])


def test_the_bias_chooses_and_never_weighs():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, k=2, capacity_factor=None, bias_update_rate=RATE)
    x = torch.randn(2, 6, 8)
    plain = moe.router(x)
    moe.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # experts 0 and 1 always win
    biased = moe.router(x)
    assert (biased.expert_idx.sort(-1).values == torch.tensor([0, 1])).all()
    want = plain.probs.gather(-1, biased.expert_idx)
    torch.testing.assert_close(biased.weights, want / want.sum(-1, keepdim=True), rtol=0, atol=0)
    biased.weights.sum().backward()  # the gate's gradient exists; the bias is a buffer, no gradient
    assert moe.router.gate.weight.grad is not None
    assert [n for n, _ in moe.named_parameters() if "bias" in n and "router" in n] == []


def test_the_update_sums_the_step_and_moves_each_bias_against_its_load():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, k=1, capacity_factor=None, bias_update_rate=RATE)
    for _ in range(3):  # three micro-batches, counted together
        moe(torch.randn(2, 5, 8))
    load = moe.router.step_tokens_per_expert.clone()
    assert int(load.sum()) == 3 * 2 * 5
    with torch.no_grad():  # a forward without autograd (a recompute's first run) counts nothing
        moe(torch.randn(2, 5, 8))
    assert torch.equal(moe.router.step_tokens_per_expert, load)
    update_expert_bias(moe)
    want = RATE * torch.sign(load.float().mean() - load.float())
    assert torch.equal(moe.router.expert_bias, want) and int(moe.router.step_tokens_per_expert.sum()) == 0
    assert update_expert_bias(torch.nn.Linear(2, 2)) is None  # no biased router: nothing to do
    with pytest.raises(ValueError, match="bias_update_rate"):
        MoE(8, 16, 4, bias_update_rate=-1.0)


def test_the_bias_balances_a_skewed_router():
    """From a router skewed towards one expert, the bias brings max / mean load down where
    plain routing leaves it (the claim notebook 05 measures over training)."""
    def max_over_mean(rate, steps=40):
        torch.manual_seed(0)
        moe = MoE(8, 16, 4, k=1, capacity_factor=None, bias_update_rate=rate)
        with torch.no_grad():
            moe.router.gate.weight[0] = 0.2  # expert 0 scores high for tokens of positive mean
        x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1)) + 1.0
        ratios = []
        for _ in range(steps):
            moe(x)
            load = moe.last_stats.tokens_per_expert.float()
            ratios.append(float(load.max() / load.mean()))
            if rate:
                update_expert_bias(moe)
        return sum(ratios[-10:]) / 10  # the last 10 steps: the bias oscillates by +-u about balance
    skewed, balanced = max_over_mean(0.0), max_over_mean(0.01)
    assert skewed > 3.0 and balanced < 1.25, (skewed, balanced)  # 3.9 and 1.1 on this data


def test_deepseek_v3_gate_on_a_worked_case():
    """DeepSeek-V3's router (technical report, section 2.1.2) written out from its formulas on
    3 tokens, 4 experts, top-2: affinities s_i = sigmoid(u . e_i) (eq. 15); the bias b_i added
    only to choose the top-k (eq. 16); gates g_i = s_i / sum of the chosen s (eq. 13); the
    complementary sequence-wise balance loss alpha * sum_i f_i P_i with f_i = E / (k T) x the
    tokens whose top-k of s (without the bias) holds i, P_i = mean of s_i / sum_j s_j (eq. 17-20),
    alpha = 0.0001. The bias moves as Megatron-Core's `get_updated_expert_bias` moves it, at its
    default rate 1e-3 (DeepSeek-V3's gamma): loads [30, 7, 23, 4] give -1e-3, +1e-3, -1e-3, +1e-3."""
    import math

    E, k, alpha = 4, 2, 1e-4
    logits = [[2.0, 1.0, 0.5, -1.0], [0.0, 0.3, -0.2, 0.1], [-1.0, 0.4, 1.2, 0.9]]
    bias = [-0.3, 0.0, 0.2, 0.0]
    router = Router(E, E, k, capacity_factor=None, score_function="sigmoid", balance_coef=alpha,
                    z_coef=0.0, bias_update_rate=1e-3)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(E))  # the logits u . e_i are the input itself
        router.expert_bias.copy_(torch.tensor(bias))
    routing = router(torch.tensor([logits]))

    T = len(logits)
    s = [[1 / (1 + math.exp(-u)) for u in row] for row in logits]
    top = lambda row: sorted(range(E), key=lambda i: -row[i])[:k]
    chosen = [top([si + bi for si, bi in zip(row, bias)]) for row in s]
    gates = [[row[i] / sum(row[j] for j in c) for i in c] for row, c in zip(s, chosen)]
    f = [E / (k * T) * sum(i in top(row) for row in s) for i in range(E)]
    P = [sum(row[i] / sum(row) for row in s) / T for i in range(E)]
    loss = alpha * sum(fi * Pi for fi, Pi in zip(f, P))

    assert chosen[0] == [2, 1] and top(s[0]) == [0, 1]  # the bias changed token 0's choice
    assert routing.expert_idx[0].tolist() == chosen
    torch.testing.assert_close(routing.weights[0], torch.tensor(gates), rtol=1e-6, atol=0)
    torch.testing.assert_close(routing.aux_loss, torch.tensor(loss), rtol=1e-6, atol=0)
    assert [round(fi * k * T / E) for fi in f] == [1, 2, 1, 2]  # times each expert is in a top-2 of s

    router.move_bias(torch.tensor([30, 7, 23, 4]))
    assert torch.equal(router.expert_bias, torch.tensor(bias) + torch.tensor([-1e-3, 1e-3, -1e-3, 1e-3]))
    with pytest.raises(ValueError, match="score_function"):
        Router(E, E, k, score_function="softplus")
