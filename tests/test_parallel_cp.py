"""Context parallelism as a mesh dimension: the composed GPT with cp > 1 equals one process.

Each (dp, cp, tp[, pp, sp]) combination trains K = 5 AdamW steps on the same global batches
as one process (`test_parallel_parity`'s model, data and oracle) and is compared on

* the losses of every step (the global mean on every rank),
* every parameter's gradient after the first step, gathered over tp (every rank's copy:
  the dp x cp replicas must all hold the single-process gradient),
* the parameters after the 5 steps, gathered back into the plain GPT's.

Tolerances: the course's policy (`reference.tolerance`, which says why). Ring attention adds
each query's keys block by block with the online softmax (a running max and log-sum-exp, Liu
et al.), Ulysses runs the dense attention on a subset of heads, and the gradients are averaged
over dp x cp ranks and micro-batches: the same numbers added in another order. So the losses
and the parameters after 5 AdamW steps keep `test_parallel_parity`'s bounds (`loss()`, and
`adamw_weights(K, LR)`: every weight, the mean over all of them and each tensor's), and the
gradients of the first step `gradient(n)` for a sum over n = dp x cp x micro-batches.
`pytest -s` prints the largest differences. A mistake is far outside them: embedding the positions 0 .. T/cp - 1
instead of the rank's own moves the first loss by 9e-3, and summing the gradients over cp
instead of averaging them doubles every gradient of the first step.
"""
from __future__ import annotations

import pytest
import torch

from reference.mesh import Mesh
from reference.model import GPT, GPTConfig
from reference.parallel.config import ParallelConfig
from reference.runtime import launch
from reference.tolerance import gradient
from reference.train.single import accumulate_gradients
from test_parallel_parity import CFG, EPS, LR, B, T, assert_parity, batches, single_process

pytestmark = pytest.mark.timeout(300)


def oracle_grads(chunks: int) -> dict[str, torch.Tensor]:
    """The single process's gradient of the first step, accumulated over `chunks` chunks."""
    torch.manual_seed(0)
    model = GPT(CFG)
    accumulate_gradients(model, *batches()[0], chunks)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _gathered_grads(pm) -> dict[str, torch.Tensor]:
    """This rank's gradients under the plain GPT's names, whole over tp (collective over tp)."""
    from reference.parallel.gather import tensor_parallel_full

    out = {}
    group = pm.mesh.group("tp") if pm.mesh.tp > 1 else None
    for stage in pm.stages:
        module_of = dict(stage.named_modules())
        for name, p in stage.named_parameters():
            g = p.grad.detach()
            if group is not None:
                g = tensor_parallel_full(module_of, name, g, group)
            out[name] = g.cpu().clone()
    return out


def _rank(configs):
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step

    out = []
    for config in configs:
        torch.manual_seed(0)  # the same initial weights on every rank, as in the single process
        mesh = config.mesh().build_groups()
        pm = parallelize(GPT(CFG), mesh, config, batch=(B, T))
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses, grads = [], None
        for step, (idx, tgt) in enumerate(batches()):
            losses.append(float(train_step(pm, opt, idx, tgt).loss))
            if step == 0 and not config.zero_stage:  # ZeRO reduces into its shards instead
                grads = _gathered_grads(pm)  # the reduced gradients the first step used
        state = full_state_dict(pm)
        out.append((losses, state if torch.distributed.get_rank() == 0 else None, grads))
    return out


def check_combinations(world_size, configs):
    ranks = launch(_rank, world_size, configs, timeout=240)
    table = {}
    for i, config in enumerate(configs):
        chunks = config.dp * config.microbatches  # cp splits tokens, not sequences
        losses, state = single_process(config, chunks)
        loss_diff = assert_parity(config, ranks, i, losses, state)
        want, grad_diff, seen = oracle_grads(chunks), 0.0, set()
        grad_tol = gradient(config.dp * config.cp * config.microbatches)  # summed over those
        for r, rank in enumerate(ranks):
            if config.zero_stage:
                seen, grad_diff = set(want), None  # sharded: the parameters after 5 steps are the check
                break
            for name, g in rank[i][2].items():
                # a pipeline's last stage holds the tied lm_head, its gradient summed with wte's
                name = "wte.weight" if name == "lm_head.weight" and CFG.tie_weights else name
                grad_tol.assert_close(g, want[name], f"{config}, rank {r}: grad of {name}")
                grad_diff = max(grad_diff, float((g - want[name]).abs().max()))
                seen.add(name)
        assert seen == set(want), f"{config}: gradients of {set(want) - seen} never compared"
        param_diff = max(float((ranks[0][i][1][n] - v).abs().max()) for n, v in state.items()
                         if n in ranks[0][i][1])
        table[str(config)] = (loss_diff, grad_diff, param_diff)
    print("config: (max |loss - one process|, max |grad diff|, max |param diff| after 5 steps)")
    for k, v in table.items():
        print(f"  {k}: {v[0]:.1e} {'(sharded)' if v[1] is None else f'{v[1]:.1e}'} {v[2]:.1e}")
    return table


