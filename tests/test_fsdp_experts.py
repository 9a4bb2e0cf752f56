"""ZeRO-3 with expert parallelism: experts sharded over their expert-data-parallel group.

With ep > 1 each expert lives on one ep rank and is replicated over its edp group (dp / ep
ranks), while the dense parameters are replicated over all dp ranks. Composed ZeRO-3
(`reference.zero.ShardedSets`) shards each dense tensor's dim 0 over dp and each expert
tensor's over edp. An expert's gradient already holds every token of its ep group, so it
is summed over edp and divided by dp, the same mean as a dense gradient.

Each configuration trains `sweep_run.STEPS` AdamW steps (clipped at a global norm of 1)
and must equal one process within `sweep_run.TOLERANCES`. Memory between steps, per rank:
parameters, gradients and AdamW's two moments of its rows, ceil(d0 / dp) x rest numbers of
each dense tensor and ceil(d0 / edp) x rest of each expert tensor, measured by
`reference.memory.measure`. Traffic per step: one all-gather and one reduce-scatter of
those rows over each group, (N - 1) x 4 x rows bytes sent each way, N = dp or edp.
A checkpoint saved from ZeRO-3 x EP loads into one process and into plain dp x ep.
"""
from __future__ import annotations

import math

import pytest
import torch

from reference.parallel.config import ParallelConfig
from sweep import SweepCase
from reference.runtime import launch

pytestmark = pytest.mark.timeout(600)

FOUR = [SweepCase(ParallelConfig(dp=4, ep=2, zero_stage=3, microbatches=2), clip=True, moe=True),
        SweepCase(ParallelConfig(dp=2, tp=2, ep=2, zero_stage=3, sequence_parallel=True,
                                 microbatches=2), clip=True, moe=True),
        # edp = 1: each expert on one rank only, its "shard" the whole tensor
        SweepCase(ParallelConfig(dp=4, ep=4, zero_stage=3, activation_checkpointing=True),
                  clip=True, moe=True)]
EIGHT = [SweepCase(ParallelConfig(dp=4, pp=2, ep=2, zero_stage=3, microbatches=2), clip=True,
                   moe=True),
         SweepCase(ParallelConfig(dp=2, tp=2, pp=2, ep=2, zero_stage=3, microbatches=2,
                                  precision="fp16"), clip=True, moe=True)]
CASES = FOUR + EIGHT


def _run(cases):
    """Per case: (losses, skipped, state on rank 0), measured bytes, dense and expert rows,
    bytes sent per group."""
    import torch.distributed as dist

    from reference import comms, memory
    from reference.expert_parallel import expert_parameters
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep import BATCH
    from sweep_run import EPS, LR, _scaler, batches, model_for

    out = []
    for case in cases:
        mesh = case.config.mesh().build_groups()
        # the formula, from the same layout without ZeRO: rows over dp (dense) or edp (experts)
        plain = parallelize(model_for(case), mesh, case.config.with_(zero_stage=0), batch=BATCH)
        experts = {id(p) for stage in plain.stages for p in expert_parameters(stage)}
        rows = {"dense": 0, "experts": 0}
        for p in plain.parameters():
            n = mesh.edp if id(p) in experts else mesh.dp
            rows["experts" if id(p) in experts else "dense"] += math.ceil(p.shape[0] / n) * p[0].numel()
        pm = parallelize(model_for(case), mesh, case.config, batch=BATCH)
        if pm.scaler is not None:
            pm.scaler = _scaler()
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses, skipped, sent = [], [], []
        labels = {"dense": comms.group_label(mesh.group("dp")),
                  "experts": comms.group_label(mesh.group("edp"))}
        for idx, tgt in batches():
            with comms.meter() as m:
                r = train_step(pm, opt, idx, tgt, max_norm=1.0 if case.clip else None)
            sent.append({(kind, op): m.sent_bytes(op, group=label)
                         for kind, label in labels.items() for op in ("all_gather", "reduce_scatter")})
            losses.append(float(r.loss))
            skipped.append(bool(r.skipped))
        held = memory.measure(pm.parameters(), opt)
        state = full_state_dict(pm)
        out.append(((losses, skipped, state if dist.get_rank() == 0 else None), held, rows, sent,
                    (mesh.dp, mesh.edp)))
    return out


@pytest.fixture(scope="module")
def ranks():
    return {4: launch(_run, 4, FOUR, timeout=300), 8: launch(_run, 8, EIGHT, timeout=300)}


