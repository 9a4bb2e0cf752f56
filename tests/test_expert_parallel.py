"""The single-process mixture of experts: routing, capacity and drop order, the
auxiliary losses, the GPT's feed-forward slot, load balancing measured over
training, and the pictures. The distributed parity tests are in
test_expert_parallel_dist.py.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from reference.expert_parallel import MoE, expert_parameters, moe_factory
from reference.model import GPT, MLP, GPTConfig
from reference.expert_parallel.router import Router, expert_capacity, sort_by_expert
from reference.expert_parallel import viz as moe_viz
from reference.tolerance import forward

TOL = forward()  # fp32: the same sums in another order (reference.tolerance)



def make_moe(seed=0, **kw):
    args = dict(d_model=8, d_ff=16, n_experts=4, k=2, capacity_factor=1.0)
    args.update(kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoE(**args)


def forced_router(n_experts, k, capacity_factor):
    """A router whose gate is the identity (d_model = E): its input *is* the logits."""
    r = Router(n_experts, n_experts, k, capacity_factor)
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(n_experts))
    return r


# ------------------------------------------------------------------ routing
def test_capacity_formula():
    assert expert_capacity(32, 4, 2, 1.25) == 20  # exactly 1.25 * 32 * 2 / 4, not rounded up to 21
    assert expert_capacity(12, 8, 2, 1.0) == 3
    assert expert_capacity(10, 4, 1, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(10, 4, 2, None) == 10  # no limit: a whole group
    assert expert_capacity(10, 2, 2, 4.0) == 10  # never more than the group's tokens


def test_top_k_weights_and_choices():
    torch.manual_seed(0)
    for k in (1, 2, 3):
        r = Router(8, 5, k, None)
        x = torch.randn(2, 7, 8)
        out = r(x)
        probs = F.softmax(x @ r.gate.weight.t(), dim=-1)
        torch.testing.assert_close(out.probs, probs, **TOL)
        top, idx = probs.topk(k, dim=-1)
        assert torch.equal(out.expert_idx, idx)
        if k == 1:  # Switch: the raw probability, so the gate gets a gradient from the output
            torch.testing.assert_close(out.weights, top, **TOL)
        else:  # GShard: renormalised over the chosen experts
            torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 7), **TOL)
            torch.testing.assert_close(out.weights, top / top.sum(-1, keepdim=True), **TOL)
        assert out.kept.all() and out.dropped == 0


def test_the_gate_runs_in_fp32_under_autocast():
    """The logits decide discrete choices: under bf16 autocast the gate's product is still fp32,
    bit for bit what it is without autocast (a bf16 product rounds them to 2^-8 and makes ties)."""
    torch.manual_seed(0)
    r = Router(64, 4, 2, None, bias_update_rate=0.05)
    x = torch.randn(4, 16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = r(x)
    assert out.logits.dtype == torch.float32
    assert torch.equal(out.logits, F.linear(x, r.gate.weight))
    out.weights.sum().backward()  # the gradient reaches the fp32 gate
    assert r.gate.weight.grad.dtype == torch.float32 and r.gate.weight.grad.abs().sum() > 0


def test_drop_order_is_position_within_a_sequence():
    # Every token prefers expert 0: with capacity 2 the first two positions of
    # *each sequence* get it, the others are dropped.
    E, T = 4, 6
    logits = torch.zeros(2, T, E)
    logits[..., 0] = 5.0
    logits[..., 1:] = torch.arange(E - 1, 0, -1.0)  # a fixed order among the others
    r = forced_router(E, 1, capacity_factor=4 / 3)  # ceil(4/3 * 6 * 1 / 4) = 2
    out = r(logits)
    assert out.capacity == 2
    expected = torch.tensor([True, True, False, False, False, False])
    assert torch.equal(out.kept[..., 0], expected.expand(2, T))
    assert out.dropped == 2 * (T - 2)
    assert out.tokens_per_expert().tolist() == [2 * T, 0, 0, 0]
    assert out.kept_per_expert().tolist() == [4, 0, 0, 0]


def test_first_choices_outrank_second_choices():
    # k = 2, capacity 1. Token 0 picks (1, 0); token 1 picks (0, 1). Expert 0's
    # only slot goes to token 1's *first* choice, although token 0 comes first
    # in the sequence: GShard fills all first choices before any second one.
    E = 2
    logits = torch.tensor([[[1.0, 2.0], [2.0, 1.0]]])  # (1, T, E)
    out = forced_router(E, 2, capacity_factor=0.5)(logits)  # ceil(0.5 * 2 * 2 / 2) = 1
    assert out.capacity == 1
    assert out.expert_idx[0].tolist() == [[1, 0], [0, 1]]
    assert out.kept[0].tolist() == [[True, False], [True, False]]


def test_balance_and_z_loss_values():
    E = 4
    # Uniform router (zero gate): P_i = 1/E, so E * sum f_i P_i = sum f_i = 1; z = log(E)^2.
    r = Router(6, E, 2, None, balance_coef=0.5, z_coef=0.25)
    with torch.no_grad():
        r.gate.weight.zero_()
    out = r(torch.randn(3, 5, 6))
    torch.testing.assert_close(out.balance_loss, torch.tensor(1.0), **TOL)
    torch.testing.assert_close(out.z_loss, torch.tensor(math.log(E) ** 2), **TOL)
    torch.testing.assert_close(out.aux_loss, 0.5 * out.balance_loss + 0.25 * out.z_loss, **TOL)
    # Collapsed router (every token certain of expert 0, k = 1): f_0 = P_0 = 1, loss = E.
    logits = torch.zeros(1, 5, E)
    logits[..., 0] = 40.0
    collapsed = forced_router(E, 1, None)(logits)
    torch.testing.assert_close(collapsed.balance_loss, torch.tensor(float(E)), **TOL)


def test_sort_by_expert_layout():
    torch.manual_seed(1)
    r = Router(8, 4, 2, 1.0)
    routing = r(torch.randn(3, 10, 8))
    plan = sort_by_expert(routing)
    assert plan.counts.tolist() == routing.kept_per_expert().tolist()
    assert torch.equal(plan.expert_idx, plan.expert_idx.sort().values)  # grouped by expert
    for e in range(4):  # token order inside each expert's block
        block = plan.token_idx[plan.expert_idx == e]
        assert torch.equal(block, block.sort().values)
    assert len(plan.token_idx) == routing.kept.sum()


# ------------------------------------------------------------------- MoE
def brute_force(moe, x):
    """Token by token, choice by choice: the definition of the MoE output."""
    routing = moe.router(x)
    G, T, _ = x.shape
    out = torch.zeros_like(x)
    for g in range(G):
        for t in range(T):
            for j in range(moe.k):
                if routing.kept[g, t, j]:
                    e = routing.expert_idx[g, t, j]
                    out[g, t] += routing.weights[g, t, j] * moe.experts[e](x[g, t][None])[0]
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(x)
    return out, routing


@pytest.mark.parametrize("k,capacity_factor,shared", [(1, 1.0, False), (2, 1.0, True), (2, None, False)])
def test_moe_equals_token_by_token_definition(k, capacity_factor, shared):
    moe = make_moe(k=k, capacity_factor=capacity_factor, shared_expert=shared)
    x = torch.randn(3, 9, 8, generator=torch.Generator().manual_seed(2))
    y, aux = moe(x)
    expected, routing = brute_force(moe, x)
    torch.testing.assert_close(y, expected, **TOL)
    torch.testing.assert_close(aux, routing.aux_loss, **TOL)
    assert moe.last_dropped == routing.dropped
    assert moe.last_stats.dropped_tokens == int((~routing.kept).all(-1).sum())
    if k == 1:
        assert moe.last_stats.dropped_tokens == moe.last_dropped
    if capacity_factor is not None:
        assert moe.last_dropped > 0  # the case really drops tokens
    # A 2-D input is one group of all its tokens.
    y2, _ = moe(x[0])
    torch.testing.assert_close(y2, y[0], **TOL)


def test_identical_experts_equal_one_dense_mlp():
    # With k = 2 renormalised weights summing to 1 and no dropping, four copies
    # of one expert are that expert.
    moe = make_moe(capacity_factor=None)
    for e in moe.experts[1:]:
        e.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(moe(x)[0], moe.experts[0](x), **TOL)


def test_batch_split_gives_the_same_outputs_and_mean_aux_loss():
    # Routing groups are sequences, so two halves of a batch (two data-parallel
    # ranks, or two micro-batches) route, drop and lose exactly as the whole.
    moe = make_moe(k=2, capacity_factor=1.0, z_coef=0.1)
    x = torch.randn(4, 9, 8, generator=torch.Generator().manual_seed(3))
    y, aux = moe(x)
    dropped = moe.last_dropped
    halves = [moe(x[:2]), moe(x[2:])]
    torch.testing.assert_close(torch.cat([h[0] for h in halves]), y, **TOL)
    torch.testing.assert_close((halves[0][1] + halves[1][1]) / 2, aux, **TOL)
    moe(x[:2])
    d0 = moe.last_dropped
    moe(x[2:])
    assert d0 + moe.last_dropped == dropped > 0


def test_errors():
    with pytest.raises(ValueError, match="k=5 exceeds n_experts=4"):
        make_moe(k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        make_moe(capacity_factor=0.0)
    with pytest.raises(ValueError, match="n_experts"):
        make_moe(n_experts=0)
    with pytest.raises(ValueError, match=r"\(B, T, 8\)"):
        make_moe()(torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match="k=3 exceeds n_experts=2"):
        moe_factory(2, k=3)


def test_gpt_feed_forward_slot():
    cfg = GPTConfig.tiny()
    model = GPT.from_config_seed(cfg, 0, ffn_factory=moe_factory(4, k=2, layers=[1], z_coef=0.01))
    assert isinstance(model.h[0].ffn, MLP) and isinstance(model.h[1].ffn, MoE)
    assert len(expert_parameters(model)) == 4 * 4  # 4 experts x (c_fc, c_proj) x (weight, bias)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx, idx)
    assert model.h[1].ffn.last_stats is not None and model.last_aux_loss > 0
    torch.testing.assert_close(loss, model.last_lm_loss + model.last_aux_loss, **TOL)
    loss.backward()
    assert model.h[1].ffn.router.gate.weight.grad.abs().sum() > 0
    # The MoE's experts got the GPT-2 initialisation (c_proj scaled by 1/sqrt(2 n_layer)).
    std = model.h[1].ffn.experts[0].c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.004


# --------------------------------------------------------- load balancing
def imbalance_over_training(balance_coef, steps=40, seed=0):
    """Train a small MoE on a regression task; max/mean tokens per expert at the first and last step.

    The inputs share a random offset, which adds a fixed score to each expert's
    logit: from the start a few experts take most tokens.
    """
    g = torch.Generator().manual_seed(seed)
    C, E = 16, 8
    moe = make_moe(seed, d_model=C, d_ff=32, n_experts=E, k=2, capacity_factor=None,
                   balance_coef=balance_coef, z_coef=0.0)
    teacher = torch.randn(C, C, generator=g)
    offset = 1.5 * torch.randn(C, generator=g)
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    loads = []
    for _ in range(steps):
        x = torch.randn(8, 16, C, generator=g) + offset
        y, aux = moe(x)
        loss = F.mse_loss(y, torch.tanh(x @ teacher / 4)) + aux
        opt.zero_grad()
        loss.backward()
        opt.step()
        loads.append(moe.last_stats.tokens_per_expert.float())
    ratio = [(t.max() / t.mean()).item() for t in (loads[0], loads[-1])]
    return ratio, loads[0], loads[-1]


def test_load_balancing_loss_balances_the_experts():
    (before, after_lb), first, last_lb = imbalance_over_training(balance_coef=0.1)
    (_, after_none), _, last_none = imbalance_over_training(balance_coef=0.0)
    print(f"max/mean tokens per expert: start {before:.2f}; after 40 steps with the "
          f"balancing loss {after_lb:.2f}, without {after_none:.2f}")
    print("start", first.int().tolist(), "with", last_lb.int().tolist(), "without", last_none.int().tolist())
    # Measured on this problem: 3.03 at the start, about 1.2 with the loss, 2.8 without.
    assert before > 2.5
    assert after_lb < 1.6 < after_none
    assert (last_lb > 0).all() and (last_none == 0).any()  # without the loss some experts starve


# --------------------------------------------------------------- pictures
def test_pictures():
    moe = make_moe(k=2, capacity_factor=1.0)
    moe(torch.randn(2, 12, 8))
    s = moe.last_stats
    fig = moe_viz.plot_tokens_per_expert({"routed": s.tokens_per_expert, "kept": s.kept_per_expert},
                                         capacity=s.capacity * 2)
    assert isinstance(fig, Figure) and len(fig.axes[0].patches) == 2 * 4
    fig = moe_viz.plot_routing(s.expert_idx[0], s.kept[0], n_experts=4)
    crosses = int((~s.kept[0]).sum())
    assert len(fig.axes[0].patches) == 12 * 2 and len(fig.axes[0].lines) == 2 * crosses
    fig = moe_viz.plot_all_to_all([[3, 1], [2, 5]])
    assert "3 of 11 rows cross ranks" in fig.axes[0].get_title()
    fig = moe_viz.plot_expert_memory([100, 100], [50, 50])
    assert len(fig.axes[0].patches) == 4
    assert fig._repr_png_().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="square"):
        moe_viz.plot_all_to_all([1, 2, 3])
