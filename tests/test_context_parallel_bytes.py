"""Context parallelism measured, not assumed: bytes per rank, memory per rank, work per rank.

Bytes: a `CommMeter` around the forward and another around the backward of ring
attention and of Ulysses, compared exactly with `reference.context_parallel.cost`.
Memory: what autograd saves (`SavedTensorBytes`) and the largest tensor any op
creates (`LargestTensor`), for two sequence lengths: one (T/cp, T/cp) score block
per head, where the single-process attention makes a (T, T) one. Work: the causal
(query, key) pairs of each rank, closed form against a count over the positions,
and the score blocks the ring really multiplies out.
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from reference import comms
from reference.context_parallel import (
    LargestTensor, SavedTensorBytes, causal_pairs_per_rank, ring_attention,
    ring_attention_saved_bytes, ring_attention_sent_bytes, ring_block_elements_per_rank,
    ring_pairs_per_rank, score_block_elements, sequence_positions, split_sequence,
    ulysses_attention, ulysses_sent_bytes,
)
from reference.runtime import launch
from reference.tolerance import forward, gradient

B, H, D = 2, 4, 4  # D small, so that a (T/cp)^2 score block outgrows a (2, T/cp, D) key/value buffer


def test_causal_work_per_rank():
    """Closed forms against a count over each rank's positions; zig-zag balanced, contiguous not."""
    for T, cp in ((8, 2), (16, 4), (48, 3), (64, 4)):
        for zigzag in (True, False):
            # a query at position p has p + 1 causal keys (0 .. p)
            counted = [int((sequence_positions(T, cp, r, zigzag) + 1).sum()) for r in range(cp)]
            assert causal_pairs_per_rank(T, cp, zigzag) == counted, (T, cp, zigzag)
            # the ring's blocks keep exactly the causal pairs: none left out, none twice
            assert ring_pairs_per_rank(T, cp, causal=True, zigzag=zigzag) == counted, (T, cp, zigzag)
        assert len(set(causal_pairs_per_rank(T, cp, zigzag=True))) == 1  # every rank the same
        assert ring_pairs_per_rank(T, cp, causal=False) == [T // cp * T] * cp  # every pair
    # contiguous: rank cp-1 over rank 0 is 1 + 2 (cp - 1) n / (n + 1), towards 2 cp - 1
    for cp in (2, 4, 8):
        n = 1024
        work = causal_pairs_per_rank(n * cp, cp, zigzag=False)
        assert work[-1] / work[0] == pytest.approx(1 + 2 * (cp - 1) * n / (n + 1), rel=1e-12)
        assert work[-1] / work[0] == pytest.approx(2 * cp - 1, rel=2e-3)
    # the score entries the blocks multiply out (the diagonal block whole):
    # zig-zag 2 c^2 (cp + 1) on every rank, contiguous (r + 1) n^2
    T, cp, n, c = 64, 4, 16, 8
    assert ring_block_elements_per_rank(T, cp, zigzag=True) == [2 * c * c * (cp + 1)] * cp
    assert ring_block_elements_per_rank(T, cp, zigzag=False) == [(r + 1) * n * n for r in range(cp)]


class _ScoreBlocks(TorchDispatchMode):
    """Entries of the score blocks (batched matmuls whose last dim is not D) made inside the block."""

    def __init__(self):
        super().__init__()
        self.entries = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bmm.default and out.shape[-1] != D:
            self.entries += out.numel()
        return out


def _dense_attention(q, k, v):
    s = q @ k.transpose(-2, -1) / D ** 0.5  # (B, H, T, T): what one process holds
    T = s.shape[-1]
    return torch.softmax(s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1) @ v


def _measure(fn, q, k, v, group, **kw):
    """(forward meter, backward meter, saved bytes, largest tensor of forward + backward)."""
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    with comms.meter() as fwd, SavedTensorBytes() as saved, LargestTensor() as largest:
        out = fn(*mine, group, **kw)
        loss = out.float().sum()
    with comms.meter() as bwd, largest:
        loss.backward()
    return fwd, bwd, saved.bytes, largest.elements


def _bytes_body():
    group, cp, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    for T in (16 * cp, 32 * cp):  # T/cp = 16 then 32 tokens per rank
        n = T // cp
        torch.manual_seed(0)
        q, k, v = (split_sequence(torch.randn(B, H, T, D), cp, r, dim=2) for _ in range(3))
        for dtype in (torch.float32, torch.bfloat16):
            qd, kd, vd = (t.to(dtype) for t in (q, k, v))
            fwd, bwd, saved, largest = _measure(ring_attention, qd, kd, vd, group)
            want = ring_attention_sent_bytes(B, H, T, D, cp, element_size=qd.element_size())
            what = f"ring cp={cp} T={T} {dtype}"
            assert fwd.sent_bytes() == fwd.sent_bytes("send") == want["forward"], what
            assert bwd.sent_bytes() == bwd.sent_bytes("send") == want["backward"], what
            assert (fwd.calls("send"), bwd.calls("send")) == (cp - 1, 2 * (cp - 1)), what
            assert saved == ring_attention_saved_bytes(B, H, T, D, cp, qd.element_size()), what
            # the largest tensor of forward and backward: one (B, H, T/cp, T/cp) score block
            assert largest == score_block_elements(B, H, T, cp) == B * H * n * n, what

        fwd, bwd, _, _ = _measure(ulysses_attention, q, k, v, group)
        want = ulysses_sent_bytes(B, H, T, D, cp)
        assert fwd.calls() == fwd.calls("all_to_all") == 4 and bwd.calls("all_to_all") == 4
        assert fwd.sent_bytes() == want["forward"] == 4 * (cp - 1) * B * H * n * D * 4 // cp
        assert bwd.sent_bytes() == want["backward"]

        # one process holds a (B, H, T, T) score matrix: cp^2 times the ring's block
        full = [torch.randn(B, H, T, D, requires_grad=True) for _ in range(3)]
        with LargestTensor() as dense:
            _dense_attention(*full).sum().backward()
        assert dense.elements == B * H * T * T == cp * cp * score_block_elements(B, H, T, cp)

        # the work each rank really does: the score blocks of its forward
        for zigzag in (True, False):
            qz, kz, vz = (split_sequence(t.detach(), cp, r, zigzag, dim=2) for t in full)
            with _ScoreBlocks() as blocks:
                ring_attention(qz, kz, vz, group, zigzag=zigzag)
            assert blocks.entries == B * H * ring_block_elements_per_rank(T, cp, zigzag=zigzag)[r]
    return "ok"


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_memory_and_work_measured(cp):
    assert launch(_bytes_body, cp, timeout=120.0, quiet=True, threads=1) == ["ok"] * cp


def _gqa_body(H, KV):
    """Grouped-query attention (H query heads, KV key/value heads) on the cp ranks: ring and
    Ulysses equal one process (outputs and every gradient; the ring computes in float32 whatever
    its inputs, so it is held to float32's bound) and send their formulas' bytes."""
    group, cp, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    T = 8 * cp
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, KV, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _dense_attention(full[0], *(t.repeat_interleave(H // KV, dim=1) for t in full[1:]))
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want.backward(dout)
    out = {}
    for name, fn, zigzag, sent in (
            ("ring", ring_attention, True, ring_attention_sent_bytes(B, H, T, D, cp, 8, kv_heads=KV)),
            ("ulysses", ulysses_attention, False, ulysses_sent_bytes(B, H, T, D, cp, 8, kv_heads=KV))):
        mine = [split_sequence(t.detach(), cp, r, zigzag, dim=2).requires_grad_() for t in (q, k, v)]
        with comms.meter() as fwd:
            y = fn(*mine, group, zigzag=zigzag)
        with comms.meter() as bwd:
            y.backward(split_sequence(dout, cp, r, zigzag, dim=2))
        # One process in float64 is the truth. The ring computes in float32 whatever its
        # inputs, Ulysses in their float64: the policy of that precision (reference.tolerance),
        # for values of the size of each tensor (its largest entry).
        dtype = torch.float32 if name == "ring" else torch.float64
        close = lambda tol, got, want: tol.at_scale(float(want.abs().max())).close(got, want)  # noqa: E731
        grads_equal = all(close(gradient(cp, dtype), m.grad, split_sequence(f.grad, cp, r, zigzag, dim=2))
                          for m, f in zip(mine, full))
        out[name] = (close(forward(dtype), y, split_sequence(want.detach(), cp, r, zigzag, dim=2)),
                     grads_equal, (fwd.sent_bytes(), bwd.sent_bytes()) == (sent["forward"], sent["backward"]))
    return out


@pytest.mark.parametrize("cp, H, KV", [(2, 4, 2), (4, 8, 4)])
def test_grouped_query_attention_ships_only_the_kv_heads(cp, H, KV):
    for rank in launch(_gqa_body, cp, H, KV, timeout=120.0, quiet=True, threads=1):
        assert rank == {"ring": (True, True, True), "ulysses": (True, True, True)}


def test_grouped_query_bytes_llama_3_70b():
    """64 query heads, 8 key/value heads, cp 8: the ring sends less than Ulysses forward,
    because Ulysses' q and output all-to-alls keep all 64 heads; without GQA the ring sends
    cp/2 = 4 times Ulysses' forward bytes and, over a bf16 step, cp = 8 times."""
    b, T, Dh, cp = 2, 131_072, 128, 8
    ring = ring_attention_sent_bytes(1, 64, T, Dh, cp, b, kv_heads=8)
    uly = ulysses_sent_bytes(1, 64, T, Dh, cp, b, kv_heads=8)
    unit = T // cp * Dh * b                                     # B n D b
    assert ring["forward"] == 112 * unit and uly["forward"] == 126 * unit
    assert ring["forward"] < uly["forward"]
    mha_ring, mha_uly = ring_attention_sent_bytes(1, 64, T, Dh, cp, b), ulysses_sent_bytes(1, 64, T, Dh, cp, b)
    assert mha_ring["forward"] == 4 * mha_uly["forward"]
    assert sum(mha_ring.values()) == cp * sum(mha_uly.values())
    f32_ring, f32_uly = ring_attention_sent_bytes(1, 64, T, Dh, cp), ulysses_sent_bytes(1, 64, T, Dh, cp)
    assert 4 * sum(f32_ring.values()) == 3 * cp * sum(f32_uly.values())
