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
"""
import functools

import pytest

from reference.train import dualpipe as bench
from reference.pipeline_parallel import build_schedule, overlap_pairs
from reference.tolerance import gradient

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
    a2a = [e for e in trace if e.action.op == "A2A_F"]
    under = [(x, e) for x in a2a for e in trace if e.action.op == "B" and e.action.mb != x.action.mb
             and e.start < x.end and x.start < e.end]
    assert under, "no forward all-to-all overlapped a backward's compute"
    fig = bench.figures(results, M, COST)
    step = {k: v["step"] for k, v in fig.items()}
    assert step["dualpipev-overlap"] < step["dualpipev"], step
    assert step["dualpipev-overlap"] < step["zb-v"], step