def test_cp2_ring_and_ulysses_equal_one_process():
    """(dp, cp, tp) = (1, 2, 1), ring and Ulysses, on 2 ranks."""
    check_combinations(2, [ParallelConfig(cp=2), ParallelConfig(cp=2, cp_kind="ulysses")])


def test_dp2_cp2_ring_equals_one_process():
    """(2, 2, 1) ring: gradients averaged over the 4 ranks of dp x cp."""
    check_combinations(4, [ParallelConfig(dp=2, cp=2)])


def test_cp2_tp2_ring_ulysses_and_sp_equal_one_process():
    """(1, 2, 2): ring on each tp rank's 2 heads, Ulysses dealing them out over cp, and ring
    with Megatron SP (each cp rank's T/2 tokens split again over tp)."""
    check_combinations(4, [ParallelConfig(cp=2, tp=2),
                           ParallelConfig(cp=2, tp=2, cp_kind="ulysses"),
                           ParallelConfig(cp=2, tp=2, sequence_parallel=True)])


def test_cp2_with_pipeline_zero1_and_zero3_equal_one_process():
    """cp with a 1F1B pipeline (pp 2, 2 micro-batches), and ZeRO-1 / ZeRO-3 sharded over dp x cp."""
    check_combinations(4, [ParallelConfig(cp=2, pp=2, microbatches=2),
                           ParallelConfig(cp=2, dp=2, zero_stage=1),
                           ParallelConfig(cp=2, dp=2, zero_stage=3)])


# ---------------------------------------------------------------- pure: data, positions, errors
@pytest.mark.parametrize("kind, rank0", [("ring", [0, 1, 2, 15, 16, 17]),  # chunks 0 and 2 cp - 1 = 5
                                         ("ulysses", [0, 1, 2, 3, 4, 5])])
