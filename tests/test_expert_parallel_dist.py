"""Expert parallelism equals the single-process MoE, and its bytes and memory are measured.

One 4-rank launch checks ep = 1, 2 (with dp: edp = 2) and 4 on the MoE layer
alone and on a GPT with gradient accumulation; one 8-rank launch measures the
expert memory per rank. The oracle runs in the test process; the ranks return
what they computed and the comparisons happen here.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference import comms
from reference.data import synthetic_batch
from reference.expert_parallel import (ExpertParallelMoE, MoE, expert_parameters, moe_all_reduce_gradients,
                                       moe_factory, shard_experts)
from reference.expert_parallel.comms import all_to_all_bytes_per_step
from reference.mesh import Mesh
from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.tolerance import adamw_weights, forward, gradient
from reference.train.single import accumulated_step

# Tolerances: the course's policy (reference.tolerance says why). Outputs: `forward()`;
# gradients averaged over the dp ranks (and micro-batches): `gradient(n)`; parameters after
# AdamW steps: `adamw_weights(steps, lr)`, every weight and the means
# (over all of a rank's and over each tensor).
# AdamW's step is lr * m / (sqrt(v) + eps): on a gradient element near zero (a sum of
# contributions that cancel, which routing makes common) a rounding difference can take
# that whole step either way; eps = 1e-6 instead of PyTorch's 1e-8 makes that rarer.
TOL = forward()
ADAM = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)
B, T, C, D_FF, E = 8, 12, 8, 16, 8  # 8 sequences of 12 tokens; 8 experts divide by ep = 1, 2, 4, 8
STEPS = 3
CASES = {
    "switch k=1, dropping": dict(k=1, capacity_factor=1.0),
    "gshard k=2, dropping, shared expert, z-loss": dict(k=2, capacity_factor=1.0, shared_expert=True, z_coef=0.01),
    "k=2, no capacity limit": dict(k=2, capacity_factor=None),
}
MESHES = [dict(dp=4, ep=4), dict(dp=4, ep=2), dict(dp=4, ep=1)]


def make_moe(case):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MoE(C, D_FF, E, **CASES[case], balance_coef=0.1)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


def global_names(model):
    """Parameters by name, local experts renamed to their global index (what the oracle calls them)."""
    rename = {}
    for prefix, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            for expert, gid in zip(m.experts, m.expert_ids):
                for name, p in expert.named_parameters():
                    rename[id(p)] = f"{prefix}.experts.{gid}.{name}".lstrip(".")
    return {rename.get(id(p), name): p for name, p in model.named_parameters()}


def train_layer(layer, dp_rank=0, dp=1, reduce=None):
    """STEPS AdamW steps of an MoE layer on this rank's slice of each batch; what each step produced."""
    opt = torch.optim.AdamW(layer.parameters(), **ADAM)
    rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
    steps = []
    for step in range(STEPS):
        x, target = batch(step)
        x = x[rows].clone().requires_grad_()
        with comms.meter() as a2a:
            y, aux = layer(x)
            (F.mse_loss(y, target[rows]) + aux).backward()
        with comms.meter() as ar:
            if reduce is not None:
                reduce(layer)
        steps.append(dict(
            _step_record(layer, y, x.grad / dp, aux),  # d(global mean loss)/dx: this rank's loss is 1/dp of it
            a2a_bytes=a2a.sent_bytes("all_to_all"), a2a_calls=a2a.calls("all_to_all"),
            ar_payload={g: ar.payload_bytes("all_reduce", g) for g in ("dp", "edp")}))
        opt.step()
        opt.zero_grad()
    return steps, {n: p.detach().clone() for n, p in global_names(layer).items()}


def _step_record(layer, y, x_grad, aux):
    """What a step of the layer produced: output, input gradient, aux loss, routing, gradients."""
    stats = layer.last_stats
    return dict(y=y.detach(), x_grad=x_grad, aux=aux.detach(), dropped=stats.dropped,
                send_counts=stats.send_counts, expert_idx=stats.expert_idx, kept=stats.kept,
                grads={n: p.grad.clone() for n, p in global_names(layer).items()})


def gpt_config():
    return GPTConfig.tiny(block_size=16)


def make_gpt():
    return GPT.from_config_seed(gpt_config(), 0, ffn_factory=moe_factory(
        4, k=2, capacity_factor=1.0, layers=[1], balance_coef=0.05, z_coef=0.01))


