"""The executor's point-to-point messages: what waits to be sent, what arrived, and their sizes.

A pipeline message is an activation going down (F) or its gradient coming back
(B). Each run of SEND/RECV actions of a schedule is one ``batch_isend_irecv``
holding all of them, waited on together, and every message is recorded in the
open communication meters as a "send" or "recv" on the pipeline group.

A receive needs a buffer of the right shape and dtype before the message
arrives. Neither is assumed: (B / m, T, C) for a plain GPT, (B / m, T / tp, C)
under sequence parallelism, bf16 when a stage computes under autocast and hands
on bf16. Instead micro-batch 0's activation of each chunk is preceded by a
handshake, 8 integers (dtype, number of dims, sizes; "send_meta" / "recv_meta"
in the meters); the receiver sizes every activation of that chunk from it (all
micro-batches have the same shape). A gradient coming back has the shape and
dtype of the activation this rank sent, which it remembers.

Between two ranks, messages are matched in the order they are posted. The
handshake goes right before its activation on both sides, so the order of the
messages is the schedule's, as without it. Each step waits for its sends too; the
zero-bubble schedules' mailbox (`reference.pipeline_parallel.async_messages`) waits for
them only at the end (`finish`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.comms.metering import record

__all__ = ["Mailbox"]

# The handshake: [dtype code, number of dims, size of each dim, zeros], int64.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_META_LEN = 8


def _encode_meta(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES or t.dim() > _META_LEN - 2:
        raise ValueError(f"a pipeline message must be one of {_DTYPES} with at most "
                         f"{_META_LEN - 2} dims, got {t.dtype} of shape {tuple(t.shape)}")
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_META_LEN - 2 - t.dim())],
                        dtype=torch.int64, device=t.device)


class Mailbox:
    """One rank's messages in one `run_pipeline`, keyed by (op "F" or "B", micro-batch, chunk)."""

    def __init__(self, group, rank: int, device: torch.device):
        self.group, self.rank, self.device = group, rank, device
        self.outbox: dict = {}    # key -> tensor waiting to be sent
        self.arrived: dict = {}   # key -> received activation ("F") or output gradient ("B")
        self.sent: dict = {}      # (mb, chunk) -> (shape, dtype) of the activation sent on
        self.incoming: dict = {}  # chunk -> (shape, dtype) of its activations, from the handshake

    def post(self, op: str, mb: int, chunk: int, t: torch.Tensor) -> None:
        """Leave `t` to be sent by the schedule's SEND action for (op, mb, chunk)."""
        self.outbox[(op, mb, chunk)] = t
        if op == "F":
            self.sent[(mb, chunk)] = (t.shape, t.dtype)  # and so of the gradient that comes back

    def take(self, op: str, mb: int, chunk: int) -> torch.Tensor:
        return self.arrived.pop((op, mb, chunk))

    def _p2p(self, op, t, peer, what: str) -> "dist.P2POp":
        nbytes = t.numel() * t.element_size()
        record(what, self.group, nbytes, nbytes if op is dist.isend else 0)
        return dist.P2POp(op, t, group=self.group, group_peer=peer)

    def waited(self, sends: list) -> list:
        """Which of a step's send works the step waits for: all of them, here."""
        return sends

    def finish(self) -> None:
        """Wait for what is still on its way after the last step: nothing, here."""

    def exchange(self, step) -> None:
        """Run one step of SEND/RECV actions, all posted before any is waited on.

        Every send is posted at once, a handshake just before micro-batch 0's
        activation. The receives are posted in the step's order; at a micro-batch
        0 activation the handshake is received first (the only wait inside the
        step: its sender posts it with its sends, whatever it receives), then the
        buffers it sizes. Each peer thus sees the messages in the order it posts
        them, handshakes included."""
        works, sends = [], []
        for a in step:
            if a.op.startswith("SEND"):
                t = self.outbox.pop((a.op[-1], a.mb, a.chunk)).contiguous()
                if a.op == "SEND_F" and a.mb == 0:
                    sends.append(self._p2p(dist.isend, _encode_meta(t), a.peer, "send_meta"))
                sends.append(self._p2p(dist.isend, t, a.peer, "send"))
        if sends:
            works += self.waited(dist.batch_isend_irecv(sends))
        recvs = []
        for a in [a for a in step if a.op.startswith("RECV")]:
            if a.op == "RECV_F" and a.chunk not in self.incoming:
                if a.mb != 0:
                    raise RuntimeError(f"pipeline rank {self.rank} chunk {a.chunk}: {a} comes before "
                                       f"micro-batch 0's activation, which tells its shape and dtype")
                if recvs:
                    works += dist.batch_isend_irecv(recvs)
                    recvs = []
                meta = torch.empty(_META_LEN, dtype=torch.int64, device=self.device)
                for work in dist.batch_isend_irecv([self._p2p(dist.irecv, meta, a.peer, "recv_meta")]):
                    work.wait()
                code, ndim, *sizes = meta.tolist()
                self.incoming[a.chunk] = tuple(sizes[:ndim]), _DTYPES[code]
            # a gradient has the shape and dtype of the activation this rank sent
            shape, dtype = self.sent.pop((a.mb, a.chunk)) if a.op == "RECV_B" else self.incoming[a.chunk]
            t = self.arrived[(a.op[-1], a.mb, a.chunk)] = torch.empty(shape, dtype=dtype, device=self.device)
            recvs.append(self._p2p(dist.irecv, t, a.peer, "recv"))
        if recvs:
            works += dist.batch_isend_irecv(recvs)
        for work in works:
            work.wait()
