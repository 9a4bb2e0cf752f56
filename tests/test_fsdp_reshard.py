"""Composed ZeRO-3 resharded between micro-batches (`ParallelConfig.reshard_after_forward`,
`reference.zero.fsdp_reshard`) against gathering once a step and against one process.

Parity: 3 AdamW steps (clipped at a global norm of 1) of dp 2 x pp 2 (1F1B, m = 4), with and
without activation checkpointing, and of dp 2 x tp 2 x pp 2 with sequence parallelism (1F1B, and
interleaved over 2 chunks a rank, each chunk its own units), equal
one process within `sweep_run.TOLERANCES` (the composed-FSDP parity tests' oracle) and the
gather-once run of the same configuration within the same policy bounds (`reference.tolerance`:
the losses, every weight and the mean weight differences, overall and per tensor, after 3
AdamW steps): resharding
reduce-scatters every micro-batch's gradients where gathering once reduces their sum, the same
numbers added in another order.

Traffic, per step and rank, over the dp group (N ranks; 4 N S the stage's fp32 bytes, each
tensor padded to a multiple of N rows; m micro-batches; U the chunk's units, its blocks and
its root; summed over the chunks with virtual stages), measured by `comms.meter`:

    reshard_after_forward=True    all-gather     2 m (N-1)/N x 4 N S   in 2 m U calls
                                  reduce-scatter   m (N-1)/N x 4 N S   in   m U calls
    reshard_after_forward=False   all-gather         (N-1)/N x 4 N S   in 1 call
                                  reduce-scatter     (N-1)/N x 4 N S   in 1 call

Memory: the bytes of parameters and gradients a rank holds (every distinct storage of its
parameters, their `.grad`, and with resharding the shards and their accumulated gradients),
sampled after every operator of a step by `memory.PeakMemory`, on a GPT of 8 blocks (4 a
stage; P the stage's numbers, P_b a block's, P_r the root's):

    gather once    8 P                 the stage whole and its whole gradients
    reshard        8 S + 8 P_b + 4 P_r on the first stage: the shards and their gradients,
                                       one block and its gradients, the embedding whole
                                       through the action (its gradient comes last)
                   8 S + 8 P_b         on the last stage: the head's gradients come first,
                                       are reduce-scattered and the head freed

and after every F and B a resharded stage holds its shards and, once a backward has run,
their gradients: 4 S, then 8 S.
"""
from __future__ import annotations

import pytest
import torch

from reference.parallel.config import ParallelConfig
from sweep import SweepCase
from reference.runtime import launch

pytestmark = pytest.mark.timeout(300)

PP = ParallelConfig(dp=2, pp=2, zero_stage=3, microbatches=4)
PP_CASES = [SweepCase(PP, clip=True), SweepCase(PP.with_(reshard_after_forward=True), clip=True),
            SweepCase(PP.with_(activation_checkpointing=True), clip=True),
            SweepCase(PP.with_(activation_checkpointing=True, reshard_after_forward=True), clip=True)]
TP_PP = ParallelConfig(dp=2, tp=2, pp=2, zero_stage=3, sequence_parallel=True, microbatches=4)
TP_PP_CASES = [SweepCase(TP_PP, clip=True), SweepCase(TP_PP.with_(reshard_after_forward=True), clip=True),
               SweepCase(TP_PP.with_(reshard_after_forward=True, schedule="interleaved",
                                     virtual_stages=2), clip=True)]
MEMORY_MODEL = dict(n_layer=8, block_size=16)   # 4 blocks a stage at pp = 2
OPS = ("all_gather", "reduce_scatter")


def _train(cases):
    """Per case: ((losses, skipped, weights on rank 0), per step {op: (bytes sent, calls)} over
    the dp group, S, the chunk's units)."""
    import torch.distributed as dist

    from reference import comms
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep import BATCH
    from sweep_run import EPS, LR, batches, model_for

    out = []
    for case in cases:
        mesh = case.config.mesh().build_groups()
        pm = parallelize(model_for(case), mesh, case.config, batch=BATCH)
        opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        dp = comms.group_label(mesh.group("dp_cp"))
        losses, skipped, sent = [], [], []
        for idx, tgt in batches():
            with comms.meter() as m:
                r = train_step(pm, opt, idx, tgt, max_norm=1.0 if case.clip else None)
            sent.append({op: (m.sent_bytes(op, group=dp), m.calls(op, group=dp)) for op in OPS})
            losses.append(float(r.loss))
            skipped.append(bool(r.skipped))
        state = full_state_dict(pm)
        reshard = pm.data_parallel.reshard
        out.append(((losses, skipped, state if dist.get_rank() == 0 else None), sent,
                    pm.data_parallel.sharded.shard_numel, [len(c) for c in reshard.units] if reshard else None))
    return out