def _of(ranks, i):
    case = CASES[i]
    j = (FOUR if case.world_size == 4 else EIGHT).index(case)
    return case, [r[j] for r in ranks[case.world_size]]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_zero3_with_experts_equals_one_process(ranks, i):
    from sweep_run import compare, single_process

    case, rs = _of(ranks, i)
    for r in rs[1:]:
        assert r[0][0] == rs[0][0][0], f"{case}: ranks disagree on the loss"
    row = compare(case, rs[0][0], single_process(case))
    assert row["ok"], row


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_each_rank_holds_its_rows_and_sends_them_once_per_group(ranks, i):
    """4 bytes x (dense rows over dp + expert rows over edp) of parameters and of gradients,
    twice that of AdamW's moments; per step (N - 1) x 4 x rows each way over each group."""
    case, rs = _of(ranks, i)
    for _, held, rows, sent, (dp, edp) in rs:
        assert rows["experts"] > 0 and rows["dense"] > 0
        mine = rows["dense"] + rows["experts"]
        assert held.params == 4 * mine and held.grads == 4 * mine, (held, rows)
        assert held.optimizer_state == 2 * 4 * mine, (held, rows)
        for s in sent:
            for op in ("all_gather", "reduce_scatter"):
                assert s["dense", op] == (dp - 1) * 4 * rows["dense"], (s, rows)
                assert s["experts", op] == (edp - 1) * 4 * rows["experts"], (s, rows)


def test_zero1_and_zero2_with_experts_are_refused_naming_the_groups():
    from reference.model import GPTConfig

    for stage in (1, 2):
        config = ParallelConfig(dp=4, ep=2, zero_stage=stage)
        problems = config.problems(4, GPTConfig.tiny(), None, 4)
        assert len(problems) == 1, problems
        assert f"zero_stage={stage} with ep=2" in problems[0] and "expert-data-parallel" in problems[0]
        assert "dp/ep=2" in problems[0] and "zero_stage 0, or 3" in problems[0]
    assert not ParallelConfig(dp=4, ep=2, zero_stage=3).problems(4, GPTConfig.tiny(), None, 4)
    assert not ParallelConfig(dp=4, ep=2, zero_stage=3).zero3_by_blocks  # rows per parameter


def _checkpoint_run(config, root, save):
    """Three steps then a save, or a load; then two more steps. Returns their losses."""
    import test_train_checkpoint as tc

    from reference.train.checkpoint import load_checkpoint, save_checkpoint

    pm, opt, sched = tc.build(config, ffn_factory=tc._experts())
    data = tc.batches()
    if save:
        tc.train(pm, opt, sched, data[:3])
        save_checkpoint(root, 3, pm, opt, scheduler=sched)
    else:
        load_checkpoint(root, pm, opt, scheduler=sched)
    return tc.train(pm, opt, sched, data[3:])


def test_zero3_expert_rows_checkpoint_loads_into_other_layouts(tmp_path):
    """Saved from dp 4 x ep 2 ZeRO-3 (each expert's rows over its 2 edp ranks), loaded into
    one process and into plain dp 2 x ep 2: the next two losses match the saving run's
    (rtol 1e-5, as `test_train_checkpoint.py`: the same numbers reduced in another order)."""
    want = launch(_checkpoint_run, 4, ParallelConfig(dp=4, ep=2, zero_stage=3), tmp_path, True,
                  timeout=200)[0]
    one = launch(_checkpoint_run, 1, ParallelConfig(microbatches=4), tmp_path, False, timeout=200)[0]
    two = launch(_checkpoint_run, 2, ParallelConfig(dp=2, ep=2, microbatches=2), tmp_path, False,
                 timeout=200)[0]
    assert one == pytest.approx(want, rel=1e-5, abs=0), f"{one} vs {want}"
    assert two == pytest.approx(want, rel=1e-5, abs=0), f"{two} vs {want}"


# ZeRO-3 by blocks (FSDP over the whole model: tp = pp = ep = 1, no recompute) with experts at
# ep 1: the router's balance and z losses are part of the loss like any other.
BY_BLOCKS = [SweepCase(ParallelConfig(dp=2, zero_stage=3), moe=True),
             SweepCase(ParallelConfig(dp=2, zero_stage=3, microbatches=2), clip=True, moe=True),
             # activation checkpointing keeps the engine: each block gathered again for the recompute
             SweepCase(ParallelConfig(dp=2, zero_stage=3, microbatches=2, activation_checkpointing=True),
                       moe=True)]


def test_zero3_by_blocks_with_experts_keeps_the_routers_losses():
    """dp 2, dp 2 x m 2 (clipped, and recomputed), experts at ep 1 with the balance and z losses on (their
    defaults, 0.01 and 0.001): equal to one process (`sweep_run.compare`). Without the routers'
    losses the loss and the mean weight move by more than `sweep_run.TOLERANCES`."""
    from sweep_run import compare, run_cases, single_process

    assert all(c.config.zero3_by_blocks for c in BY_BLOCKS)
    ranks = launch(run_cases, 2, BY_BLOCKS, timeout=300)
    for i, case in enumerate(BY_BLOCKS):
        assert ranks[1][i][0] == ranks[0][i][0], f"{case}: ranks disagree on the loss"
        row = compare(case, ranks[0][i], single_process(case))
        assert row["ok"], row
