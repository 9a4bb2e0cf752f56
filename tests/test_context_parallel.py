"""Context parallelism against one process: ring attention, Ulysses, and a whole GPT.

Every rank draws the same full q, k, v (B, H, T, D) from one seed, runs the
single-process attention on them (the oracle), then the context-parallel version
on its own part of the sequence, and checks its rows of the output and of the
q, k, v gradients. One `launch` per cp runs every combination (ring with the
zig-zag and the contiguous split, Ulysses with both, causal or not) and the
refusals. The GPT test runs GPTConfig.tiny(n_layer=2) on 2 ranks with both kinds.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.context_parallel import (
    ContextParallelAttention, ContextParallelGPT, allreduce_context_parallel_grads,
    check_sequence_split, gather_sequence, ring_attention, sequence_positions, split_sequence,
    ulysses_attention, zigzag_chunks,
)
from reference.model import GPT, CausalSelfAttention, GPTConfig
from reference.runtime import launch
from reference.tolerance import exact, forward, gradient, loss
from reference.train.single import accumulate_gradients

# fp32 parity, the course's policy (reference.tolerance). Ring attention adds the keys
# block by block with rescaling (the online softmax) where the oracle sums them in one
# pass: the same terms in another order. Outputs: `forward()`; gradients, whose keys' and
# values' parts are summed over the cp ranks: `gradient(cp)`; the loss: `loss()`.
B, H, T, D = 2, 4, 16, 8  # T = 16 splits into 2 cp = 8 chunks of 2 on 4 ranks
LOSS_TOL = loss()  # the shares summed over cp against one process's mean


def close(actual, expected, what, tol=None):
    (tol or forward()).assert_close(actual, expected, what)


def test_zigzag_layout():
    """Rank r holds chunks r and 2 cp - 1 - r, in position order; the parts cover the sequence once."""
    assert sequence_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 2, 1, zigzag=False).tolist() == [4, 5, 6, 7]
    assert zigzag_chunks(4, 1) == (1, 6)
    for cp, zigzag in ((2, True), (4, True), (4, False)):
        parts = torch.cat([sequence_positions(16, cp, r, zigzag) for r in range(cp)])
        assert sorted(parts.tolist()) == list(range(16)), (cp, zigzag)
    x = torch.arange(2 * 16).view(2, 16)
    assert split_sequence(x, 4, 3).tolist() == [[6, 7, 8, 9], [22, 23, 24, 25]]


def test_layout_refuses_uneven_sequences():
    with pytest.raises(ValueError, match=r"T=10 tokens over cp=2 .* 2\*cp=4 chunks"):
        check_sequence_split(10, 2)
    with pytest.raises(ValueError, match=r"T=6 tokens over cp=4 .* cp=4 contiguous parts"):
        split_sequence(torch.zeros(1, 6), 4, 0, zigzag=False)
    with pytest.raises(ValueError, match=r"rank=2 is not a rank of a cp group of cp=2"):
        sequence_positions(8, 2, 2)


def _oracle(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v on one process, with the causal mask when asked."""
    s = q @ k.transpose(-2, -1) / D ** 0.5  # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _check_attention(fn, kind, zigzag, causal, group, r, n):
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v, w = (torch.randn(B, H, T, D) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _oracle(*full, causal)
    (ref * w).sum().backward()
    part = lambda t: split_sequence(t, n, r, zigzag, dim=2)  # noqa: E731  (B, H, T/cp, D)
    mine = [part(t).requires_grad_() for t in (q, k, v)]
    out = fn(*mine, group, causal=causal, zigzag=zigzag)
    (out * part(w)).sum().backward()
    what = f"{kind} cp={n} zigzag={zigzag} causal={causal}"
    close(out, part(ref.detach()), what + " output")
    for name, m, f in zip("qkv", mine, full):
        close(m.grad, part(f.grad), f"{what} d{name}", gradient(n))
    # and against PyTorch's own attention
    close(out, part(F.scaled_dot_product_attention(q, k, v, is_causal=causal)), what + " vs SDPA")


def _check_refusals(group, n):
    x = torch.zeros(B, H, 3, D)  # T/cp = 3 tokens: T = 3 cp does not divide by 2 cp
    with pytest.raises(ValueError, match=rf"T={3 * n} \(T/cp=3 tokens on each of cp={n} ranks\)"):
        ring_attention(x, x, x, group)
    ring_attention(x, x, x, group, zigzag=False)  # the contiguous split takes any T/cp
    odd = torch.zeros(B, n + 1, 2, D)
    with pytest.raises(ValueError, match=rf"n_head={n + 1} heads must divide by cp={n}"):
        ulysses_attention(odd, odd, odd, group)
    with pytest.raises(ValueError, match=r"one shape, dtype and device; got q \(2, 4, 2, 8\).* and k \(2, 4, 4, 8\)"):
        ring_attention(torch.zeros(B, H, 2, D), torch.zeros(B, H, 4, D), torch.zeros(B, H, 4, D), group)
    attn = CausalSelfAttention(GPTConfig(n_embd=4 * (n + 1), n_head=n + 1, block_size=8))
    with pytest.raises(ValueError, match=rf"n_head={n + 1} heads must divide by cp={n}"):
        ContextParallelAttention.from_dense(attn, group, kind="ulysses")
    with pytest.raises(ValueError, match=r"kind='flash'"):
        ContextParallelAttention.from_dense(attn, group, kind="flash")
    drop = ContextParallelAttention.from_dense(CausalSelfAttention(GPTConfig(n_embd=8, n_head=2, dropout=0.1)),
                                               group, kind="ring")
    with pytest.raises(ValueError, match=r"dropout=0.1 and is training"):
        drop(torch.zeros(1, 2, 8))
    drop.eval()(torch.zeros(1, 2, 8))  # evaluation ignores dropout


def _attention_body():
    group, n, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    for causal in (True, False):
        for zigzag in (True, False):
            _check_attention(ring_attention, "ring", zigzag, causal, group, r, n)
            _check_attention(ulysses_attention, "ulysses", zigzag, causal, group, r, n)
    # gather_sequence puts every rank's part back in position order
    x = torch.arange(B * T * 3, dtype=torch.float32).view(B, T, 3)
    for zigzag in (True, False):
        close(gather_sequence(split_sequence(x, n, r, zigzag), group, zigzag), x, "gather_sequence", exact())
    if n > 1:
        _check_refusals(group, n)
    return "ok"


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_attention_equals_one_process(cp):
    """cp = 1 is the degree-1 case: no message, the same numbers."""
    assert launch(_attention_body, cp, timeout=120.0, quiet=True, threads=1) == ["ok"] * cp


def _gpt_body():
    group, n, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    config = GPTConfig.tiny(n_layer=2)
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (2, config.block_size))  # (B, T) = (2, 32)
    targets = torch.randint(0, config.vocab_size, (2, config.block_size))
    dense = GPT.from_config_seed(config, 1)
    with torch.no_grad():
        logits, _ = dense(idx)
    loss = accumulate_gradients(dense, idx, targets)  # one process, the whole sequence
    for kind in ("ring", "ulysses"):
        for zigzag in (True, False):
            what = f"GPT {kind} cp={n} zigzag={zigzag}"
            model = ContextParallelGPT(GPT.from_config_seed(config, 1), group, kind, zigzag)
            part = lambda t: split_sequence(t, n, r, zigzag)  # noqa: E731
            logits_r, share = model(part(idx), part(targets))
            share.backward()
            total = share.detach().clone()
            dist.all_reduce(total, group=group)  # the shares add up to the mean loss
            close(total, loss, what + " loss", LOSS_TOL)
            close(gather_sequence(logits_r.detach(), group, zigzag), logits.detach(), what + " logits")
            allreduce_context_parallel_grads(model, group)
            mine = dict(model.model.named_parameters())
            assert mine.keys() == dict(dense.named_parameters()).keys()
            for name, p_dense in dense.named_parameters():
                close(mine[name].grad, p_dense.grad, f"{what} grad of {name}", gradient(n))
    return "ok"


def test_gpt_equals_one_process():
    """Loss, logits and parameter gradients (summed over cp) of a 2-layer GPT on 2 ranks."""
    assert launch(_gpt_body, 2, timeout=120.0, quiet=True, threads=1) == ["ok"] * 2
