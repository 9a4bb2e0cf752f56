"""The executor's point-to-point messages: what waits to be sent, what arrived, and their sizes.

Each run of SEND/RECV actions is one ``batch_isend_irecv``, waited on together and recorded in
the open communication meters. A receive needs a buffer of the right shape and dtype, which is
not assumed ((B / m, T / tp, C) under sequence parallelism, bf16 under autocast): the first
activation each chunk sends (micro-batch 0's, or DualPipe's first of its direction) is preceded by a handshake of 8 integers (dtype, dims, sizes) that sizes
every activation of that chunk, and a gradient coming back has the shape of the activation sent.
The handshake goes right before its activation on both sides, so messages between two ranks stay
matched in the schedule's order.
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
        self.described: set = set()  # chunks whose activations' handshake has been sent

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
        """Run one step of SEND/RECV actions: every send posted at once, then the receives in order,
        a handshake received and waited for (its sender posts it with its sends) before the buffers
        it sizes."""
        works, sends = [], []
        for a in step:
            if a.op.startswith("SEND"):
                t = self.outbox.pop((a.op[-1], a.mb, a.chunk)).contiguous()
                if a.op == "SEND_F" and a.chunk not in self.described:
                    self.described.add(a.chunk)
                    sends.append(self._p2p(dist.isend, _encode_meta(t), a.peer, "send_meta"))
                sends.append(self._p2p(dist.isend, t, a.peer, "send"))
        if sends:
            works += self.waited(dist.batch_isend_irecv(sends))
        recvs = []
        for a in [a for a in step if a.op.startswith("RECV")]:
            if a.op == "RECV_F" and a.chunk not in self.incoming:  # the chunk's first: the handshake
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
