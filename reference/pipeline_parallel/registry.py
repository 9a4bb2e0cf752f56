"""Every pipeline schedule by its name: one table, `BUILDERS`, and `build_schedule` that reads it.

The table names each kind's builder where it is written: the textbook schedules (naive, GPipe,
1F1B, interleaved) in `reference.pipeline_parallel.schedules`, the zero-bubble ones (ZB-H1,
ZB-H2, ZB-V, DualPipeV) in `reference.pipeline_parallel.zero_bubble`, which builds on the first,
and DualPipe in two directions in `reference.pipeline_parallel.dualpipe`, built on DualPipeV.
A reader follows the kind they build and opens only its module. Each builder takes
``(pp, m, virtual)`` and returns its schedule not yet validated; `build_schedule` validates it.
"""
from __future__ import annotations

from reference.pipeline_parallel import dualpipe, schedules, zero_bubble
from reference.pipeline_parallel.schedules import Schedule

__all__ = ["BUILDERS", "build_schedule"]

BUILDERS = {"naive": schedules.build_naive, "gpipe": schedules.build_gpipe, "1f1b": schedules.build_1f1b,
            "interleaved": schedules.build_interleaved, "zb-h1": zero_bubble.build_zb_h1,
            "zb-h2": zero_bubble.build_zb_h2, "zb-v": zero_bubble.build_zb_v,
            "dualpipev": zero_bubble.build_dualpipev, "dualpipe": dualpipe.build_dualpipe}


def build_schedule(kind: str, pp: int, m: int, virtual: int = 1) -> Schedule:
    """The ``kind`` schedule for ``pp`` ranks and ``m`` micro-batches, validated.

    Args:
        kind: one of `BUILDERS`: "naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2",
            "zb-v", "dualpipev", "dualpipe".
        pp: pipeline ranks.
        m: micro-batches per step.
        virtual: chunks per rank: 1, or at least 2 for "interleaved", 2 for the V's ("zb-v",
            "dualpipev") and for "dualpipe" (a chunk per direction).
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {', '.join(BUILDERS)}")
    return BUILDERS[kind](pp, m, virtual).validate()
