"""The claims of notebook 05 that the module tests do not already measure.

* a larger capacity factor never drops more, and no limit drops nothing; a cap makes
  every expert compute its empty slots, dropless computes every assignment;
* Switch (k = 1) keeps the raw probability because a renormalised single
  weight is always 1 and gives the gate no gradient from the output;
* memory per rank with expert parallelism is D + X / ep for D bytes of
  replicated parameters and X of experts, measured on a GPT at ep = 2 and 4,
  and the experts' gradients and AdamW state are split the same way;
* each expert is as large as the dense model's MLP;
* the expert-parallel batch sends rank 1 far more rows than rank 0, within its slots;
* the gate and balance pictures of `reference.expert_parallel.viz`.

The exact 1/8 at 8 ranks is `test_eight_ranks_hold_an_eighth_of_the_experts`
in test_expert_parallel_dist.py; the bytes formula, parity and load balancing
are in test_expert_parallel.py and test_expert_parallel_dist.py.
"""
import pytest
import torch
from matplotlib.figure import Figure

from reference.data import synthetic_batch
from reference.expert_parallel import MoE, expert_parameters, moe_all_reduce_gradients, moe_factory, shard_experts
from reference.expert_parallel import viz as moe_viz
from reference.mesh import Mesh
from reference.model import GPT, GPTConfig
from reference.runtime import launch

C, D_FF, E = 16, 32, 8



