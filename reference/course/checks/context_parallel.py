"""Visible self-checks of homework 08 (long sequences): feedback while you work, never the grade.

    check_merge_attention_blocks(merge_attention_blocks)   # one PASS or FAIL line, with a hint
    check_zigzag_mask(zigzag_mask)
    check_causal_ring_attention(causal_ring_attention)     # on 2 and 3 ranks, and a subgroup
    check_ring_forward_bytes(ring_forward_bytes)           # the text's worked values, then the kind

The merge and the mask run on one rank, the ring on 2 and 3 ranks with every collective
switched off and its messages recorded, each on the same kinds of cases as the hidden
checks drawn from a public seed, compared with the float64 merge, the true positions of
the zig-zag layout and causal attention over the whole sequence.
"""
from __future__ import annotations

from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.context_parallel import (
    CAUSAL_RING_ATTENTION, MERGE_ATTENTION_BLOCKS, RING_FORWARD_BYTES, ZIGZAG_MASK,
)

__all__ = ["check_merge_attention_blocks", "check_zigzag_mask", "check_causal_ring_attention",
           "check_ring_forward_bytes"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not the pair": "return a tuple (out, lse)",
    "changed its inputs": "build new tensors (no in-place ops on the arguments)",
    "changed q": "leave q, k and v as they are: stack or clone them before changing anything",
    "NaN": ("a NaN appears: either e^lse over- or underflows (|lse| near 1000: never form "
            "e^lse itself), or a row that met no key (lse -inf) computes -inf - (-inf); look "
            "at the case's name, and at the exercise's last paragraph"),
    "wrong output": ("at step s rank i holds the keys of rank (i - s) % cp; mask them with your "
                     "zigzag_mask and merge the block into the running (out, lse)"),
    "wrong out": ("the merged output is wrong: each block's output must be weighted by its "
                  "share of the total, e^(its lse) over the sum of every block's; reread the "
                  "lecture's merge of two blocks"),
    "wrong lse": "the merged lse is wrong: it is the log of the sum of every block's e^lse",
    "no ValueError": "raise ValueError when T % (2 * cp) != 0 (no padding)",
    "entries wrong": ("rank r holds chunk r then chunk 2*cp-1-r, each of T/(2*cp) tokens; a query "
                      "may attend to a key at the same or an earlier position"),
    "torch.bool": "return a (T/cp, T/cp) torch.bool tensor: query rows, key columns",
    "not allowed": ("build the ring from dist.send/recv or dist.isend/irecv (or "
                    "dist.batch_isend_irecv); no collective"),
    "timed out": ("post the send to the next rank and the receive from the previous one "
                  "together (isend/irecv or batch_isend_irecv): two blocking sends deadlock"),
    "created a tensor": ("never gather every key: attend to one key/value block at a time, then "
                         "pass it on to the next rank"),
    "not a ring": ("send only to the next rank of the group and receive only from the previous "
                   "one, as global ranks: dist.get_global_rank(group, (i + 1) % cp) and (i - 1) % cp"),
    "not part of group": ("peers are global ranks: dist.get_global_rank(group, (i + 1) % cp), not "
                          "(i + 1) % cp, which is a group rank"),
    "elements; the ring needs": "send K and V only (not q), cp - 1 times",
    "send/isend": "the keys and values must travel: with send/recv, isend/irecv or batch_isend_irecv",
    "returned": "check the return value against the contract in the exercise text",
}


def _check(spec, fn, world_sizes, success: str, skip: bool) -> None:
    def attempt():
        for ws in world_sizes:
            reason = run_cases(spec, fn, ws, public_cases(spec, ws), timeout=60.0,
                               hang_hint=_HINTS["timed out"], record_traffic=True)
            if reason[0]:
                return reason
        return ""
    run_visible(spec, fn, attempt, success, _HINTS, skip)


def check_merge_attention_blocks(fn, skip: bool = False) -> None:
    """Visible check of exercise merge_attention_blocks (against the float64 merge)."""
    n = len(public_cases(MERGE_ATTENTION_BLOCKS, 1))
    _check(MERGE_ATTENTION_BLOCKS, fn, (1,), f"equals the attention over every block on {n} cases "
           f"(1 to 5 blocks, float32 and float64, lse near +1000 and -1000, rows that met no "
           f"key of a block or of any)", skip)


def check_zigzag_mask(fn, skip: bool = False) -> None:
    """Visible check of exercise zigzag_mask (every (i, j) of cp = 1 to 4, and the refusals)."""
    _check(ZIGZAG_MASK, fn, (1,), "every block pair's mask is the causal one; uneven T refused", skip)


def check_causal_ring_attention(fn, world_sizes=(2, 3), skip: bool = False) -> None:
    """Visible check of exercise causal_ring_attention on 2 and 3 ranks."""
    sizes = " and ".join(str(w) for w in world_sizes)
    _check(CAUSAL_RING_ATTENTION, fn, world_sizes,
           f"equals causal attention over the whole sequence on {sizes} ranks (on 3, also on "
           f"the subgroup of ranks 1 and 2), as a ring, one block at a time", skip)


def check_ring_forward_bytes(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question ring_forward_bytes: the text's worked value
    (B = 1, T = 64, 8 query heads sharing 2 of width 16, cp = 4, 2 bytes: 6,144 bytes), then
    an int."""
    return check_question(RING_FORWARD_BYTES, fn, {"B": 1, "T": 131_072, "n_heads": 64, "n_kv_heads": 8,
                                            "head_dim": 128, "cp": 8, "bytes_per_element": 2},
                   "int", skip,
                   worked=(Worked({"B": 1, "T": 64, "n_heads": 8, "n_kv_heads": 2, "head_dim": 16,
                                   "cp": 4, "bytes_per_element": 2}, 6_144),))
