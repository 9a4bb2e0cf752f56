"""ZeRO-3 per parameter (`reference.zero.fsdp_param`) composed with TP, SP, PP and checkpointing,
and ZeRO-2 with sequence parallelism.

Each configuration trains `sweep_run.STEPS` AdamW steps on 8 gloo ranks (clipped at a
global norm of 1, so the clip's counting of dim-0 shards is checked too) and must equal
one process within `sweep_run.TOLERANCES`. Memory: between steps each rank holds, for
parameters, gradients and AdamW's two moments, its dim-0 rows of each of its stage's
TP-local tensors, ceil(d0 / dp) x rest numbers each: the model's numbers / (dp x tp x pp)
up to that padding (and to the replicated LayerNorms and biases of TP), measured by
`reference.memory.measure` against the formula. The traffic of ZeRO-3 is one all-gather
and one reduce-scatter of those numbers per step, whatever the number of micro-batches.
"""
from __future__ import annotations

import math

import pytest
import torch

from reference.parallel.config import ParallelConfig
from sweep import SweepCase
from reference.runtime import launch

pytestmark = pytest.mark.timeout(600)

CASES = [
    SweepCase(ParallelConfig(dp=4, tp=2, zero_stage=3, microbatches=2), clip=True),
    SweepCase(ParallelConfig(dp=4, tp=2, zero_stage=3, sequence_parallel=True,
                             activation_checkpointing=True), clip=True),
    SweepCase(ParallelConfig(dp=4, pp=2, zero_stage=3, microbatches=2), clip=True),
    SweepCase(ParallelConfig(dp=2, tp=2, pp=2, zero_stage=3, sequence_parallel=True,
                             microbatches=4, schedule="interleaved", virtual_stages=2), clip=True),
    # fp16: the loss scaler unscales and checks the reduce-scattered shard gradients
    SweepCase(ParallelConfig(dp=2, tp=2, pp=2, zero_stage=3, microbatches=2, precision="fp16",
                             activation_checkpointing=True), clip=True),
]


def _run(cases):
    """run_cases, plus per case: (measured MemoryBytes, formula numbers, ZeRO bytes sent)."""
    import torch.distributed as dist

    from reference import comms, memory
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep import BATCH
    from sweep_run import EPS, LR, _scaler, batches, model_for

    out = []
    for case in cases:
        mesh = case.config.mesh().build_groups()
        # the formula, from the same layout without ZeRO: this rank's TP-local tensors of its
        # stages, (d0, *rest) each, of which it keeps ceil(d0 / dp) rows
        plain = parallelize(model_for(case), mesh, case.config.with_(zero_stage=0), batch=BATCH)
        dp = mesh.dp_cp
        local = sum(p.numel() for p in plain.parameters())   # the model's numbers / (tp x pp)
        rows = sum(math.ceil(p.shape[0] / dp) * p[0].numel() for p in plain.parameters())
        pad = sum(p[0].numel() for p in plain.parameters())  # at most dp - 1 rows each
        pm = parallelize(model_for(case), mesh, case.config, batch=BATCH)
        if pm.scaler is not None:
            pm.scaler = _scaler()  # the sweep's initial scale, as the single process uses
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses, skipped, sent = [], [], []
        for idx, tgt in batches():
            with comms.meter() as m:
                r = train_step(pm, opt, idx, tgt, max_norm=1.0 if case.clip else None)
            sent.append({op: m.sent_bytes(op, group=comms.group_label(mesh.group("dp_cp")))
                         for op in ("all_gather", "reduce_scatter")})
            losses.append(float(r.loss))
            skipped.append(bool(r.skipped))
        held = memory.measure(pm.parameters(), opt)
        state = full_state_dict(pm)
        rank0 = dist.get_rank() == 0
        out.append(((losses, skipped, state if rank0 else None), held, rows, sent,
                    sum(p.numel() for p in pm.parameters()), local, pad))
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_run, 8, CASES, timeout=500)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_zero3_composed_equals_one_process(ranks, i):
    from sweep_run import compare, single_process

    case = CASES[i]
    for r in ranks[1:]:
        assert r[i][0][0] == ranks[0][i][0][0], f"{case}: ranks disagree on the loss"
    row = compare(case, ranks[0][i][0], single_process(case))
    assert row["ok"], row


