"""DualPipe's overlapped F&B against its pairs run one after the other, and against ZB-V.

    python bench/dualpipe_overlap.py [--microbatches 8] [--cost 0.02]

Eight ranks would not fit a laptop's cores, so the pipeline is pp = 2 ranks (four model stages in
a V) times dp = ep = 2 (the experts split over the two data-parallel ranks of a stage): 4 gloo
ranks. The model is a GPT whose every block's MLP is a mixture of 4 experts, 2 per token, no token
dropped (one block per stage). Costs are injected, with tau = ``--cost``: per block and
micro-batch, attention takes tau forward and 2 tau backward, the experts together tau and 2 tau,
and every dispatch and combine all-to-all, forward or backward, tau: the all-to-all as long as
the MLP. The expert counts' exchange is not charged. `reference.train.dualpipe` runs
it, each schedule twice in turn.

For each schedule, the step time (the slowest rank's span from the common start, the lesser of
the two) and the idle share 1 - C / step, C the compute a rank is charged (2 chunks x m x 6 tau;
the same work under every schedule; the tiny model's own compute counts as idle). Sequential
DualPipeV waits for each all-to-all where it stands, as ZB-V does; overlapped, a pair's
all-to-alls run while the other micro-batch computes. The gradients, equal to one process's, are
checked by tests/test_pipeline_overlap.py.
"""
from __future__ import annotations

import argparse

from reference.train.dualpipe import PP, DP, figures, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--cost", type=float, default=0.02)
    args = ap.parse_args()
    results = run(args.microbatches, args.cost)
    fig = figures(results, args.microbatches, args.cost)
    base = fig["dualpipev"]["step"]
    print(f"pp={PP} (V, 4 stages), dp=ep={DP}, m={args.microbatches}, tau={args.cost}s: "
          f"attention tau / 2 tau, experts tau / 2 tau, each all-to-all tau")
    print(f"{'schedule':<20}{'step (s)':>10}{'idle':>8}{'vs sequential DualPipeV':>26}")
    for name, f in fig.items():
        print(f"{name:<20}{f['step']:>10.3f}{f['idle']:>8.1%}{f['step'] / base:>26.2f}")


if __name__ == "__main__":
    main()
