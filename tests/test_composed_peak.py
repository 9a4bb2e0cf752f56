"""The peak memory of one composed training step, by part, against the formula.

On 8 gloo ranks, a tiny fp32 GPT (4 blocks, n_embd 32) takes a second AdamW step under
ZeRO-3 x TP (dp 4 x tp 2), ZeRO-3 x PP (dp 4 x pp 2, 1F1B), ZeRO-3 x TP x PP (2 x 2 x 2)
and, for contrast, ZeRO-1 x TP x PP. Every tensor created during `train_step` is watched
(`memory.PeakMemory`), plus the model states that existed before it while they live (the
shards, freed when the stage is gathered). Bytes are those of tensors, so the model states
are exact: with S the rank's shard numel (`ShardedParameters.shard_numel`), N = dp, P the
stage's whole TP-local numel and O = AdamW's two moments 8 S plus its step counters:

    entering the gather           O + 4 S                       (the parameter shards)
    entering the pipeline         O + 4 P                       (the stage whole, kept through
                                                                 every micro-batch)
    entering the reduce-scatter   O + 4 P + 4 P                 (held_in_step on the first stage;
                                                                 + the 4-byte loss on the last)
    reduce-scatter's own buffer   4 N S                         (the packed (N, S) gradients;
                                                                 each whole gradient is freed once
                                                                 copied in, before the (S,) output
                                                                 is made)

`estimate(..., stage=pp_rank)` gives each rank's stage: `Estimate.params_per_gpu` is its P
and `Estimate.held_in_step` its 8 P.
What is not exact, and the bound stated with it: the gather's temporaries (the reshape of a
parameter's (N, c) rows and the last shard, at most 4 S + the largest padded parameter),
the reduce-scatter's shrinking back (at most one parameter's shard beside the buffers), and
the pipeline's working memory: its peak lies between the executor's `peak_activation_bytes`
(stored for backward) and that plus the whole gradients plus as much again (autograd's
activation gradients and unsaved forward temporaries, never more than the stored bytes here).

The step's peak is the larger of the pipeline's and the reduce-scatter's; with the reduce-
scatter's one (N, S) buffer every step here peaks in the pipeline. `estimate` models the same
three phases (`Estimate.phases`, its total the largest): the last test checks each against the
measured one and the step's peak on every rank, an upper bound within 10 %.
"""
from __future__ import annotations

import math
import weakref

import pytest
import torch

from reference import memory
from reference.parallel.config import ParallelConfig
from reference.runtime import launch

pytestmark = pytest.mark.timeout(300)

CONFIGS = [ParallelConfig(dp=4, tp=2, zero_stage=3, microbatches=2),
           ParallelConfig(dp=4, pp=2, zero_stage=3, microbatches=2),
           ParallelConfig(dp=2, tp=2, pp=2, zero_stage=3, microbatches=4),
           ParallelConfig(dp=2, tp=2, pp=2, zero_stage=1, microbatches=4)]
BATCH = (16, 16)
SIZES = dict(n_layer=4, block_size=16)


def _storages(tensors) -> dict:
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr():
            out[s.data_ptr()] = s.nbytes()
    return out


class _StepPeak(memory.PeakMemory):
    """Bytes alive: new tensors, plus the model states from before the block while they live;
    the peak per phase, and on entering each phase the total and its parts (params, grads,
    optimizer state)."""

    def __init__(self, pm, opt, before):
        super().__init__(also=self._old)
        self.pm, self.opt, self.before = pm, opt, before
        self.phase, self.peaks, self.entry, self.parts = "start", {}, {}, {}

    def _old(self) -> int:
        return sum(n for ref, n in self.before if ref() is not None)

    def state_parts(self):
        params = [p for p in self.pm.parameters()]
        state = [v for o in memory._optimizers(self.opt) for st in o.state.values()
                 for v in st.values() if isinstance(v, torch.Tensor)]
        return (sum(_storages(params).values()),
                sum(_storages(p.grad for p in params if p.grad is not None).values()),
                sum(_storages(state).values()))

    def enter(self, phase):
        self.phase = phase
        self.entry[phase] = self.live_bytes + self._old()
        self.parts[phase] = self.state_parts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        total = self.live_bytes + self._old()
        if total > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = total
        return out


