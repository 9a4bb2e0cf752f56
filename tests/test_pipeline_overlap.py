"""DualPipe's overlapped F&B (`reference.pipeline_parallel.overlap`), on 4 gloo ranks.

* The pairs as data: `overlap_pairs` marks on each rank as many F&B pairs as DualPipe's
  ``DualPipeV.step`` runs through ``_forward_backward_chunk`` (its step 4: two per round, the last
  rank's first one apart; its step 5: one per round), and the moved messages are free of deadlock.
* One launch (`reference.train.dualpipe`, what `bench/dualpipe_overlap.py` prints:
  pp = 2 in a V, dp = ep = 2, a mixture of experts in every block, injected costs with the
  all-to-all as long as the MLP): ZB-V, DualPipeV one pair after the other, and DualPipeV
  overlapped, each twice in turn. Gradients equal to one process; the peak of stored bytes the
  same as in sequence; an all-to-all of one micro-batch's forward in flight while another
  micro-batch's backward computes; and the step times, measured in the same run, ordered
  overlapped < sequential DualPipeV and < ZB-V.
* The composed step's option (`ParallelConfig.overlap_forward_backward`, off by default): on and
  off equal bit for bit and to one process, in one launch; refused where it means nothing.
"""
import functools

import pytest

from reference.train import dualpipe as bench
from reference.pipeline_parallel import build_schedule, overlap_pairs
from reference.pipeline_parallel.actions import IN_FLIGHT, OPS
from reference.runtime import launch
from reference.tolerance import exact, gradient

M, COST = 8, 0.02


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 10), (8, 16)])
def test_the_pairs_are_dualpipes(pp, m):
    s = overlap_pairs(build_schedule("dualpipev", pp, m, virtual=2))  # validated: no deadlock
    for r in range(pp):
        step_4, step_5 = m - 2 * pp + r + 1, pp - r - 1  # DualPipeV.step's rounds
        assert len(s.pairs[r]) == 2 * step_4 - (r == pp - 1) + step_5, (pp, m, r)
        pairs = [st for st in s.steps(r) if len(st) == 2 and not st[0].is_comm]
        assert all(f.op == "F" and b.op == "B" and f.chunk != b.chunk for f, b in pairs)
    with pytest.raises(ValueError, match="DualPipeV"):
        overlap_pairs(build_schedule("zb-v", 2, 4, virtual=2))


@functools.lru_cache(maxsize=None)
def _run():
    return bench.run(M, COST, with_grads=True)


def test_overlapped_dualpipev_equals_one_process_and_hides_the_all_to_all():
    results = _run()
    ref = bench.one_process_grads(M)
    covered = set()
    for rank, out in enumerate(results):
        for name in bench.RUNS:
            for k, g in out[name]["grads"].items():  # 2 m micro-batches, the tied embedding's copy
                gradient(bench.DP * M + 1).assert_close(g, ref[k], f"rank {rank} {name} {k}")
                covered.add(k)
    assert covered == set(ref)
    for rank, out in enumerate(results):  # a pair holds what its F stores and its B frees, in that order
        assert out["dualpipev-overlap"]["peak"] == out["dualpipev"]["peak"] > 0, rank
    # a forward's all-to-all in flight while the backward of another micro-batch computes
    trace = results[0]["dualpipev-overlap"]["trace"]
    ops = {e.action.op for e in trace}
    assert set(IN_FLIGHT) <= ops <= set(OPS), ops  # every op of the trace is one the course names
    a2a = [e for e in trace if e.action.op == "A2A_F"]
    under = [(x, e) for x in a2a for e in trace if e.action.op == "B" and e.action.mb != x.action.mb
             and e.start < x.end and x.start < e.end]
    assert under, "no forward all-to-all overlapped a backward's compute"
    fig = bench.figures(results, M, COST)
    step = {k: v["step"] for k, v in fig.items()}
    assert step["dualpipev-overlap"] < step["dualpipev"], step
    assert step["dualpipev-overlap"] < step["zb-v"], step


def test_the_composed_steps_overlap_option_changes_nothing_but_the_timeline():
    """``ParallelConfig.overlap_forward_backward`` in the composed step (`parallelize`,
    `train_step`): DualPipeV at pp 2 x dp 2 with ep 2 and clipping, 3 AdamW steps, off (the pairs
    one after the other) and on (overlapped), in one launch. Overlapping only reorders when each
    piece runs, not what it computes: the two runs' losses and weights are equal bit for bit, and
    both equal one process within the policy (`sweep_run.compare`). A step's trace holds the pairs'
    all-to-alls in flight, which `plot_step` draws and names. Refused where it means nothing."""
    from reference.parallel.config import ParallelConfig
    from reference.parallel.viz import plot_step
    from sweep import SweepCase
    from sweep_run import compare, single_process

    off = SweepCase(ParallelConfig(dp=2, pp=2, ep=2, schedule="dualpipev", virtual_stages=2,
                                   microbatches=4), clip=True, moe=True)
    on = SweepCase(off.config.with_(overlap_forward_backward=True), clip=True, moe=True)
    assert not on.problems() and "f&b-overlap" in str(on)
    ranks = launch(_composed, 4, [off, on], timeout=300)
    got_off, got_on = ranks[0][0]
    traces = [r[1] for r in ranks]  # a step of the overlapped run: its all-to-alls drawn below the compute
    assert all(any(e.kind == "A2A" for e in t) for t in traces)
    legend = [t.get_text() for t in plot_step(traces).axes[0].get_legend().get_texts()]
    assert "expert all-to-all in flight (overlapped F&B)" in legend, legend
    assert got_on[0] == got_off[0]  # the losses
    for name, value in got_off[2].items():
        exact().assert_close(got_on[2][name], value, f"{name}: overlapped against one after the other")
    row = compare(on, got_on, single_process(on))
    assert row["ok"], row
    for config, word in ((off.config.with_(schedule="zb-v", overlap_forward_backward=True), "DualPipeV"),
                         (on.config.with_(dp=1, ep=1), "ep=1"),
                         (on.config.with_(activation_checkpointing=True), "recomputed")):
        assert any(word in p for p in config.problems(config.world_size, None, None, 4)), config


def _composed(cases):
    """`sweep_run.run_cases`, then one more step of the last case for its trace."""
    import torch

    from reference.parallel import parallelize, train_step
    from sweep import BATCH
    from sweep_run import batches, model_for, run_cases

    out = run_cases(cases)
    case = cases[-1]
    pm = parallelize(model_for(case), case.config.mesh().build_groups(), case.config, batch=BATCH)
    return out, train_step(pm, pm.make_optimizer(torch.optim.AdamW, lr=1e-3), *batches(1)[0]).trace
