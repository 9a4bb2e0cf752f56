"""HSDP: ZeRO-3 sharded inside blocks of dp ranks, replicated across them (`ParallelConfig(dp_replicate=R)`).

On 8 ranks, composed with tp (+ SP), with pp, and alone: equal to one process over 3 AdamW
steps (the tolerance policy, `sweep_run.compare`); every rank holds its ceil(d0 / dp_shard)
rows of each of its TP-local tensors (parameters, gradients and AdamW's two moments, 4 bytes
each), and per step sends, in bytes, exactly

    over dp_shard      one all-gather and one reduce-scatter: (N - 1) x 4 x rows each
    over dp_replicate  one all-reduce of its rows: the ring's 2 (R - 1) / R x 4 x rows

with N = dp / R ranks sharding and R replicas (`ring_sent_bytes` gives the ring's exact
split when R does not divide the rows).
"""
from __future__ import annotations

import math

import pytest
import torch

from reference.comms import ring_sent_bytes
from reference.mesh import Mesh
from reference.parallel.config import ParallelConfig
from reference.runtime import launch
from sweep import SweepCase

CASES = [SweepCase(ParallelConfig(dp=8, zero_stage=3, dp_replicate=2), clip=True),
         SweepCase(ParallelConfig(dp=4, tp=2, zero_stage=3, sequence_parallel=True, dp_replicate=2),
                   clip=True),
         SweepCase(ParallelConfig(dp=4, pp=2, zero_stage=3, microbatches=2, dp_replicate=4))]


def _run(cases):
    """Per case: (losses, skipped, full weights on rank 0), measured bytes held, rows, bytes sent."""
    import torch.distributed as dist

    from reference import comms, memory
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep import BATCH
    from sweep_run import EPS, LR, batches, model_for

    out = []
    for case in cases:
        mesh = case.config.mesh().build_groups()
        plain = parallelize(model_for(case), mesh, case.config.with_(zero_stage=0, dp_replicate=1),
                            batch=BATCH)
        rows = sum(math.ceil(p.shape[0] / mesh.dp_shard) * p[0].numel() for p in plain.parameters())
        pm = parallelize(model_for(case), mesh, case.config, batch=BATCH)
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses, sent = [], []
        for idx, tgt in batches():
            with comms.meter() as m:
                losses.append(float(train_step(pm, opt, idx, tgt, max_norm=1.0 if case.clip else None).loss))
            shard, replicate = (comms.group_label(mesh.group(d)) for d in ("dp_shard", "dp_replicate"))
            sent.append((m.sent_bytes("all_gather", group=shard), m.sent_bytes("reduce_scatter", group=shard),
                         m.sent_bytes("all_reduce", group=replicate)))
        state = full_state_dict(pm)
        out.append(((losses, [False] * len(losses), state if dist.get_rank() == 0 else None),
                    memory.measure(pm.parameters(), opt), rows, sent, mesh.dp_replicate_rank))
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_run, 8, CASES, timeout=500)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_hsdp_equals_one_process(ranks, i):
    from sweep_run import compare, single_process

    row = compare(CASES[i], ranks[0][i][0], single_process(CASES[i]))
    assert row["ok"], row["why"]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_hsdp_holds_one_shard_and_sends_what_the_formula_says(ranks, i):
    config = CASES[i].config
    R = config.dp_replicate
    N = config.dp // R
    for r in ranks:
        _, held, rows, sent, replica = r[i]
        assert held.params == held.grads == 4 * rows, held       # 1 / dp_shard of each tensor
        assert held.optimizer_state == 2 * 4 * rows, held        # AdamW's two moments
        for gathered, scattered, reduced in sent:
            assert gathered == scattered == (N - 1) * 4 * rows
            assert reduced == ring_sent_bytes("all_reduce", rows, 4, R, replica)
            assert abs(reduced - 2 * (R - 1) / R * 4 * rows) <= 2 * 4 * R  # the ring's uneven chunks


def test_hsdp_groups_and_refusals():
    mesh = Mesh(dp=8, dp_replicate=2)
    assert mesh.group_ranks("dp_shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.group_ranks("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    mesh = Mesh(dp=4, tp=2, pp=2, dp_replicate=2)
    assert mesh.group_ranks("dp_shard")[:2] == [[0, 2], [1, 3]]   # consecutive dp ranks, per tp slice
    with pytest.raises(ValueError, match="dp_replicate=3 must divide dp=4"):
        Mesh(dp=4, dp_replicate=3)
    with pytest.raises(ValueError, match="dp_shard_cp"):  # not built, and the refusal says why
        Mesh(dp=4, cp=2, dp_replicate=2)
    for bad, why in [(dict(zero_stage=1), "needs zero_stage=3"), (dict(zero_stage=3, ep=2), "ep=2"),
                     (dict(zero_stage=3, cp=2), "context parallelism is not built.*dp_shard x cp"),
                     (dict(zero_stage=3, reshard_after_forward=True, pp=2, microbatches=2),
                      "reshard_after_forward")]:
        config = ParallelConfig(dp=4, dp_replicate=2, **bad)
        with pytest.raises(ValueError, match=why):
            config.validate(config.world_size, n_experts=4 if config.ep > 1 else None)
    assert not ParallelConfig(dp=4, zero_stage=3, dp_replicate=2).zero3_by_blocks


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_the_estimate_counts_hsdp_as_measured(ranks, i):
    """`estimate`'s model states (1 / dp_shard of each tensor) and its bytes per link equal the
    measured ones on the first pipeline rank: "dp" (the shard group's all-gather and
    reduce-scatter) exactly, "dp_replicate" by the ring's 2 (R - 1) / R (its chunks are whole
    numbers: within 2 R elements)."""
    from reference.parallel.estimate import estimate, link_of
    from sweep import BATCH, MODEL_SIZES
    from reference.model import GPTConfig

    config = CASES[i].config
    R, (B, T) = config.dp_replicate, BATCH
    e = estimate(GPTConfig.tiny(**MODEL_SIZES), config, micro_batch=B // (config.dp * config.microbatches),
                 global_batch=B, seq_len=T)
    _, held, rows, sent, _ = ranks[0][i]
    assert e.model_states.params == held.params and e.model_states.optimizer_state == held.optimizer_state
    gathered, scattered, reduced = sent[0]
    assert e.bytes_per_step["dp"] == gathered + scattered
    assert abs(e.bytes_per_step["dp_replicate"] - reduced) <= 2 * 4 * R
    # shards inside a node of 8 GPUs, replicas across: at dp 8 x tp 2 with R = 2, the shards
    # of 4 dp ranks x tp 2 fill a node and the all-reduce leaves it
    big = ParallelConfig(dp=8, tp=2, zero_stage=3, dp_replicate=2)
    assert (link_of(big, "dp"), link_of(big, "dp_replicate")) == ("intra", "inter")