def _held_bytes(pm) -> int:
    """Bytes of the distinct storages of the parameters, their gradients, and the resharding
    units' shards and accumulated shard gradients (0-byte storages: freed)."""
    params, reshard = pm.parameters(), pm.data_parallel.reshard
    tensors = params + [p.grad for p in params if p.grad is not None] \
        + (reshard.held_tensors() if reshard is not None else [])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    storages.pop(0, None)
    return sum(storages.values())


def _memory():
    """Per way (gather once, reshard): the held peak of a second step, the held bytes after
    each of its actions, and the sizes S, P, P_b, P_r of this rank's stage."""
    from reference import memory
    from reference.model import GPT, Block, GPTConfig
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep import BATCH
    from sweep_run import batches

    class Held(memory.PeakMemory):
        def __init__(self, pm):
            super().__init__()
            self.pm, self.held_peak = pm, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.held_peak = max(self.held_peak, _held_bytes(self.pm))
            return out

    out = {}
    for reshard in (False, True):
        config = PP.with_(reshard_after_forward=reshard)
        torch.manual_seed(0)
        pm = parallelize(GPT(GPTConfig.tiny(**MEMORY_MODEL)), config.mesh().build_groups(), config,
                         batch=BATCH)
        opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        (x, y), (x2, y2) = batches(2)
        train_step(pm, opt, x, y)
        after = []
        r = pm.data_parallel.reshard
        if r is not None:  # the held bytes after each F and B of the measured step
            hook = r.hook
            r.hook = lambda when, a: (hook(when, a), when == "after" and after.append(_held_bytes(pm)))
        mon = Held(pm)
        with mon:
            act = train_step(pm, opt, x2, y2).peak_activation_bytes
        sharded = pm.data_parallel.sharded
        whole = {id(p): s.numel() for p, s in zip(sharded.params, sharded.shapes)}
        blocks = [m for st in pm.stages for m in st.modules() if isinstance(m, Block)]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        out[reshard] = dict(
            peak=mon.held_peak, after=after, act=act, S=sharded.shard_numel, P=sum(whole.values()),
            P_b={sum(whole[id(p)] for p in b.parameters()) for b in blocks},
            P_r=sum(n for i, n in whole.items() if i not in in_blocks),
            first=pm.is_first_stage, actions=2 * config.microbatches)
    return out


@pytest.fixture(scope="module")
def dp2_pp2():
    def run():
        return _train(PP_CASES), _memory()
    return launch(run, 4, timeout=240, quiet=True)


@pytest.fixture(scope="module")
def dp2_tp2_pp2():
    return launch(_train, 8, TP_PP_CASES, timeout=240, quiet=True)