def gpt_optimizer(model):
    # A GPT's learning rate; Adam's step error on rounding-level gradient
    # differences grows with lr (see ADAM), and 1e-2 is large for a transformer.
    return torch.optim.AdamW(model.parameters(), **dict(ADAM, lr=1e-3))


def gpt_batch(step):
    """The global batch of a step: 8 sequences of 16 tokens."""
    return synthetic_batch(8, 16, seed=0, step=step)


def train_gpt(model, dp_rank=0, dp=1, micro=1, reduce=None, steps=2):
    """AdamW steps on 8 sequences a step: this rank's share, in `micro` micro-batches.

    Returns the first step's gradients and the parameters after the last step.
    """
    opt = gpt_optimizer(model)
    b = 8 // dp
    grads = None
    for step in range(steps):
        x, y = gpt_batch(step)
        x, y = x[dp_rank * b:(dp_rank + 1) * b], y[dp_rank * b:(dp_rank + 1) * b]
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            _, loss = model(xm, ym)
            (loss / micro).backward()  # the mean over micro-batches, aux loss included
        if reduce is not None:
            reduce(model)
        if grads is None:
            grads = {n: p.grad.clone() for n, p in global_names(model).items()}
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().clone() for n, p in global_names(model).items()}


def _four_ranks():
    out = {}
    errors = []
    for spec in MESHES:
        mesh = Mesh(**spec).build_groups()
        reduce = lambda m, mesh=mesh: moe_all_reduce_gradients(m, mesh.dp_group, mesh.edp_group)  # noqa: E731
        for case in CASES:
            layer = ExpertParallelMoE.from_dense(make_moe(case), mesh.ep_group)
            steps, params = train_layer(layer, mesh.dp_rank, mesh.dp, reduce)
            out[(mesh.ep, case)] = dict(steps=steps, params=params, dp_rank=mesh.dp_rank, ep_rank=mesh.ep_rank, edp_rank=mesh.edp_rank,
                                        expert_ids=layer.expert_ids)
        if mesh.ep == 4:
            try:
                ExpertParallelMoE(C, D_FF, 6, k=2, group=mesh.ep_group)
            except ValueError as e:
                errors.append(str(e))
    mesh = Mesh(dp=4, ep=2).build_groups()
    model = shard_experts(make_gpt(), mesh.ep_group)
    out["gpt"] = train_gpt(model, mesh.dp_rank, mesh.dp, micro=2,
                           reduce=lambda m: moe_all_reduce_gradients(m, mesh.dp_group, mesh.edp_group))
    out["errors"] = errors
    # from_dense copies every part in: it replays no master-weight draw (built directly, one)
    draws, replay = [], ExpertParallelMoE._draw_from_seed
    ExpertParallelMoE._draw_from_seed = lambda self, seed: draws.append(seed) or replay(self, seed)
    try:
        ExpertParallelMoE.from_dense(make_moe(next(iter(CASES))), mesh.ep_group)
        out["draws"] = len(draws)
        ExpertParallelMoE(C, D_FF, 4, k=2, group=mesh.ep_group)
        out["draws"] = (out["draws"], len(draws))
    finally:
        ExpertParallelMoE._draw_from_seed = replay
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return launch(_four_ranks, 4, timeout=300)


@functools.lru_cache(maxsize=None)
def oracle(case):
    """`accumulated_step` on the whole batch with the layer's loss: what `train_layer` records
    of each step (without the meters) and the parameters after the last."""
    layer = make_moe(case)
    opt = torch.optim.AdamW(layer.parameters(), **ADAM)
    steps = []
    for step in range(STEPS):
        x, target = batch(step)
        x.requires_grad_()
        out = {}

        def loss_fn(m, x, target, out=out):
            out["y"], out["aux"] = m(x)
            return F.mse_loss(out["y"], target), out["aux"]

        accumulated_step(layer, opt, x, target, loss_fn=loss_fn)
        steps.append(_step_record(layer, out["y"], x.grad, out["aux"]))  # the step's gradients stay in .grad
    return steps, {n: p.detach().clone() for n, p in global_names(layer).items()}


def gpt_oracle(model, steps=2):
    """`accumulated_step` on the 8 sequences at once: what `train_gpt` returns."""
    opt = gpt_optimizer(model)
    grads = None
    for step in range(steps):
        accumulated_step(model, opt, *gpt_batch(step))
        if grads is None:  # the step's gradients stay in .grad
            grads = {n: p.grad.clone() for n, p in global_names(model).items()}
    return grads, {n: p.detach().clone() for n, p in global_names(model).items()}