@pytest.mark.parametrize("i", range(len(CASES)), ids=[str(c) for c in CASES])
def test_zero3_composed_holds_its_rows_of_each_tensor(ranks, i):
    """Parameters, gradients and AdamW's two moments: 4 bytes x its rows each, per rank;
    one all-gather and one reduce-scatter of (dp-1)/dp x dp x those bytes per step."""
    config = CASES[i].config
    dp = config.dp * config.cp
    total = 0
    for r in ranks:
        _, held, rows, sent, numel, local, pad = r[i]
        assert numel == rows                          # the parameters are the shards
        assert 0 <= dp * rows - local <= (dp - 1) * pad  # total / dp / tp / pp, padded per tensor
        assert held.params == 4 * rows and held.grads == 4 * rows, held
        assert held.optimizer_state == 2 * 4 * rows, held  # AdamW's moments, shaped like the shard
        for s in sent:                                # the ring's (N-1)/N of N shards, each way
            assert s == {"all_gather": (dp - 1) * 4 * rows, "reduce_scatter": (dp - 1) * 4 * rows}
        total += rows
    # over all dp x tp x pp ranks the shards add up to the model's numbers, plus the padding
    # and the tensors replicated over tp (LayerNorms, row biases) counted tp times, and the
    # tied embedding's copy on the last pipeline stage
    from sweep_run import model_for

    weights = model_for(CASES[i]).state_dict()
    whole = sum(p.numel() for p in model_for(CASES[i]).parameters())
    tied = weights["wte.weight"].numel() if config.pp > 1 else 0
    assert whole <= total <= (whole + tied) * config.tp


# ZeRO-2 with sequence parallelism: its hooks reduce-scatter the LayerNorms' partial gradients
# during backward; train_step sums their slices of the shard over tp afterwards.
ZERO2_SP = [SweepCase(ParallelConfig(dp=2, tp=2, zero_stage=2, sequence_parallel=True,
                                     microbatches=2), clip=True),
            SweepCase(ParallelConfig(dp=2, tp=2, zero_stage=2, sequence_parallel=True,
                                     precision="fp16"))]


def test_zero2_with_sequence_parallelism_equals_one_process():
    from sweep_run import compare, run_cases, single_process

    ranks = launch(run_cases, 4, ZERO2_SP, timeout=300)
    for i, case in enumerate(ZERO2_SP):
        row = compare(case, ranks[0][i], single_process(case))
        assert row["ok"], row


def _train_uneven(config):
    """3 AdamW steps of a model whose tensors do not split evenly over dp = 3 (vocabulary 255,
    n_embd 64, 4 heads): the last rank's rows of each tensor are padded with zeros."""
    import torch.distributed as dist

    from reference.model import GPT, GPTConfig
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep_run import EPS, LR, batches

    torch.manual_seed(0)
    cfg = GPTConfig.tiny(n_layer=4, block_size=16, vocab_size=255)
    pm = parallelize(GPT(cfg), config.mesh().build_groups(), config)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    for idx, tgt in batches():
        train_step(pm, opt, idx[:12] % 255, tgt[:12] % 255, max_norm=1.0)
    state = full_state_dict(pm)
    return state if not dist.is_initialized() or dist.get_rank() == 0 else None


def test_zero3_pads_uneven_rows():
    """dp 3 x pp 2 (6 ranks): 255 vocabulary rows are 85 a rank, 64 LayerNorm numbers 22, 22
    and 20 (two padding zeros), and the trained weights are one process's."""
    got = launch(_train_uneven, 6, ParallelConfig(dp=3, pp=2, zero_stage=3, microbatches=2),
                 timeout=300)[0]
    want = launch(_train_uneven, 1, ParallelConfig(microbatches=6), timeout=300)[0]
    from sweep_run import TOLERANCES

    assert got.keys() - want.keys() <= {"lm_head.weight"}  # the pipeline's copy of the tied wte
    assert torch.equal(got["wte.weight"], got["lm_head.weight"])
    TOLERANCES["fp32"]["weights"].assert_weights(got, want, "dp 3 x pp 2, ZeRO-3, padded rows")


def _zero2_sp_memory(config):
    """Bytes held after a step under ZeRO-2 x TP with SP, and this rank's TP-local numbers."""
    from reference import memory
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep import BATCH
    from sweep_run import EPS, LR, batches, model_for

    mesh = config.mesh().build_groups()
    case = SweepCase(config)
    local = sum(p.numel() for p in parallelize(model_for(case), mesh, config.with_(zero_stage=0),
                                               batch=BATCH).parameters())
    pm = parallelize(model_for(case), mesh, config, batch=BATCH)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    idx, tgt = batches()[0]
    train_step(pm, opt, idx, tgt)
    return memory.measure(pm.parameters(), opt), local


def test_zero2_with_sequence_parallelism_holds_the_formula():
    """ZeRO-2 x TP with SP, per rank after a step: the TP-local parameters whole, 1/dp of their
    gradients and of AdamW's moments (the paper's 4 + 4/dp + 8/dp bytes per number, one flat
    buffer padded to a multiple of dp); AdamW's step counter is counted apart."""
    from reference import memory

    config = ParallelConfig(dp=2, tp=2, zero_stage=2, sequence_parallel=True, microbatches=2)
    for held, local in launch(_zero2_sp_memory, 4, config, timeout=200):
        want = memory.model_state_bytes(local, config.dp, 2)
        assert (held.params, held.grads, held.optimizer_state) == (
            want.params, want.grads, want.optimizer_state), (held, want, local)
