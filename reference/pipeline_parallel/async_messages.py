"""The zero-bubble schedules' messages: sends waited for at the end, and the V's turn in memory.

`AsyncMailbox` is the executor's `Mailbox` with two differences, both for the schedules of
`reference.pipeline_parallel.zero_bubble`:

* a step posts its sends and waits only for its receives; the sends are waited for once,
  after the last step (`finish`). A rank goes on to its W's while its activation or
  gradient travels, which is what lets W fill the time a send would otherwise wait for its
  receiver, and ZB-V's two chunks, which send to the same neighbour in both directions,
  cannot wait on each other's sends (the deadlock check lets only a receive wait,
  `Schedule.strict`). A send's tensor stays alive until then (its work holds it);
* a message from a rank to itself (ZB-V's turn: the last rank holds stages p - 1 and p) is
  handed over in memory, first sent first received, as a copy (what a receive would make,
  so its bytes count as a message's do), without ``torch.distributed``.
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