def _measure():
    from reference.model import GPT, GPTConfig
    from reference.parallel.estimate import estimate
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep_run import batches

    out = []
    for config in CONFIGS:
        mesh = config.mesh().build_groups()
        torch.manual_seed(0)
        pm = parallelize(GPT(GPTConfig.tiny(**SIZES)), mesh, config, batch=BATCH)
        opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        (x, y), (x2, y2) = batches(2)
        train_step(pm, opt, x, y)  # the optimizer's state exists from here on
        held = memory.measure(pm.parameters(), opt)
        # the model states held before the step, each storage once (ZeRO-1's parameters and
        # gradients are views of flat buffers), watched while they live
        params = list(pm.parameters()) + [p for o in memory._optimizers(opt)
                                          for g in o.param_groups for p in g["params"]]
        state = [v for o in memory._optimizers(opt) for st in o.state.values()
                 for v in st.values() if isinstance(v, torch.Tensor)]
        before = {}
        for t in params + [p.grad for p in params if p.grad is not None] + state:
            before.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        mon = _StepPeak(pm, opt, [(weakref.ref(s), s.nbytes()) for s in before.values()])
        del params, state, before, t
        sh = getattr(pm.data_parallel, "sharded", None)  # ZeRO-3 per parameter
        if sh is not None:  # mark the phases of train_step
            gather, reduce = sh.gather, sh.reduce_scatter
            sh.gather = lambda: (mon.enter("gather"), gather(), mon.enter("pipeline"))
            sh.reduce_scatter = lambda: (mon.enter("reduce"), reduce(), mon.enter("optimizer"))
        else:  # ZeRO-1: the optimizer's reduce-scatter and all-gather in step()
            step = opt.step
            opt.step = lambda *a, **k: (mon.enter("optimizer"), step(*a, **k))[1]
        with mon:
            result = train_step(pm, opt, x2, y2)
        mon.before = []
        whole = [p.shape for p in pm.parameters()] if sh is None else sh.shapes
        n = mesh.dp_cp
        e = estimate(GPTConfig.tiny(**SIZES), config, global_batch=BATCH[0], stage=mesh.pp_rank,
                     micro_batch=BATCH[0] // (config.dp * config.microbatches))
        out.append(dict(
            held=held, peak=mon.peak_bytes, peaks=mon.peaks, entry=mon.entry, parts=mon.parts,
            act=result.peak_activation_bytes, P=sum(s.numel() for s in whole),
            S=sh.shard_numel if sh is not None else None, n=n,
            maxpad=max(4 * math.ceil(s[0] / n) * n * (s.numel() // s[0]) for s in whole),
            maxshard=max(4 * math.ceil(s[0] / n) * (s.numel() // s[0]) for s in whole),
            first=pm.is_first_stage, last=pm.is_last_stage,
            est_params=e.params_per_gpu, held_in_step=e.held_in_step, est_phases=e.phases,
            est_peak=e.total_bytes))
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_measure, 8, timeout=240, quiet=True)


@pytest.mark.parametrize("i", range(3), ids=[str(c) for c in CONFIGS[:3]])
def test_zero3_composed_step_peak_by_part(ranks, i):
    for r in ranks:
        m = r[i]
        S, P, N, act, pad = m["S"], m["P"], m["n"], m["act"], m["maxpad"]
        held, entry, peaks, parts = m["held"], m["entry"], m["peaks"], m["parts"]
        O = held.optimizer_state + held.other  # AdamW's moments (8 S) and step counters
        assert held.optimizer_state == 8 * S and held.params == held.grads == 4 * S
        loss = 4 if m["last"] else 0           # the last stage's loss, alive into the reduction
        # exact: what each phase starts from
        assert entry["gather"] == O + 4 * S                     # shards; the gradients dropped
        assert entry["pipeline"] == O + 4 * P                   # the stage whole
        assert entry["reduce"] == O + 8 * P + loss              # ... and its whole gradients
        assert parts["gather"] == (4 * S, 0, O)
        assert parts["pipeline"] == (4 * P, 0, O)
        assert parts["reduce"] == (4 * P, 4 * P, O)
        assert m["est_params"] == P and m["held_in_step"] == 8 * P  # the estimate of its stage
        # the gather: (N, S) received and every parameter copied out whole, beside the packed
        # shards; bound: the last shard and one reshaped (N c, ...) block still alive
        grown = peaks["gather"] - entry["gather"]
        assert 4 * N * S + 4 * P <= grown <= 4 * N * S + 4 * P + 4 * S + pad, (grown, N, S, P)
        # the reduce-scatter: the packed (N, S) gradients, while every whole gradient still
        # lives (each is freed once copied in, so the (S,) output comes when they are gone);
        # bound: shrinking back, one parameter's new shard beside them at most
        grown = peaks["reduce"] - entry["reduce"]
        buffers = 4 * N * S
        assert buffers <= grown <= buffers + m["maxshard"], (grown, N, S)
        # the pipeline: what the executor stores for backward, up to the gradients and as much
        # again of autograd's working memory
        grown = peaks["pipeline"] - entry["pipeline"]
        assert act <= grown <= 4 * P + 2 * act, (grown, act, P)
        assert m["peak"] == max(peaks.values())


def test_zero1_composed_step_peak(ranks):
    """ZeRO-1: the whole stage, its flat gradient buffer and 1/dp of the moments all step long."""
    config = CONFIGS[3]
    for r in ranks:
        m = r[3]
        held, act = m["held"], m["act"]
        assert held.model_states == memory.model_state_bytes(m["P"], config.dp, 1).model_states
        states = held.model_states + held.other
        S = math.ceil(m["P"] / config.dp)
        loss = 4 if m["last"] else 0
        # exact: step() starts from the model states (and the loss), adds the reduce-scatter's
        # (S,) output and the updated shard's (S,) copy that the all-gather sends
        assert m["entry"]["optimizer"] == states + loss
        assert m["peaks"]["optimizer"] - m["entry"]["optimizer"] == 2 * 4 * S
        # bound: the executor's stored activations, up to as much again of autograd's working
        # memory; the optimizer step's shard buffers (4 S each) stay under it here
        assert states + act <= m["peak"] <= states + 2 * act, (m["peak"], states, act)


def test_zero3_step_peak_is_the_larger_of_pipeline_and_reduce_scatter(ranks):
    """The whole step's peak from the configuration and the executor's activations: the
    pipeline's (the stage whole and its activations) or the reduce-scatter's (the stage, its
    whole gradients and the collective's buffer), whichever is larger."""
    for i in range(3):
        for r in ranks:
            m = r[i]
            S, P, N, act, pad = m["S"], m["P"], m["n"], m["act"], m["maxpad"]
            O = m["held"].optimizer_state + m["held"].other
            loss = 4 if m["last"] else 0
            pipeline = O + 4 * P + act
            reduce = O + 8 * P + loss + 4 * N * S
            gather = O + 4 * N * S + 4 * P
            lower = max(pipeline, reduce)
            upper = max(pipeline + 4 * P + act, reduce + m["maxshard"], gather + 4 * S + pad)
            assert lower <= m["peak"] <= upper, (CONFIGS[i], m["peak"], lower, upper)


def test_estimate_bounds_each_phase_and_the_step_peak(ranks):
    """`estimate` for each rank's stage, from the configuration alone (activations by
    Korthikanti et al.'s formula in fp32, not the executor's measurement): its gather and
    reduce-scatter phases bound the measured ones, above them by at most the temporaries they
    count in full (the gather: 4 S and the largest padded tensor; the reduce-scatter: one
    shard and the 4-byte loss); its pipeline phase and the step's peak are upper bounds
    within 10 % (measured: 2.8 to 8.5 % above, ZeRO-1 included). The
    margin is the formula's: per block and micro-batch it counts 1-byte dropout masks and the
    (a, s, s) attention scores with their mask, which this model (no dropout, a fused attention
    kernel) does not store, against the executor's extras (the stage's input and output,
    LayerNorm statistics); on the head's stage it adds twice the log-probabilities for the
    loss's backward, and on the first backward the larger of one micro-batch's activations and
    the whole gradients."""
    for i, config in enumerate(CONFIGS):
        for r in ranks:
            m = r[i]
            est, peaks = m["est_phases"], m["peaks"]
            if config.zero_stage == 3:
                assert set(est) == {"gather", "pipeline", "reduce-scatter"}
                for phase, measured in (("gather", "gather"), ("pipeline", "pipeline"),
                                        ("reduce-scatter", "reduce")):
                    assert peaks[measured] <= est[phase], (config, phase, peaks[measured], est[phase])
                assert est["gather"] - peaks["gather"] <= 4 * m["S"] + m["maxpad"], config
                assert est["reduce-scatter"] - peaks["reduce"] <= m["maxshard"] + 4, config
            assert m["est_peak"] == max(est.values())
            assert m["peak"] <= m["est_peak"] <= 1.10 * m["peak"], (config, m["peak"], m["est_peak"])
