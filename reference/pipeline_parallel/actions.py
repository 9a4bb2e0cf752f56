"""The vocabulary of pipeline schedules: the actions a rank can take, and the error a wrong
schedule raises. Shared by the schedules, the checker and the executor.

Compute: F (forward), B (the full backward), and B's halves that zero-bubble schedules run
apart: I, the gradient of the stage's input, and W, the weights'. The letters are
torch.distributed.pipelining's (``_ComputationType``). Messages: the four SEND/RECV. A trace
(never a schedule) also holds A2A_F and A2A_B: an expert all-to-all of a forward or a backward in
flight inside DualPipe's overlapped F&B pair (`overlap`), from its issue to its end.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["Action", "ScheduleError", "COMPUTE", "COMM", "IN_FLIGHT", "OPS"]

COMPUTE = ("F", "B", "I", "W")
COMM = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")
IN_FLIGHT = ("A2A_F", "A2A_B")  # a trace's only, never a schedule's: an overlapped pair's all-to-all
OPS = COMPUTE + COMM + IN_FLIGHT  # what a trace's events may be; a schedule's: COMPUTE + COMM


class ScheduleError(ValueError):
    """A schedule is incomplete, inconsistent or deadlocks; the message names the rank and action."""


class Action(NamedTuple):
    """One thing a rank does: ``op`` on micro-batch ``mb`` of its chunk ``chunk``; ``peer`` the rank at
    the other end of a SEND/RECV (None for compute)."""

    op: str
    mb: int
    chunk: int = 0
    peer: Optional[int] = None

    @property
    def is_comm(self) -> bool:
        return self.op in COMM

    def __str__(self) -> str:
        text = f"{self.op}{self.mb}" + (f".c{self.chunk}" if self.chunk else "")
        if self.peer is not None:
            text += f"{'->' if self.op.startswith('SEND') else '<-'}{self.peer}"
        return text

    __repr__ = __str__
