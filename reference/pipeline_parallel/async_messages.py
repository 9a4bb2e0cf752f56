"""The zero-bubble schedules' messages: sends waited for at the end, and the V's turn in memory.

`AsyncMailbox` is the executor's `Mailbox` with two differences:

* a step waits only for its receives; the sends are waited for once, after the last step
  (`finish`), so a rank goes on to its W's while its message travels (`ZeroBubbleSchedule`);
* a message from a rank to itself (ZB-V's turn: the last rank holds stages p - 1 and p) is
  handed over in memory as a copy, first sent first received, without ``torch.distributed``.
"""
from __future__ import annotations

from reference.pipeline_parallel.messages import Mailbox

__all__ = ["AsyncMailbox"]


class AsyncMailbox(Mailbox):
    """A `Mailbox` whose sends are waited for in `finish`, and whose messages to itself are handed over."""

    def __init__(self, group, rank: int, device):
        super().__init__(group, rank, device)
        self.to_self: list = []   # messages this rank sent to itself, not yet received
        self.sending: list = []   # send works not waited for yet

    def waited(self, sends: list) -> list:
        self.sending += sends
        return []

    def finish(self) -> None:
        for work in self.sending:
            work.wait()
        self.sending = []

    def exchange(self, step) -> None:
        """The step's messages to this rank itself handed over, the others exchanged."""
        for a in step:
            if a.peer == self.rank and a.op.startswith("SEND"):
                self.to_self.append(self.outbox.pop((a.op[-1], a.mb, a.chunk)).clone())
        for a in step:
            if a.peer == self.rank and a.op.startswith("RECV"):
                self.arrived[(a.op[-1], a.mb, a.chunk)] = self.to_self.pop(0)
        super().exchange([a for a in step if a.peer != self.rank])