# ---------------------------------------------------------------------------- the option
def _refusal(config, world, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        config.validate(world, **kwargs)
    return str(err.value)


def test_config_defaults_to_gathering_once_and_refuses_what_it_cannot_reshard():
    from reference.model import GPTConfig

    assert ParallelConfig().reshard_after_forward is False  # PyTorch's fully_shard: None
    PP.with_(reshard_after_forward=True).validate(4, GPTConfig.tiny(n_layer=4), batch=(16, 16))
    TP_PP.with_(reshard_after_forward=True).validate(8)
    for config, world in [(PP.with_(zero_stage=0), 4), (PP.with_(zero_stage=1), 4),
                          (ParallelConfig(pp=2, zero_stage=3, microbatches=2), 2)]:
        text = _refusal(config.with_(reshard_after_forward=True), world)
        assert "reshard_after_forward=True needs ZeRO-3 over dp x cp > 1" in text
        assert f"zero_stage={config.zero_stage}, dp={config.dp} x cp=1 = {config.dp}" in text
    text = _refusal(ParallelConfig(dp=2, zero_stage=3, reshard_after_forward=True), 2)
    assert "runs as FSDP by blocks" in text and "tp=1, pp=1, zero3_engine='auto'" in text
    assert "set zero3_engine='parameters'" in text  # the way to reshard rows at tp = pp = 1
    ParallelConfig(dp=2, zero_stage=3, reshard_after_forward=True, zero3_engine="parameters").validate(2)
    text = _refusal(PP.with_(reshard_after_forward=True), 4, n_experts=4)
    assert "with experts (ep=1, n_experts=4)" in text and "different orders" in text
    text = _refusal(ParallelConfig(dp=2, ep=2, zero_stage=3, pp=2, microbatches=2,
                                   reshard_after_forward=True), 4, n_experts=4)
    assert "with experts (ep=2, n_experts=4)" in text
    assert "must be True or False" in _refusal(PP.with_(reshard_after_forward=1), 4)


# ---------------------------------------------------------------------------- parity
def _same_run(case, got, want) -> None:
    """The resharded run's (losses, skipped, weights) against the gather-once run's."""
    from sweep_run import TOLERANCES

    tol = TOLERANCES[case.config.precision]
    tol["loss"].assert_losses(got[0], want[0], f"{case} losses against gathering once")
    assert got[2].keys() == want[2].keys()
    tol["weights"].assert_weights(got[2], want[2], f"{case} against gathering once")


@pytest.mark.parametrize("once, resharded", [(0, 1), (2, 3)], ids=["1f1b", "1f1b-recompute"])
def test_zero3_pp_resharded_equals_one_process_and_gathering_once(dp2_pp2, once, resharded):
    from sweep_run import compare, single_process

    ranks = [r[0] for r in dp2_pp2]
    case = PP_CASES[resharded]
    assert case.config.reshard_after_forward and not PP_CASES[once].config.reshard_after_forward
    for r in ranks[1:]:
        assert r[resharded][0][0] == ranks[0][resharded][0][0], "ranks disagree on the loss"
    assert ranks[0][resharded][3] == [3] and ranks[0][once][3] is None  # the path each took
    row = compare(case, ranks[0][resharded][0], single_process(case))
    assert row["ok"], row
    _same_run(case, ranks[0][resharded][0], ranks[0][once][0])


@pytest.mark.parametrize("i", [1, 2], ids=["1f1b", "interleaved"])
def test_zero3_tp_pp_sp_resharded_equals_one_process_and_gathering_once(dp2_tp2_pp2, i):
    from sweep_run import compare, single_process

    case = TP_PP_CASES[i]
    units = [[3], [2, 1]][i - 1]  # rank 0: 2 blocks and the embedding; or block 0 + it, block 2
    assert dp2_tp2_pp2[0][i][3] == units and dp2_tp2_pp2[0][0][3] is None  # the path each took
    row = compare(case, dp2_tp2_pp2[0][i][0], single_process(case))
    assert row["ok"], row
    _same_run(case, dp2_tp2_pp2[0][i][0], dp2_tp2_pp2[0][0][0])


# ---------------------------------------------------------------------------- traffic
def _check_traffic(results, cases):
    for rank in results:
        for case, (_, sent, S, units) in zip(cases, rank):
            m, N = case.config.microbatches, case.config.dp * case.config.cp
            stage_bytes = 4 * N * S                           # padded per tensor
            once = (N - 1) * stage_bytes // N
            if case.config.reshard_after_forward:
                U = sum(units)                                # over the chunks
                want = {"all_gather": (2 * m * once, 2 * m * U), "reduce_scatter": (m * once, m * U)}
            else:
                want = {"all_gather": (once, 1), "reduce_scatter": (once, 1)}
            assert sent == [want] * len(sent), (str(case), S, units)


def test_traffic_is_3m_transfers_against_2(dp2_pp2):
    """dp 2 x pp 2, m = 4, with and without recompute: every step, every rank, exactly."""
    _check_traffic([r[0] for r in dp2_pp2], PP_CASES)
    assert [r[0][1][3] for r in dp2_pp2] == [[3]] * 4  # a stage: 2 blocks and its root


def test_traffic_with_tensor_parallelism(dp2_tp2_pp2):
    _check_traffic(dp2_tp2_pp2, TP_PP_CASES)


# ---------------------------------------------------------------------------- memory
def test_resharding_holds_less_of_the_stage_during_the_step(dp2_pp2):
    for rank in dp2_pp2:
        once, resh = rank[1][False], rank[1][True]
        S, P, P_r = resh["S"], resh["P"], resh["P_r"]
        (P_b,) = resh["P_b"]                                   # the blocks are all alike
        assert once["peak"] == 8 * P                           # the stage whole, and its gradients
        assert resh["peak"] == 8 * S + 8 * P_b + (4 * P_r if resh["first"] else 0)
        assert resh["peak"] < once["peak"]
        # the executor's stored activations leave the parameters out either way, wherever the
        # resharded ones' storage is at the moment autograd saves them
        assert resh["act"] == once["act"] > 0
        # between micro-batches: the shards, and after a backward their gradients too
        after = resh["after"]
        assert len(after) == resh["actions"] and after[-1] == 8 * S
        assert set(after) <= {4 * S, 8 * S} and after[0] == 4 * S


def test_the_course_states_pytorchs_default_as_the_pinned_version_has_it():
    """`fully_shard`'s reshard_after_forward defaults to None (True for every module but the
    root, False for the root) in the pinned PyTorch; every place that names that default says
    None, never "defaults to True"."""
    import inspect
    from pathlib import Path

    from torch.distributed.fsdp import fully_shard

    assert inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
    root = Path(__file__).resolve().parent.parent
    for name in ("docs/parallel-gpt.md", "docs/trainer.md", "docs/benchmarks.md", "notebooks/06_3d_parallel.ipynb", "reference/parallel/config.py",
                 "reference/zero/fsdp_reshard.py", "reference/train/config.py",
                 "reference/train/describe.py"):
        text = " ".join((root / name).read_text().replace("\\n\",\n", " ").split())
        assert "fully_shard` defaults to `reshard_after_forward=True" not in text, name
        assert "fully_shard defaults to True" not in text and "fully_shard's true" not in text, name
        assert "None" in text, name
