"""One block of ring attention: which (query, key) rows meet, and the math on them.

Ring attention (Liu et al., 2023, "Ring Attention with Blockwise Transformers") computes
softmax(Q K^T / sqrt(d)) V for this rank's queries one key/value block at a time, the blockwise
attention of FlashAttention (Dao et al., 2022). This module is the single-process part.

At ring step s rank i holds the key/value block of rank j = (i - s) mod cp, and
`block_plan(i, j, cp, n, causal, zigzag)` says which of its n query and n key rows meet:

* not causal: every query meets every key, (n, n), no mask;
* causal, contiguous split: j < i all of them (earlier tokens), j == i the lower triangle,
  j > i nothing (later tokens): the work grows with i;
* causal, zig-zag split (rank r holds chunks r and 2 cp - 1 - r, c = n / 2 rows each): j == i
  the lower triangle of (n, n); j < i every query meets the *first* half of the keys (chunk j
  precedes both query chunks, chunk 2 cp - 1 - j follows both): (n, c); j > i the *second*
  half of the queries (chunk 2 cp - 1 - i) meets every key: (c, n). Every rank computes the
  same pairs, and no step multiplies a block that the mask would empty.

`attend_block`: S = q k^T * scale on the planned rows (the triangle masked to -inf), the block's
log-sum-exp L_b = log sum_k e^S (torch.logsumexp subtracts the row's max: the online softmax's
running max) and its output O_b = softmax(S) v. `merge_block` folds it into the running (O, L)::

    L_new = log(e^L + e^L_b)            (logaddexp: max + log1p(e^-|L - L_b|))
    O_new = O e^(L - L_new) + O_b e^(L_b - L_new)

so after the last block O is the softmax over every key. `attend_block_backward`
(FlashAttention-2's recomputation) recomputes P = e^(S - L) from q, k, v, the final L and
Delta = rowsum(dO * O): dV = P^T dO, dP = dO v^T, dS = P * (dP - Delta), dQ = dS k * scale,
dK = dS^T q * scale. Either direction holds at most one (T/cp, T/cp) score block per head.

The arithmetic runs in float32 whatever the inputs' dtype (a bf16 softmax's running max and
sums would lose too much). Under grouped-query attention (H_kv < H key/value heads, each serving
H / H_kv consecutive query heads) a block repeats k and v to q's heads for its arithmetic only
and sums dk, dv back over each group: what travels stays (B, H_kv, n, D).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["BlockPlan", "block_plan", "attend_block", "merge_block", "attend_block_backward"]


class BlockPlan(NamedTuple):
    """The query rows and key rows that meet at one ring step, and whether the triangle applies."""

    q_rows: slice
    k_rows: slice
    triangle: bool  # the causal lower triangle inside this rank's own block

    def pairs(self, n: int) -> int:
        """(query, key) pairs this step keeps (the triangle counted with its diagonal)."""
        rows = len(range(n)[self.q_rows])
        return rows * (rows + 1) // 2 if self.triangle else self.block_elements(n)

    def block_elements(self, n: int) -> int:
        """Entries of the score block the step multiplies out (the triangle's block is full)."""
        return len(range(n)[self.q_rows]) * len(range(n)[self.k_rows])


def block_plan(i: int, j: int, cp: int, n: int, causal: bool, zigzag: bool) -> Optional[BlockPlan]:
    """What rank i computes with rank j's keys (n tokens per rank); None when nothing (see above)."""
    every = slice(0, n)
    if not causal:
        return BlockPlan(every, every, False)
    if j == i:
        return BlockPlan(every, every, True)
    if not zigzag:
        return BlockPlan(every, every, False) if j < i else None
    c = n // 2
    if j < i:
        return BlockPlan(every, slice(0, c), False)  # (n, c): all queries, keys of chunk j
    return BlockPlan(slice(c, n), every, False)  # (c, n): queries of chunk 2cp-1-i, all keys


def _to_query_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, H_kv, tk, D) -> (B, H, tk, D): each key/value head repeated for its query heads (GQA)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _to_kv_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, tk, D) -> (B, H_kv, tk, D): a gradient summed over each group of query heads."""
    B, H, tk, D = t.shape
    return t if H == kv_heads else t.view(B, kv_heads, H // kv_heads, tk, D).sum(2)


def fp32_math(t: torch.Tensor):
    """Autocast switched off, so the block math stays in float32 inside a bf16 or fp16 training step."""
    return torch.autocast(t.device.type, enabled=False)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, triangle: bool) -> torch.Tensor:
    """S = q k^T * scale in float32, (B, H, tq, tk), the upper triangle -inf when asked."""
    k = _to_query_heads(k, q.shape[1])
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # (B, H, tq, tk)
    if triangle:
        tq, tk = s.shape[-2:]
        upper = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1)  # key after query
        s = s.masked_fill(upper, float("-inf"))
    return s


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 triangle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's normalised output and log-sum-exp: (B, H, tq, D), (B, H, tq), float32."""
    with fp32_math(q):
        s = _scores(q, k, scale, triangle)  # (B, H, tq, tk): the one (T/cp)^2-sized tensor
        lse = torch.logsumexp(s, dim=-1)  # (B, H, tq); every planned row meets at least one key
        p = torch.exp(s - lse.unsqueeze(-1))  # softmax over this block's keys
        return torch.matmul(p, _to_query_heads(v, q.shape[1]).float()), lse  # (B, H, tq, D)


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                block_lse: torch.Tensor) -> None:
    """Fold a block into the running (out (B, H, tq, D), lse (B, H, tq)), in place (online softmax)."""
    new = torch.logaddexp(lse, block_lse)  # (B, H, tq)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def attend_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                          lse: torch.Tensor, delta: torch.Tensor, scale: float,
                          triangle: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dq (B, H, tq, D) and its dk, dv (B, H_kv, tk, D), float32; `lse`, `delta`
    (B, H, tq) are the queries' *final* ones, so P = e^(S - lse) is the block's part of the full softmax."""
    with fp32_math(q):
        s = _scores(q, k, scale, triangle)  # (B, H, tq, tk), recomputed rather than stored
        p = torch.exp(s - lse.unsqueeze(-1))  # masked entries: e^-inf = 0
        dout = dout.float()
        kv_heads, heads = k.shape[1], q.shape[1]
        dv = torch.matmul(p.transpose(-2, -1), dout)  # (B, H, tk, D)
        dp = torch.matmul(dout, _to_query_heads(v, heads).float().transpose(-2, -1))  # (B, H, tq, tk)
        ds = p * (dp - delta.unsqueeze(-1))  # the softmax's Jacobian, row by row
        dq = torch.matmul(ds, _to_query_heads(k, heads).float()) * scale  # (B, H, tq, D)
        dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale  # (B, H, tk, D)
        return dq, _to_kv_heads(dk, kv_heads), _to_kv_heads(dv, kv_heads)  # (B, H_kv, tk, D) each
