"""What context parallelism costs each rank: bytes sent, memory held, attention work.

The formulas the course teaches, each checked exactly against a measurement in the tests.
B batch, H heads, T tokens, D head width, cp ranks, n = T / cp tokens per rank, b bytes per element.

Bytes each rank sends for one attention, forward and backward
--------------------------------------------------------------
    ring     forward   2 (cp - 1) blocks of (B, H, n, D): K and V at each of cp - 1 steps
             backward  2 (cp - 1) blocks (K and V again) + 2 (cp - 1) gradient blocks
                       (dK, dV accumulators, float32)
    Ulysses  forward   4 all-to-alls (q, k, v in, output back), each (cp - 1)/cp of B H n D b
             backward  the same 4, inverted

Over a training step (forward + backward) the ring sends 2 (cp - 1) blocks of b bytes twice
and 2 (cp - 1) float32 gradient blocks, Ulysses 8 (cp - 1)/cp blocks of b bytes: in bf16
(b = 2) the ring sends cp times Ulysses' bytes, in float32 3 cp / 4 times; forward only,
cp / 2 times.

Grouped-query attention (``kv_heads`` = H_kv < H key/value heads, each shared by H / H_kv
query heads): the ring's blocks are (B, H_kv, n, D), so all its bytes scale by H_kv / H;
Ulysses' k and v all-to-alls scale by H_kv / H too, but q's and the output's do not:
(2 H + 2 H_kv) (cp - 1)/cp B n D b each way. Llama-3-70B (H = 64, H_kv = 8) on cp = 8 in
the forward: the ring 2 x 7 x 8 = 112 units of B n D b, Ulysses 144 x 7/8 = 126.

Memory: ring attention saves q, k, v (b bytes each), its float32 output and the log-sum-exp
(B, H, n), linear in n; its largest tensor is one (B, H, n, n) score block, T^2 / cp^2 per
head. Ulysses saves what its attention saves on (B, H/cp, T, D): with the math kernel the
(T, T) probabilities of its H/cp heads, T^2 / cp per head of the model.

Work (causal (query, key) pairs, keys at or before the query)
-------------------------------------------------------------
    contiguous split  rank r: r n^2 + n (n + 1) / 2, from n (n + 1) / 2 on rank 0 to
                      (cp - 1) n^2 + n (n + 1) / 2 on rank cp - 1: about 2 cp - 1 times more
    zig-zag split     every rank: 2 c^2 cp + c with c = T / (2 cp), the same on all
"""
from __future__ import annotations

from reference.context_parallel.blocks import block_plan
from reference.context_parallel.layout import check_sequence_split

__all__ = ["ring_attention_sent_bytes", "ulysses_sent_bytes", "ring_attention_saved_bytes",
           "score_block_elements", "causal_pairs_per_rank", "ring_pairs_per_rank",
           "ring_block_elements_per_rank"]


def _block(B: int, H: int, T: int, D: int, cp: int) -> int:
    """Elements of one rank's (B, H, T/cp, D) block."""
    return B * H * (T // cp) * D


def ring_attention_sent_bytes(B: int, H: int, T: int, D: int, cp: int, element_size: int = 4,
                              grad_element_size: int = 4, kv_heads: int | None = None) -> dict[str, int]:
    """{"forward", "backward"}: bytes one rank sends in `ring_attention` (formula above);
    ``kv_heads`` the key/value heads under grouped-query attention (default H)."""
    block = _block(B, H if kv_heads is None else kv_heads, T, D, cp)
    forward = (cp - 1) * 2 * block * element_size  # K and V blocks
    backward = forward + (cp - 1) * 2 * block * grad_element_size  # K, V again + dK, dV
    return {"forward": forward, "backward": backward}


def ulysses_sent_bytes(B: int, H: int, T: int, D: int, cp: int, element_size: int = 4,
                       kv_heads: int | None = None) -> dict[str, int]:
    """{"forward", "backward"}: bytes one rank sends in `ulysses_attention` (formula above);
    ``kv_heads`` the key/value heads under grouped-query attention (default H)."""
    kv = H if kv_heads is None else kv_heads
    heads = 2 * H + 2 * kv  # q and the output: H heads each; k and v: H_kv each
    per_direction = (cp - 1) * _block(B, heads, T, D, cp) * element_size // cp  # each keeps 1/cp
    return {"forward": per_direction, "backward": per_direction}


def ring_attention_saved_bytes(B: int, H: int, T: int, D: int, cp: int, element_size: int = 4) -> int:
    """Bytes `ring_attention` saves for backward: q, k, v (three tensors, or one fused projection of
    the same size), the float32 output and log-sum-exp."""
    block = _block(B, H, T, D, cp)
    return 3 * block * element_size + block * 4 + B * H * (T // cp) * 4


def score_block_elements(B: int, H: int, T: int, cp: int) -> int:
    """Elements of the largest tensor ring attention creates: one (B, H, T/cp, T/cp) score block."""
    return B * H * (T // cp) ** 2


def causal_pairs_per_rank(T: int, cp: int, zigzag: bool = True) -> list[int]:
    """Causal (query, key) pairs each rank's queries have (per batch row and head), closed form."""
    n = check_sequence_split(T, cp, zigzag)
    if not zigzag:
        return [r * n * n + n * (n + 1) // 2 for r in range(cp)]
    c = T // (2 * cp)
    return [2 * c * c * cp + c] * cp


def _over_plans(T: int, cp: int, causal: bool, zigzag: bool, what: str) -> list[int]:
    n = check_sequence_split(T, cp, zigzag)
    counts = []
    for i in range(cp):
        plans = [block_plan(i, (i - s) % cp, cp, n, causal, zigzag) for s in range(cp)]
        counts.append(sum(getattr(p, what)(n) for p in plans if p is not None))
    return counts


def ring_pairs_per_rank(T: int, cp: int, causal: bool = True, zigzag: bool = True) -> list[int]:
    """(query, key) pairs ring attention's blocks keep on each rank (per batch row and head)."""
    return _over_plans(T, cp, causal, zigzag, "pairs")


def ring_block_elements_per_rank(T: int, cp: int, causal: bool = True, zigzag: bool = True) -> list[int]:
    """Score entries ring attention multiplies out on each rank (the triangle's block counted whole)."""
    return _over_plans(T, cp, causal, zigzag, "block_elements")
