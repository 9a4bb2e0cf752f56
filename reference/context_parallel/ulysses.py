"""DeepSpeed-Ulysses: trade the sequence split for a head split, attend, trade back.

    out = ulysses_attention(q, k, v, cp_group)   # q, k, v: (B, H, T/cp, D), this rank's tokens

Jacobs et al., 2023 ("DeepSpeed Ulysses"). Attention mixes tokens but not heads, so a rank that
holds *every* token of some heads can run ordinary attention on them. One all-to-all turns the
sequence split into a head split::

    (B, H, T/cp, D)  --all-to-all-->  (B, H/cp, T, D)
    rank r sends heads [d H/cp, (d+1) H/cp) of its T/cp tokens to rank d, and
    receives its own H/cp heads of every rank's tokens.

q, k and v each take one all-to-all, `scaled_dot_product_attention` runs on the whole sequence
of H/cp heads, and a fourth all-to-all turns the output back; backward moves the four tensors'
gradients with the inverse all-to-alls. Each all-to-all keeps 1/cp of its input and sends the
rest: 4 (cp - 1)/cp of q's size each way, falling with cp (`cost`). But cp must divide the
heads (H, and H_kv under grouped-query attention), and the attention of H/cp heads on all T
tokens holds a (T, T) score matrix per local head. Under the zig-zag layout the gathered
sequence arrives in rank order (chunks 0, 2cp-1, 1, 2cp-2, ...): it is permuted to position
order before the causal attention and back after, without communication.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.context_parallel.layout import gather_order
from reference.context_parallel.ring import check_attention_inputs
from reference.comms.functional import all_to_all

__all__ = ["ulysses_attention", "sequence_to_heads", "heads_to_sequence", "check_heads"]


def check_heads(n_head: int, cp: int) -> None:
    """Ulysses gives each rank n_head / cp whole heads."""
    if n_head % cp:
        raise ValueError(f"Ulysses splits the heads over the cp group: n_head={n_head} heads must "
                         f"divide by cp={cp} (n_head % cp = {n_head % cp})")


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, T/cp, D) this rank's tokens -> (B, H/cp, T, D) this rank's heads, tokens in rank order."""
    cp = dist.get_world_size(group)
    B, H, n, D = x.shape
    check_heads(H, cp)
    rows = x.reshape(B, cp, H // cp, n, D).transpose(0, 1)  # (cp, B, H/cp, n, D): row d goes to rank d
    got = all_to_all(rows.contiguous(), [1] * cp, [1] * cp, group)  # row s: rank s's tokens, my heads
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * n, D)  # (B, H/cp, T, D)


def heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """(B, H/cp, T, D) this rank's heads -> (B, H, T/cp, D) this rank's tokens: the inverse."""
    cp = dist.get_world_size(group)
    B, h, T, D = y.shape
    rows = y.reshape(B, h, cp, T // cp, D).permute(2, 0, 1, 3, 4)  # (cp, B, H/cp, n, D): rank d's tokens
    got = all_to_all(rows.contiguous(), [1] * cp, [1] * cp, group)  # row s: my tokens, rank s's heads
    return got.transpose(0, 1).reshape(B, cp * h, T // cp, D)  # (B, H, n, D)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                      zigzag: bool = False, dropout_p: float = 0.0,
                      scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the whole sequence, each rank holding T/cp of it.

    q, k, v: (B, H, T/cp, D), this rank's tokens in the contiguous (Ulysses' own) or the zig-zag
    layout; k and v may have H_kv heads dividing H (grouped-query attention); H and H_kv must divide
    by cp. ``dropout_p`` is the attention dropout (0 in eval). Returns (B, H, T/cp, D).
    """
    cp, n = check_attention_inputs(q, k, v, "ulysses_attention", group, zigzag), q.shape[-2]
    check_heads(q.shape[1], cp)
    check_heads(k.shape[1], cp)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    qh, kh, vh = (sequence_to_heads(t, group) for t in (q, k, v))  # each (B, H/cp, T, D)
    order = None
    if zigzag and cp > 1:
        order = gather_order(n * cp, cp, zigzag=True).to(q.device)  # row -> position
        to_positions = torch.argsort(order)
        qh, kh, vh = (t.index_select(2, to_positions) for t in (qh, kh, vh))  # position order
    y = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                       enable_gqa=kh.shape[1] != qh.shape[1])  # (B, H/cp, T, D)
    if order is not None:
        y = y.index_select(2, order)  # back to rank order
    return heads_to_sequence(y, group)  # (B, H, T/cp, D)
