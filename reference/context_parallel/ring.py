"""Ring attention: the key/value blocks travel around the cp group, the queries stay.

    out = ring_attention(q, k, v, cp_group)   # q, k, v: (B, H, T/cp, D), this rank's tokens

The ranks stand on a ring in group-rank order. At step s = 0 .. cp-1 rank i attends its
queries to the key/value block of rank (i - s) mod cp, received at the step before, and folds
the result into a running output with the online softmax (`blocks`). Before computing on a
block it has posted, in one ``batch_isend_irecv``, the send of that block to the next rank and
the receive of the following one from the previous rank: the transfer overlaps the computation.

Backward walks the same ring. The key/value blocks travel again, and with block j travels the
gradient (dK_j, dV_j) that the ranks it has visited owe it: rank i adds its share and passes the
sum on, overlapped the same way. The accumulator of block j starts at rank j + 1 (rank j keeps
its own share), visits every other rank, and its last hop brings it home. Nothing of size T x T
is ever held: one score block of at most (T/cp) x (T/cp) per head, recomputed in backward.

The bytes each rank sends, 2 (cp - 1) blocks forward and 4 (cp - 1) backward, are in `cost`
(inputs of another dtype than float32 send that dtype's blocks and float32 gradient
accumulators). Every message is recorded in the open `reference.comms` meters as "send" (bytes
sent) and "recv" (0 sent).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from reference import comms
from reference.context_parallel.blocks import attend_block, attend_block_backward, block_plan, merge_block

__all__ = ["ring_attention", "check_attention_inputs"]

_KV_TAG, _GRAD_TAG = 0, 1  # two streams of messages between the same neighbours


class _Ring:
    """This rank's place on the cp ring and the messages to its neighbours."""

    def __init__(self, group) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def pass_on(self, send: torch.Tensor, tag: int):
        """Post the send of `send` to next and the receive of a block of its shape from prev;
        return a function that waits for both and gives the block received."""
        recv = torch.empty_like(send)
        nbytes = send.numel() * send.element_size()
        comms.record("send", self.group, nbytes, nbytes)
        comms.record("recv", self.group, nbytes, 0)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
            dist.P2POp(dist.irecv, recv, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag)])

        def received() -> torch.Tensor:
            for work in works:
                work.wait()
            return recv
        received.sending = send  # the tensor being sent stays alive until its message is out
        return received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, zigzag, scale):
        ring = _Ring(group)
        cp, i, n = ring.size, ring.rank, q.shape[-2]
        out = q.new_zeros(q.shape, dtype=torch.float32)  # (B, H, n, D): running output
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)  # (B, H, n)
        kv = torch.stack([k, v])  # (2, B, H, n, D): one message per step
        for s in range(cp):
            # Post the next block's transfer first: it overlaps this block's math.
            next_kv = ring.pass_on(kv, _KV_TAG) if s < cp - 1 else None
            plan = block_plan(i, (i - s) % cp, cp, n, causal, zigzag)
            if plan is not None:
                qs, ks = plan.q_rows, plan.k_rows
                block_out, block_lse = attend_block(q[..., qs, :], kv[0, ..., ks, :], kv[1, ..., ks, :],
                                                    scale, plan.triangle)
                merge_block(out[..., qs, :], lse[..., qs], block_out, block_lse)
            kv = next_kv() if next_kv else kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.zigzag, ctx.scale = group, causal, zigzag, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, i, n = ring.size, ring.rank, q.shape[-2]
        delta = (dout.float() * out).sum(-1)  # (B, H, n): rowsum(dO * O), FlashAttention-2's D
        dq = torch.zeros_like(out)  # (B, H, n, D) float32
        own = q.new_zeros((2,) + tuple(k.shape), dtype=torch.float32)  # (2, B, H, n, D): dK, dV of my block
        kv = torch.stack([k, v])  # (2, B, H, n, D)
        owed = None  # the accumulator exchange in flight
        for s in range(cp):
            j = (i - s) % cp
            next_kv = ring.pass_on(kv, _KV_TAG) if s < cp - 1 else None
            share = own if s == 0 else torch.zeros_like(own)  # this rank's share of (dK_j, dV_j)
            plan = block_plan(i, j, cp, n, ctx.causal, ctx.zigzag)
            if plan is not None:
                qs, ks = plan.q_rows, plan.k_rows
                dq_b, dk_b, dv_b = attend_block_backward(
                    q[..., qs, :], kv[0, ..., ks, :], kv[1, ..., ks, :], dout[..., qs, :],
                    lse[..., qs], delta[..., qs], ctx.scale, plan.triangle)
                dq[..., qs, :] += dq_b
                share[0, ..., ks, :] += dk_b
                share[1, ..., ks, :] += dv_b
            if s > 1:  # what ranks j+1 .. i-1 owe block j arrived from prev (none yet at s = 1)
                share += owed()
            if s > 0:
                # Pass block j's accumulator on (home to rank j at s = cp-1) and receive
                # the one for the next step's block (at s = cp-1: what the others owe mine).
                owed = ring.pass_on(share, _GRAD_TAG)
            kv = next_kv() if next_kv else kv
        if cp > 1:
            own += owed()
        return (dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str,
                           group=None, zigzag: bool = False) -> int:
    """q, k, v must be (B, H, T_local, D) tensors of one shape, dtype and device; k and v may
    have fewer heads H_kv than q when H_kv divides H (grouped-query attention). With
    ``zigzag`` T_local must be even (T divisible by 2 cp). Returns cp, the size of `group`."""
    if q.dim() != 4:
        raise ValueError(f"{what} wants q, k, v of shape (B, H, T/cp, D); got q of shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        grouped = (t.dim() == 4 and t.shape[0] == q.shape[0] and t.shape[2:] == q.shape[2:]
                   and q.shape[1] % t.shape[1] == 0 and t.shape == k.shape)
        if not grouped or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{what} wants q, k, v of one shape, dtype and device; got q "
                             f"{tuple(q.shape)} {q.dtype} {q.device} and {name} {tuple(t.shape)} "
                             f"{t.dtype} {t.device} (k and v may have fewer heads than q when "
                             f"they divide its heads: grouped-query attention)")
    cp, n = dist.get_world_size(group), q.shape[-2]
    if zigzag and n % 2:
        raise ValueError(f"{what} with the zig-zag split needs T divisible by 2*cp: "
                         f"T={n * cp} (T/cp={n} tokens on each of cp={cp} ranks) is not; "
                         f"split the sequence with split_sequence, which refuses such T")
    return cp


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   zigzag: bool = True, scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the whole sequence, each rank holding T/cp of it.

    q, k, v: (B, H, T/cp, D), this rank's tokens in the zig-zag or (``zigzag=False``) the
    contiguous split of `reference.context_parallel.layout`. k and v may have H_kv heads
    dividing H (grouped-query attention). ``causal``: position p attends to positions <= p.
    ``scale`` defaults to 1 / sqrt(D). Returns this rank's rows of the output, (B, H, T/cp, D).
    Every rank of `group` must call it."""
    check_attention_inputs(q, k, v, "ring_attention", group, zigzag=causal and zigzag)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, bool(causal), bool(zigzag), scale)