def make_moe(**kw):
    args = dict(d_model=C, d_ff=D_FF, n_experts=E, k=2, capacity_factor=None)
    args.update(kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MoE(**args)


def skewed_batch():
    """The notebook's batch: a shared offset makes a few experts popular (B=4, T=16)."""
    offset = 1.5 * torch.randn(C, generator=torch.Generator().manual_seed(1))
    return torch.randn(4, 16, C, generator=torch.Generator().manual_seed(2)) + offset


def test_larger_capacity_factor_drops_less():
    x = skewed_batch()
    G = x.shape[0]
    dropped, lost_tokens = [], []
    for f in (0.5, 1.0, 1.25, 2.0, None):
        moe = make_moe(capacity_factor=f)
        moe(x)
        s = moe.last_stats
        assert (s.kept_per_expert <= s.capacity * G).all()  # capacity caps every expert's rows
        dropped.append(s.dropped)
        lost_tokens.append(s.dropped_tokens)
    assert dropped == sorted(dropped, reverse=True) and lost_tokens == sorted(lost_tokens, reverse=True)
    assert dropped[0] > dropped[1] > 0 and dropped[-1] == 0 and lost_tokens[-1] == 0


def test_capacity_is_a_trade_off_fixed_shapes_compute_empty_slots_dropless_computes_all():
    """Notebook 05's table: with a cap every expert computes E * capacity * G rows, more than
    the assignments it kept; dropless (None) computes every assignment and nothing else."""
    x = skewed_batch()
    G, T = x.shape[:2]
    rows = {}
    for f in (0.5, 1.0, 1.25, 2.0, None):
        moe = make_moe(capacity_factor=f)
        moe(x)
        s = moe.last_stats
        rows[f] = (E * s.capacity * G, int(s.kept_per_expert.sum()), int(s.kept_per_expert.max()))
    assert rows[None][1] == G * T * 2                                   # dropless: all k T G assignments
    fixed = [rows[f][0] for f in (0.5, 1.0, 1.25, 2.0)]
    assert fixed == sorted(fixed) and all(rows[f][0] > rows[f][1] for f in (0.5, 1.0, 1.25, 2.0))
    assert rows[None][2] > rows[2.0][2]                                 # the busiest expert grows uncapped
    assert (rows[1.0][0], rows[1.0][1]) == (128, 58)                    # the notebook's printed row at f = 1


def test_the_skewed_ep_batch_sends_rank_1_far_more_rows_within_its_slots():
    """Notebook 05's expert-parallel batch (8 sequences of 16, the capacity section's offset,
    capacity factor 1): rank 1's experts (2 and 3 of 8 on 4 ranks) receive the most rows, at
    least twice rank 0's, and no rank more than its experts' slots. Groups are sequences, so
    the rows a rank receives are the kept assignments of its experts over the whole batch."""
    offset = 1.5 * torch.randn(C, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, C, generator=g) + offset
    moe = make_moe(capacity_factor=1.0)
    moe(x)
    s = moe.last_stats
    received = s.kept_per_expert.view(4, E // 4).sum(dim=1)
    assert int(received.argmax()) == 1 and received[1] >= 2 * received[0]
    assert (received <= (E // 4) * s.capacity * 8).all()


def test_switch_renormalised_weight_gives_the_gate_no_gradient():
    x = skewed_batch()
    grads = {}
    for normalize in (True, False):
        moe = make_moe(k=1, normalize_weights=normalize, balance_coef=0.0, z_coef=0.0)
        y, _ = moe(x)
        y.sum().backward()  # the output only: no auxiliary loss
        grads[normalize] = moe.router.gate.weight.grad.abs().max().item()
    # w / w = 1: the gradient is zero up to rounding (about 1e-7 here), against order 1 for the raw weight.
    assert grads[True] < 1e-5 and grads[False] > 0.1


@pytest.mark.parametrize("k", [1, 2])
def test_balance_loss_is_1_when_uniform_and_e_over_k_when_collapsed(k):
    """Notebook 05's range of the Switch loss E * sum_i f_i P_i: 1 for uniform routing,
    E / k (not E) when every token's k choices are the same k experts."""
    from reference.expert_parallel.router import Router

    x = torch.ones(2, 16, C)                      # every token alike: the same choices everywhere
    router = Router(C, E, k=k)
    with torch.no_grad():
        router.gate.weight.zero_()                # every probability 1/E
    assert router(x).balance_loss.item() == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():
        router.gate.weight[:k] = 10.0             # experts 0 .. k-1 take all the probability, equally
    routing = router(x)
    assert sorted(routing.expert_idx[0, 0].tolist()) == list(range(k))
    assert routing.balance_loss.item() == pytest.approx(E / k, rel=1e-6)
    # and uniform routing in the sense of the load too: every expert chosen equally often, P = 1/E
    T_u = 4 * E
    f = torch.nn.functional.one_hot(torch.arange(T_u * k) % E, E).float().mean(dim=0)   # (E,) f_i
    assert (E * (f * torch.full((E,), 1 / E)).sum()).item() == pytest.approx(1.0)


def test_balance_loss_goes_below_1_where_the_mass_sits_on_an_expert_never_picked():
    """Notebook 05: 1 is the loss under uniform routing, not its least value. Three experts,
    k = 1, two tokens that each pick their favourite (experts 0 and 1) while expert 2, never
    picked, holds almost half of every token's probability: E sum f_i P_i = 3 (0.5 x 0.255 x 2)."""
    from reference.expert_parallel.router import Router

    probs = torch.tensor([[0.5, 0.01, 0.49], [0.01, 0.5, 0.49]])     # (tokens, E)
    router = Router(2, 3, k=1, capacity_factor=None)
    with torch.no_grad():
        router.gate.weight.copy_(probs.log().T)                       # token t's logits: log probs[t]
    routing = router(torch.eye(2).unsqueeze(0))                       # (1, 2, 2): one group of 2 tokens
    assert routing.expert_idx.flatten().tolist() == [0, 1]
    assert routing.balance_loss.item() == pytest.approx(3 * 0.5 * 0.255 * 2, rel=1e-5)
    assert routing.balance_loss.item() < 1


# ----------------------------------------------------------- memory per rank
def make_gpt():
    return GPT.from_config_seed(GPTConfig.tiny(), 0, ffn_factory=moe_factory(E, k=2, capacity_factor=1.0))


def split_bytes(tensors_of, model):
    """(expert bytes, other bytes) of the tensors `tensors_of(p)` gives for each parameter p."""
    experts = {id(p) for p in expert_parameters(model)}
    sizes = [0, 0]
    for p in model.parameters():
        for t in tensors_of(p):
            sizes[id(p) not in experts] += t.numel() * t.element_size()
    return tuple(sizes)


def _memory_per_rank():
    out = {}
    for ep in (2, 4):
        mesh = Mesh(dp=4, ep=ep).build_groups()
        model = shard_experts(make_gpt(), mesh.ep_group)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = synthetic_batch(4, 16, seed=0)
        _, loss = model(x[mesh.dp_rank:mesh.dp_rank + 1], y[mesh.dp_rank:mesh.dp_rank + 1])
        loss.backward()
        moe_all_reduce_gradients(model, mesh.dp_group, mesh.edp_group)
        opt.step()
        out[ep] = dict(
            params=split_bytes(lambda p: [p], model),
            grads=split_bytes(lambda p: [p.grad], model),
            adam=split_bytes(lambda p: [opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]], model))
    return out


def test_memory_per_rank_is_dense_plus_experts_over_ep():
    results = launch(_memory_per_rank, 4, timeout=300)
    X, D = split_bytes(lambda p: [p], make_gpt())
    assert X > D > 0
    for ep in (2, 4):
        for rank, res in enumerate(results):
            got = res[ep]
            assert got["params"] == (X // ep, D), f"ep={ep} rank {rank}"
            assert X % ep == 0
            assert got["grads"] == got["params"]  # every parameter a rank holds has a gradient, no other
            assert got["adam"] == (2 * X // ep, 2 * D)  # two moments per parameter, split like it
        fraction = (D + X / ep) / (D + X)
        print(f"ep={ep}: expert bytes per rank {X // ep} of {X}; whole model {fraction:.4f} of one process")
        assert 1 / ep < fraction < 1


def test_an_expert_is_as_large_as_the_dense_mlp():
    # So a rank holding E / ep experts of a layer holds E / ep times the dense model's MLP.
    cfg = GPTConfig.tiny()
    mlp = sum(p.numel() for p in GPT.from_config_seed(cfg, 0).h[0].ffn.parameters())
    model = GPT.from_config_seed(cfg, 0, ffn_factory=moe_factory(64, k=2))
    assert all(sum(p.numel() for p in e.parameters()) == mlp for e in model.h[0].ffn.experts)
    assert sum(p.numel() for p in expert_parameters(model)) == cfg.n_layer * 64 * mlp


# ------------------------------------------------------------------ pictures
def test_plot_gate_frames_the_choices():
    moe = make_moe()
    routing = moe.router(skewed_batch())
    probs, idx, w = routing.probs[0].detach(), routing.expert_idx[0], routing.weights[0].detach()
    fig = moe_viz.plot_gate(probs, idx, w)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(ax.patches) == 16 * 2  # one frame per (token, choice)
    assert [t.get_text() for t in ax.texts][:2] == [f"{w[0, 0]:.2f}", f"{w[0, 1]:.2f}"]
    assert fig._repr_png_().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="expert_idx and weights"):
        moe_viz.plot_gate(probs, idx, w[:, :1])


def test_plot_balance_history_draws_each_run():
    loads = {"a": torch.tensor([[6, 2], [4, 4], [5, 3]]), "b": torch.tensor([[8, 0], [8, 0], [7, 1]])}
    fig = moe_viz.plot_balance_history(loads, {"a": [1.2, 1.0, 1.05], "b": [2.0, 2.0, 1.9]})
    heat_a, heat_b, imbalance, balance = fig.axes[:4]
    assert [heat_a.get_title(), heat_b.get_title()] == ["a", "b"]
    ratio_b = imbalance.lines[1].get_ydata()
    assert list(ratio_b) == pytest.approx([2.0, 2.0, 7 / 4])  # max / mean of run b at each step
    assert list(balance.lines[0].get_ydata()) == [1.2, 1.0, 1.05]
    assert len(moe_viz.plot_balance_history(loads).axes) == 2 + 1 + 1  # heat maps, curve, colour bar
    with pytest.raises(ValueError, match="steps, E"):
        moe_viz.plot_balance_history({"a": [1, 2, 3]})