def test_each_cp_rank_gets_its_chunks_and_embeds_their_true_positions(kind, rank0):
    from reference.context_parallel.apply import ContextParallelPositions, context_parallel_batch

    cp, T = 3, 18
    idx = torch.arange(T).repeat(2, 1)  # token id = its position, two sequences
    wpe = torch.nn.Embedding(T, 4)
    parts = []
    for r in range(cp):
        ids, tgt = context_parallel_batch(idx, idx + 100, cp, r, kind)
        assert ids.shape == (2, T // cp) and torch.equal(tgt, ids + 100)
        # what GPT.embed asks for (0 .. T/cp - 1) is looked up at the positions the rank holds
        got = ContextParallelPositions(wpe, cp, r, kind == "ring")(torch.arange(T // cp))
        assert torch.equal(got, wpe(ids[0]))
        parts += ids[0].tolist()
    assert sorted(parts) == list(range(T))  # every token on exactly one cp rank
    assert context_parallel_batch(idx, idx, cp, 0, kind)[0][0].tolist() == rank0


DROPOUT = GPTConfig.tiny(n_layer=4, block_size=16, dropout=0.1)
LONG = GPTConfig.tiny(n_layer=4, block_size=32)


@pytest.mark.parametrize("config, world, model, batch, n_experts, expected", [
    (ParallelConfig(cp=2), 2, CFG, (8, 14), None, "T=14 is not a multiple of 4 (cp=2)"),
    (ParallelConfig(cp=3, cp_kind="ulysses"), 3, CFG, (8, 16), None,
     "T=16 is not a multiple of 3 (cp=3)"),
    (ParallelConfig(cp=4, tp=2, cp_kind="ulysses"), 8, CFG, None, None,
     "n_head=4 is not a multiple of tp=2 x cp=4 = 8"),
    (ParallelConfig(cp=2, tp=4, sequence_parallel=True), 8, LONG, (8, 20), None,
     "each cp rank's T/cp=10 tokens over tp=4"),
    (ParallelConfig(cp=2, cp_kind="star"), 2, CFG, None, None,
     "cp_kind must be one of ring, ulysses, got 'star'"),
    (ParallelConfig(cp=2, dp=2, ep=2), 4, CFG, None, 4, "cp=2 with experts (n_experts=4, ep=2)"),
    (ParallelConfig(cp=2), 2, DROPOUT, None, None, "cp=2 with dropout=0.1"),
    (ParallelConfig(cp=2, dp=2), 8, CFG, None, None, "dp=2 x cp=2 x tp=1 x pp=1 = 4, but world_size=8"),
    (ParallelConfig(cp=0), 1, CFG, None, None, "positive ints: cp=0"),
])
def test_config_refuses_what_context_parallelism_cannot_split(config, world, model, batch, n_experts,
                                                              expected):
    with pytest.raises(ValueError) as err:
        config.validate(world, model, batch=batch, n_experts=n_experts)
    assert expected in str(err.value)


def test_config_accepts_cp_with_tp_sp_pp_and_zero_and_names_it():
    for config in (ParallelConfig(cp=2, tp=2, sequence_parallel=True),  # 16 / 2 = 8 over tp 2
                   ParallelConfig(cp=2, tp=2, cp_kind="ulysses"),        # 4 heads / 2 = 2 over cp 2
                   ParallelConfig(dp=2, cp=2, pp=2, microbatches=2, zero_stage=1)):
        config.validate(config.world_size, CFG, batch=(8, 16))
    c = ParallelConfig(dp=2, cp=2, tp=2, sequence_parallel=True)
    assert c.world_size == 8 and c.mesh() == Mesh(dp=2, cp=2, tp=2)
    assert str(c) == "dp=2 tp=2 pp=1 cp=2 ring sp"
    assert str(ParallelConfig(cp=2, cp_kind="ulysses")) == "dp=1 tp=1 pp=1 cp=2 ulysses"


def test_sampling_with_cp_is_refused():
    from types import SimpleNamespace

    from reference.parallel.generate import generate

    pm = SimpleNamespace(mesh=Mesh(cp=2), config=ParallelConfig(cp=2), fsdp=None)
    with pytest.raises(ValueError, match="generate with cp=2 .*sample with cp=1"):
        generate(pm, torch.zeros(1, 4, dtype=torch.long), 2)


def test_the_cost_estimate_refuses_cp_rather_than_miscount_it():
    from reference.parallel.estimate import estimate

    estimate(CFG, ParallelConfig(dp=2), micro_batch=2, global_batch=8)  # fine without cp
    with pytest.raises(ValueError, match=r"cp=2 \(dp=2 tp=1 pp=1 cp=2 ring\) is not in its formulas"):
        estimate(CFG, ParallelConfig(dp=2, cp=2), micro_batch=2, global_batch=8)


def _clipped_step(config, max_norm):
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step

    torch.manual_seed(0)
    pm = parallelize(GPT(CFG), config.mesh().build_groups(), config, batch=(B, T))
    opt = pm.make_optimizer(torch.optim.SGD, lr=0.0)  # the clipped gradients stay to be read
    result = train_step(pm, opt, *batches()[0], max_norm=max_norm)
    return float(result.grad_norm), _gathered_grads(pm)


def test_global_norm_counts_the_cp_replicas_once():
    """Clipping: the cp ranks hold the same averaged gradient; counted on each, the norm
    would come out sqrt(cp) too large and every gradient clipped too hard."""
    config, max_norm = ParallelConfig(cp=2, tp=2), 0.05
    torch.manual_seed(0)
    model = GPT(CFG)
    _, loss = model(*batches()[0])
    loss.backward()
    want_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    assert want_norm > 10 * max_norm  # so the clip acts
    tol = gradient(config.cp)  # the cp replicas' gradients averaged, and their squares summed
    for norm, grads in launch(_clipped_step, 4, config, max_norm, timeout=120):
        assert tol.allows(norm - want_norm, want_norm), (norm, want_norm)
        for name, g in grads.items():
            p = dict(model.named_parameters())["wte.weight" if name == "lm_head.weight" else name]
            tol.assert_close(g, p.grad, f"clipped grad of {name}")
