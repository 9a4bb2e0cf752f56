"""DualPipe: micro-batches fed from both ends of the pipeline, every stage held twice.

DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), section 3.2.1, and its code (``DualPipe.step``
in deepseek-ai/DualPipe). The model is cut into p stages over p ranks (p even). Rank r holds
two chunks: chunk 0 runs stage r for the micro-batches that go forward from rank 0 to rank
p - 1, and chunk 1 runs a second copy of stage p - 1 - r for those that go from rank p - 1 to
rank 0. So ranks 0 and p - 1 each hold the embedding and the head, every rank holds twice
1F1B's parameters (DualPipe's README: "2x"), and after the step the gradients of a stage's two
copies are summed (`sum_copies`: rank r with rank p - 1 - r, both then holding the whole
gradient), so that both copies take the same optimizer step and stay equal.

As the checker sees it, the two directions are two pipelines of p stages each, numbered 0 ..
p - 1 and p .. 2 p - 1: stage p + k is model stage k run from rank p - 1 - k, so rank r's chunks
are stages r and 2 p - 1 - r, the V's numbers (`VSchedule`), but stage p - 1 is a last stage
and stage p a first one (`ends`). Micro-batch i goes in direction i mod 2 (the even ones from
rank 0, the odd ones from rank p - 1; DualPipe's example feeds each end half of the batch).

The order on rank r is DualPipe's eight steps, with h = min(r, p - 1 - r) the rank's place
counted from its nearer end, "phase 0" the direction in which the rank lies in the first half
of the pipeline, and n = m / 2 micro-batches per direction:

    1. 2 (p/2 - h - 1) F0            warm-up: phase 0 ahead
    2. h + 1 times F0 F1
    3. p/2 - h - 1 times I1 W F1     (B split: zero bubble)
    4. n - p + h + 1 times F0&B1 F1&B0    (the middle ranks' first pair not overlapped)
    5. p/2 - h - 1 times B1 F1&B0
    6. h + 1 times B1 B0             (split into I, W from the middle on)
    7. p/2 - h - 1 times W I0
    8. h + 1 times W

which is DualPipeV's order on p / 2 ranks with n micro-batches, rank h (`_dualpipev_order`):
DualPipeV is DualPipe cut in half (Sea AI Lab's "cut-in-half"), and the two middle ranks of
DualPipe play the V's turn. DualPipe asserts p even, m even and m >= 2 p; so does the builder.

Time and memory, a chunk being a whole stage here (in the V, half of one): rank r computes
m (F + B) per step, as under 1F1B, and holds at most p + 1 chunk micro-batches (the README's
"PP + 1"). With the pairs F&B overlapped, the most idle rank idles DualPipe's
(p/2 - 1)(F&B + B - 3W) (tests/test_pipeline_dualpipe.py reproduces the README's row).
`overlap_pairs` marks the same pairs as in DualPipeV; `run_pipeline` runs them overlapped.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference import comms
from reference.pipeline_parallel import check
from reference.pipeline_parallel.zero_bubble import VSchedule, build_dualpipev, build_from_orders

__all__ = ["DualPipeSchedule", "build_dualpipe"]


class DualPipeSchedule(VSchedule):
    """Two pipelines of p stages, one per direction; rank r runs stage r of the first (chunk 0)
    and stage p - 1 - r of the second (chunk 1), numbered p + (p - 1 - r) = 2 p - 1 - r."""

    def ends(self, stage: int) -> tuple[bool, bool]:
        return stage % self.pp == 0, stage % self.pp == self.pp - 1

    def model_stage(self, stage: int) -> int:
        return stage % self.pp

    def chunks_of(self, mb: int) -> tuple:
        return (mb % 2,)  # the even micro-batches go from rank 0, the odd ones from rank p - 1

    def copy_peer(self, rank: int) -> int:
        return self.pp - 1 - rank  # it holds model stages p - 1 - r and r

    def simulate(self, t_f: float = 1.0, t_b: float = 2.0, t_w=None):
        """The ideal timeline, F = ``t_f``, B = ``t_b``, W = ``t_w`` per chunk: a chunk is a whole
        stage, so (the checker counting a chunk 1 / virtual of a stage) each time is doubled."""
        return check.simulate(self, 2 * t_f, 2 * t_b, None if t_w is None else 2 * t_w)

    def sum_copies(self, stages, group=None, tied_group=None) -> None:
        """After the step (the executor calls it), each gradient plus that of the same weight's
        other copy, on rank p - 1 - r (which holds the same two model stages): both ranks then hold
        the sum, bit for bit the same (a + b = b + a), so both copies step alike."""
        if tied_group is not None:
            raise ValueError("under 'dualpipe' ranks 0 and p - 1 each hold the embedding and the head: the "
                             "tied weight is one parameter there, summed with its copy by sum_copies; pass "
                             "tied_group=None")
        rank = dist.get_rank(group) if self.pp > 1 else 0
        peer = self.copy_peer(rank)
        # both ranks walk the same two model stages in the model's order, each weight once (tied: once)
        chunks = sorted(range(2), key=lambda c: self.model_stage(self.stage(rank, c)))
        params = list({id(p): p for c in chunks for p in stages[c].parameters() if p.requires_grad}.values())
        if not params:
            return
        total = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        comms.sum_with_peer(total, peer, group)  # mine + theirs, on both ranks
        at = 0
        for p in params:
            piece = total[at:at + p.numel()].view_as(p)
            at += p.numel()
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)


def _dualpipe_order(pp: int, m: int, rank: int) -> list[tuple]:
    """DualPipe on rank ``rank``: DualPipeV's order on pp / 2 ranks and m / 2 micro-batches at the
    rank's place from its nearer end; each phase turned into its direction (the chunk), the
    k-th micro-batch of direction d numbered 2 k + d."""
    half = build_dualpipev(pp // 2, m // 2).actions(min(rank, pp - 1 - rank))
    second_half = rank >= pp // 2
    return [(a.op, 2 * a.mb + (a.chunk ^ second_half), a.chunk ^ second_half) for a in half if not a.is_comm]


def build_dualpipe(pp: int, m: int, virtual: int = 2) -> DualPipeSchedule:
    """DualPipe for ``pp`` ranks (even) and ``m`` micro-batches (even, at least 2 pp), two chunks
    per rank, one per direction; not yet validated."""
    if isinstance(pp, int) and isinstance(m, int) and (pp % 2 or m % 2 or m < 2 * pp):
        raise ValueError(f"'dualpipe' feeds half the micro-batches from each end of the pipeline: it "
                         f"needs an even pp and an even m >= 2 pp (DualPipe's own asserts), got pp={pp}, m={m}")
    return build_from_orders(DualPipeSchedule, "dualpipe", pp, m, virtual, 2, _dualpipe_order)