def expected_a2a_bytes(oracle_step, spec, dp_rank):
    """The formula of `reference.expert_parallel.comms`, from the oracle's routing of the whole batch."""
    ep = spec["ep"]
    b, e_local = B // spec["dp"], E // ep
    first = dp_rank - dp_rank % ep  # the ep group: dp ranks first ... first + ep - 1
    dest = oracle_step["expert_idx"] // e_local  # (B, T, k): ep rank holding each chosen expert
    kept = oracle_step["kept"]
    rows_of = lambda r: slice(r * b, (r + 1) * b)  # noqa: E731
    me = dp_rank % ep
    rows_out = int((kept[rows_of(dp_rank)] & (dest[rows_of(dp_rank)] != me)).sum())
    rows_in = sum(int((kept[rows_of(r)] & (dest[rows_of(r)] == me)).sum())
                  for r in range(first, first + ep) if r != dp_rank)
    send_counts = [int((kept[rows_of(dp_rank)] & (dest[rows_of(dp_rank)] == d)).sum()) for d in range(ep)]
    return all_to_all_bytes_per_step(rows_out, rows_in, C, 4, E, ep), send_counts


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spec", MESHES, ids=lambda s: f"dp{s['dp']}-ep{s['ep']}")
def test_expert_parallel_layer_equals_oracle(four_ranks, spec, case):
    ref_steps, ref_params = oracle(case)
    ep, dp = spec["ep"], spec["dp"]
    b = B // dp
    if CASES[case]["capacity_factor"] is not None:
        assert all(s["dropped"] > 0 for s in ref_steps)  # the case really drops tokens
    for rank, res in enumerate(four_ranks):
        meta = res[(ep, case)]
        got_steps, got_params = meta["steps"], meta["params"]
        assert meta["dp_rank"] == rank and meta["ep_rank"] == rank % ep
        assert meta["expert_ids"] == list(range((rank % ep) * E // ep, (rank % ep + 1) * E // ep))
        rows = slice(rank * b, (rank + 1) * b)
        for step, (got, ref) in enumerate(zip(got_steps, ref_steps)):
            where = f"rank {rank}, step {step}"
            torch.testing.assert_close(got["y"], ref["y"][rows], **TOL, msg=lambda m: f"{where} output: {m}")
            torch.testing.assert_close(got["x_grad"], ref["x_grad"][rows], **TOL,
                                       msg=lambda m: f"{where} input grad: {m}")
            # Router, shared expert and this rank's experts, after the dp / edp averaging.
            assert set(got["grads"]) <= set(ref["grads"])
            assert len(got["grads"]) == len(ref["grads"]) - (E - E // ep) * 4
            for name, g in got["grads"].items():
                gradient(dp).assert_close(g, ref["grads"][name], f"{where} grad {name}")
        adamw_weights(STEPS, ADAM["lr"]).assert_weights(got_params, {n: ref_params[n] for n in got_params},
                                                        f"rank {rank} params")
    # Dropped assignments and the aux loss are per rank: their sum / mean over dp ranks is the oracle's.
    for step, ref in enumerate(ref_steps):
        steps = [res[(ep, case)]["steps"][step] for res in four_ranks]
        assert sum(s["dropped"] for s in steps) == ref["dropped"]
        torch.testing.assert_close(sum(s["aux"] for s in steps) / dp, ref["aux"], **TOL)


@pytest.mark.parametrize("spec", MESHES, ids=lambda s: f"dp{s['dp']}-ep{s['ep']}")
def test_communication_matches_the_formula(four_ranks, spec):
    case = "gshard k=2, dropping, shared expert, z-loss"
    ref_steps, _ = oracle(case)
    moe = make_moe(case)
    expert_bytes = sum(p.numel() * 4 for p in moe.experts.parameters()) // spec["ep"]
    dense_bytes = sum(p.numel() * 4 for p in moe.parameters()) - expert_bytes * spec["ep"]
    for rank, res in enumerate(four_ranks):
        for step, got in enumerate(res[(spec["ep"], case)]["steps"]):
            expected, send_counts = expected_a2a_bytes(ref_steps[step], spec, rank)
            assert got["send_counts"].tolist() == send_counts
            assert got["a2a_calls"] == 5  # forward: counts, dispatch, combine; backward: combine, dispatch
            assert got["a2a_bytes"] == expected, f"rank {rank} step {step}"
            if spec["ep"] == 1:
                assert expected == 0  # every expert is local: the all-to-all moves nothing
            # Dense gradients are averaged over dp, expert gradients over edp only.
            assert got["ar_payload"] == {"dp": dense_bytes, "edp": expert_bytes}
    if spec["ep"] == 4:
        rank0 = four_ranks[0][(4, case)]["steps"][0]
        print(f"ep=4, rank 0, step 0: all-to-all sent {rank0['a2a_bytes']} bytes, "
              f"rows per destination {rank0['send_counts'].tolist()}")


def test_gpt_with_experts_dp_and_gradient_accumulation(four_ranks):
    # dp=4, ep=2: 2 sequences per rank in 2 micro-batches of 1; oracle: all 8 at once.
    model = make_gpt()
    ref_grads, ref_params = gpt_oracle(model)
    assert model.h[1].ffn.last_dropped > 0  # capacity 1.0 drops tokens here too
    for rank, res in enumerate(four_ranks):
        grads, params = res["gpt"]
        assert len(params) == len(ref_params) - 2 * 4  # the 2 experts held by the other ep rank
        for name, g in grads.items():  # averaged over 4 dp ranks of 2 micro-batches each
            gradient(8).assert_close(g, ref_grads[name], f"rank {rank} grad {name}")
        adamw_weights(2, 1e-3).assert_weights(params, {n: ref_params[n] for n in params}, f"rank {rank} params")


def test_errors_name_experts_and_degrees(four_ranks):
    for res in four_ranks:
        assert res["draws"] == (0, 1)  # from_dense draws no master weight to throw away
        assert res["errors"] == ["n_experts=6 does not divide by ep=4 (world_size=4): every "
                                 "expert-parallel rank must hold the same number of experts"]


# ------------------------------------------------- memory at 8 ranks
N_EXPERTS_8 = 64  # the claim: 64 experts on 8 devices leave 1/8 of the expert memory per device


def _eight_ranks():
    # ep = dp = 8: the ep group is the whole world, so no mesh groups are needed
    # (creating the mesh's 26 groups would cost more than the test itself).
    rank = dist.get_rank()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        moe = MoE(C, D_FF, N_EXPERTS_8, k=2, capacity_factor=None)
    layer = ExpertParallelMoE.from_dense(moe, group=None)
    x = torch.randn(8, T, C, generator=torch.Generator().manual_seed(5))[rank:rank + 1]
    y, aux = layer(x)
    (y.square().mean() + aux).backward()
    # Parameters and their gradients, measured. (No optimizer here: the first
    # AdamW a process builds imports torch's compiler stack, seconds of CPU on
    # each of 8 ranks; its state is 2 tensors per parameter, split the same way.)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    experts = expert_parameters(layer)
    expert_ids = {id(p) for p in experts}
    return dict(y=y.detach(), expert_ids=layer.expert_ids,
                expert_bytes=nbytes(experts), expert_grad_bytes=nbytes(p.grad for p in experts),
                dense_bytes=nbytes(p for p in layer.parameters() if id(p) not in expert_ids),
                send_counts=layer.last_stats.send_counts)


def test_eight_ranks_hold_an_eighth_of_the_experts():
    results = launch(_eight_ranks, 8, timeout=300)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        moe = MoE(C, D_FF, N_EXPERTS_8, k=2, capacity_factor=None)
    x = torch.randn(8, T, C, generator=torch.Generator().manual_seed(5))
    y, _ = moe(x)
    total_expert = sum(p.numel() * 4 for p in moe.experts.parameters())
    for rank, res in enumerate(results):
        assert res["expert_ids"] == list(range(8 * rank, 8 * rank + 8))
        torch.testing.assert_close(res["y"], y[rank:rank + 1], **TOL)
        assert res["expert_bytes"] * 8 == total_expert  # exactly 1/8
        assert res["expert_grad_bytes"] == res["expert_bytes"]  # each rank's experts, and only those, get gradients
    r0 = results[0]
    layer_fraction = (r0["expert_bytes"] + r0["dense_bytes"]) / (total_expert + r0["dense_bytes"])
    print(f"64 experts over 8 ranks: expert parameters per rank {r0['expert_bytes']} of {total_expert} "
          f"bytes (1/8); the whole layer with its replicated router: {layer_fraction:.4f} of one process's")
    assert 1 / 8 < layer_fraction < 1 / 8 + r0["dense_bytes"] / total_expert + 1e-9
    routes = torch.stack([res["send_counts"] for res in results])  # (8, 8) rows from rank s to rank d
    assert routes.sum() == 8 * T * 2  # every assignment kept (no capacity limit)
