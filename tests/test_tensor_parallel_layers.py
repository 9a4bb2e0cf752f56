"""Tensor-parallel layers against their dense single-process versions, for tp = 1, 2, 4.

Every rank builds the same dense layer from the same seed, runs it, then runs its
TP version built with `from_dense` and checks its own part: the output (or its
shard), the input gradient (or its shard) and the weight-gradient shards. The
MLP is also checked against PyTorch's DTensor ColwiseParallel / RowwiseParallel.
One `launch` per world size runs all the checks.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms
from reference.mesh import Mesh
from reference.model import MLP, CausalSelfAttention, GPTConfig
from reference.runtime import launch
from reference.tensor_parallel import (
    ColumnParallelLinear, ParallelCausalSelfAttention, RowParallelLinear, VocabParallelEmbedding,
    allreduce_sequence_parallel_grads, column_shard, f, g, gather_from_sequence_parallel_region,
    padded_vocab_size, reduce_scatter_to_sequence_parallel_region, row_shard,
    scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy,
)
from reference.tolerance import forward, gradient, loss

# The course's policy (reference.tolerance): outputs `forward()`; gradients, whose parts are
# summed over the n ranks (f's backward, SP's all-reduce, a row layer's partial sums):
# `gradient(n)`.
TOL = forward()
B, T, C, H = 2, 8, 16, 48  # H divides by 3 x 4: c_attn-like chunks=3 on 4 ranks


def close(actual, expected, what, tol=TOL):
    tol.assert_close(actual, expected, what)


def seq_shard(t, r, n):
    return t.chunk(n, dim=1)[r]


def last_shard(t, r, n):
    return t.chunk(n, dim=-1)[r]


def _run(dense_fn, tp_fn, x, x_tp, out_weight, out_weight_tp):
    """Forward both, backward through sum(out * weight) (a loss every rank can form), return outputs."""
    xd, xt = x.clone().requires_grad_(), x_tp.clone().requires_grad_()
    yd, yt = dense_fn(xd), tp_fn(xt)
    (yd * out_weight).sum().backward()
    (yt * out_weight_tp).sum().backward()
    return yd, yt, xd.grad, xt.grad


def _check_operators(group, r, n):
    """f and g, and the sequence-parallel pair, on values whose sums are exact."""
    x = torch.full((2, 4, 3), float(r + 1), requires_grad=True)
    y = f(x, group)
    close(y, x.detach(), "f forward is the identity")
    y.backward(torch.ones_like(y))
    close(x.grad, torch.full_like(x, float(n)), "f backward all-reduces")
    x.grad = None
    z = g(x, group)
    close(z, torch.full_like(x, n * (n + 1) / 2), "g forward all-reduces")
    z.backward(torch.ones_like(z))
    close(x.grad, torch.ones_like(x), "g backward is the identity")
    # all-gather along T then reduce-scatter along T: the two halves of an all-reduce
    base = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    full = base + 10 * r  # rank r's (B, T, C)
    shard = scatter_to_sequence_parallel_region(full, group)
    close(shard, seq_shard(full, r, n), "scatter along the sequence")
    gathered = torch.cat([seq_shard(base + 10 * q, q, n) for q in range(n)], dim=1)
    close(gather_from_sequence_parallel_region(shard, group), gathered, "all-gather along the sequence")
    summed = sum(base + 10 * q for q in range(n))
    close(reduce_scatter_to_sequence_parallel_region(full, group), seq_shard(summed, r, n),
          "reduce-scatter along the sequence")


def _check_errors(group, n):
    """Sizes that do not split: each error names the sizes and tp."""
    with pytest.raises(ValueError, match=rf"out_features={n + 1} must divide by tp={n} x chunks=1"):
        ColumnParallelLinear(4, n + 1, group)
    with pytest.raises(ValueError, match=rf"in_features={n + 1} must divide by tp={n}"):
        RowParallelLinear(n + 1, 4, group)
    odd_heads = GPTConfig(n_embd=3 * n + 3, n_head=n + 1, block_size=T)
    with pytest.raises(ValueError, match=rf"n_head={n + 1} must divide by tp={n}"):
        ParallelCausalSelfAttention.from_dense(CausalSelfAttention(odd_heads), group)
    with pytest.raises(ValueError, match="needs rng="):
        ParallelCausalSelfAttention.from_dense(CausalSelfAttention(GPTConfig(n_embd=C, dropout=0.1)), group)
    with pytest.raises(ValueError, match=rf"size {n + 1} does not divide by the tensor-parallel size "
                                         rf"tp={n} \(sequence parallelism needs"):
        scatter_to_sequence_parallel_region(torch.zeros(B, n + 1, C), group)


def _check_linears(group, r, n):
    grad = gradient(n)  # gradients: parts summed over the n ranks
    torch.manual_seed(0)
    x = torch.randn(B, T, C)
    col_dense = nn.Linear(C, H)
    w_out = torch.randn(B, T, H)
    for chunks in (1, 3):
        for gather in (False, True):
            dense = copy.deepcopy(col_dense)
            col = ColumnParallelLinear.from_dense(dense, group, gather_output=gather, chunks=chunks)
            # With a gathered output every rank forms the whole loss; without, its own part.
            shard = (lambda t: t) if gather else (lambda t: column_shard(t.transpose(0, -1), r, n, chunks).transpose(0, -1))
            yd, yt, gd, gt = _run(dense, col, x, x, w_out, shard(w_out))
            what = f"column chunks={chunks} gather={gather}"
            close(yt, shard(yd), what + " output")
            close(gt, gd, what + " input grad", grad)
            close(col.weight.grad, column_shard(dense.weight.grad, r, n, chunks), what + " weight grad", grad)
            close(col.bias.grad, column_shard(dense.bias.grad, r, n, chunks), what + " bias grad", grad)

    xh = torch.randn(B, T, H)
    w_c = torch.randn(B, T, C)
    for parallel_input in (True, False):
        dense = nn.Linear(H, C)
        row = RowParallelLinear.from_dense(dense, group, input_is_parallel=parallel_input)
        x_tp = last_shard(xh, r, n) if parallel_input else xh
        yd, yt, gd, gt = _run(dense, row, xh, x_tp, w_c, w_c)
        what = f"row input_is_parallel={parallel_input}"
        close(yt, yd, what + " output")
        close(gt, last_shard(gd, r, n) if parallel_input else gd, what + " input grad", grad)
        close(row.weight.grad, row_shard(dense.weight.grad, r, n), what + " weight grad", grad)
        close(row.bias.grad, dense.bias.grad, what + " bias grad", grad)

    # Sequence parallel: the column layer reads a sequence shard, the row layer writes one.
    for regather in (False, True):
        dense = copy.deepcopy(col_dense)
        col = ColumnParallelLinear.from_dense(dense, group, sequence_parallel=True, regather_input=regather)
        yd, yt, gd, gt = _run(dense, col, x, seq_shard(x, r, n), w_out, last_shard(w_out, r, n))
        what = f"column sequence-parallel regather={regather}"
        close(yt, last_shard(yd, r, n), what + " output")
        close(gt, seq_shard(gd, r, n), what + " input grad", grad)
        close(col.weight.grad, column_shard(dense.weight.grad, r, n), what + " weight grad", grad)
        close(col.bias.grad, column_shard(dense.bias.grad, r, n), what + " bias grad", grad)
    dense = nn.Linear(H, C)
    row = RowParallelLinear.from_dense(dense, group, sequence_parallel=True)
    yd, yt, gd, gt = _run(dense, row, xh, last_shard(xh, r, n), w_c, seq_shard(w_c, r, n))
    close(yt, seq_shard(yd, r, n), "row sequence-parallel output")
    close(gt, last_shard(gd, r, n), "row sequence-parallel input grad", grad)
    close(row.weight.grad, row_shard(dense.weight.grad, r, n), "row sequence-parallel weight grad", grad)
    # The bias met only this rank's tokens: partial until summed over the group.
    assert row.bias.sequence_parallel
    allreduce_sequence_parallel_grads(row, group)
    close(row.bias.grad, dense.bias.grad, "row sequence-parallel bias grad after the all-reduce", grad)


def _check_mlp_and_attention(group, r, n):
    grad = gradient(n)  # gradients: parts summed over the n ranks
    cfg = GPTConfig(n_embd=C, n_head=4, d_ff=H, block_size=T)
    torch.manual_seed(1)
    x = torch.randn(B, T, C)
    w = torch.randn(B, T, C)
    for sp in (False, True):
        mlp = MLP(cfg)
        tp_mlp = copy.deepcopy(mlp)
        tp_mlp.c_fc = ColumnParallelLinear.from_dense(mlp.c_fc, group, sequence_parallel=sp)
        tp_mlp.c_proj = RowParallelLinear.from_dense(mlp.c_proj, group, sequence_parallel=sp)
        attn = CausalSelfAttention(cfg)
        tp_attn = ParallelCausalSelfAttention.from_dense(attn, group, sequence_parallel=sp)
        for name, dense, tp in (("mlp", mlp, tp_mlp), ("attention", attn, tp_attn)):
            part = (lambda t: seq_shard(t, r, n)) if sp else (lambda t: t)
            yd, yt, gd, gt = _run(dense, tp, x, part(x), w, part(w))
            what = f"{name} sequence_parallel={sp}"
            close(yt, part(yd), what + " output")
            close(gt, part(gd), what + " input grad", grad)
            if sp:
                allreduce_sequence_parallel_grads(tp, group)
            lin = ("c_fc", "c_proj") if name == "mlp" else ("c_attn", "c_proj")
            d_in, d_out = (getattr(dense, k) for k in lin)
            t_in, t_out = (getattr(tp, k) for k in lin)
            chunks = 3 if name == "attention" else 1
            close(t_in.weight.grad, column_shard(d_in.weight.grad, r, n, chunks), what + " column weight grad", grad)
            close(t_in.bias.grad, column_shard(d_in.bias.grad, r, n, chunks), what + " column bias grad", grad)
            close(t_out.weight.grad, row_shard(d_out.weight.grad, r, n), what + " row weight grad", grad)
            close(t_out.bias.grad, d_out.bias.grad, what + " row bias grad", grad)


def _check_vocab(group, r, n):
    grad = gradient(n)  # gradients: parts summed over the n ranks
    # 5 on 4 ranks pads to 8: rank 2 holds one real id and one padding row, rank 3 only padding.
    for vocab in (5, 11, 12):
        vp = padded_vocab_size(vocab, n)
        torch.manual_seed(2)
        emb = nn.Embedding(vocab, C)
        tp_emb = VocabParallelEmbedding.from_dense(emb, group)
        idx = torch.randint(0, vocab, (B, T))
        w = torch.randn(B, T, C)
        yd, yt = emb(idx), tp_emb(idx)
        (yd * w).sum().backward()
        (yt * w).sum().backward()
        pad = torch.cat([emb.weight.grad, torch.zeros(vp - vocab, C)]).chunk(n)[r]
        close(yt, yd, f"embedding V={vocab} output")
        close(tp_emb.weight.grad, pad, f"embedding V={vocab} weight grad (padding rows zero)", grad)

        logits = torch.randn(B, T, vocab)
        targets = torch.randint(0, vocab, (B, T))
        targets[0, 0] = vocab - 1  # the last real id, next to the padding
        ld = logits.clone().requires_grad_()
        loss_d = nn.functional.cross_entropy(ld.reshape(-1, vocab), targets.reshape(-1))
        loss_d.backward()
        # Padding columns hold garbage on purpose: the loss must ignore them.
        padded = torch.cat([logits, torch.full((B, T, vp - vocab), 7.0)], dim=-1)
        lt = padded.chunk(n, dim=-1)[r].clone().requires_grad_()
        with comms.meter() as m:
            loss_t = vocab_parallel_cross_entropy(lt, targets, group, vocab_size=vocab)
        loss_t.backward()
        close(loss_t, loss_d, f"cross-entropy V={vocab}", loss())
        grad_pad = torch.cat([ld.grad, torch.zeros(B, T, vp - vocab)], dim=-1).chunk(n, dim=-1)[r]
        close(lt.grad, grad_pad, f"cross-entropy V={vocab} logits grad", grad)
        # Three all-reduces of B * T floats (max, target logit, sum of exp), and nothing else.
        if n > 1:
            assert m.calls() == m.calls("all_reduce") == 3
            assert m.payload_bytes("all_reduce") == 3 * B * T * 4
        with pytest.raises(ValueError, match="targets must lie in"):
            vocab_parallel_cross_entropy(lt, torch.full((B, T), vocab), group, vocab_size=vocab)


def _check_dtensor_mlp(r, n):
    """Our column/row MLP equals PyTorch's DTensor ColwiseParallel / RowwiseParallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    grad = gradient(n)  # gradients: parts summed over the n ranks

    dmesh = init_device_mesh("cpu", (n,))
    cfg = GPTConfig(n_embd=C, n_head=4, d_ff=H, block_size=T)
    torch.manual_seed(3)
    mlp = MLP(cfg)
    ours = copy.deepcopy(mlp)
    group = dist.group.WORLD
    ours.c_fc = ColumnParallelLinear.from_dense(mlp.c_fc, group)
    ours.c_proj = RowParallelLinear.from_dense(mlp.c_proj, group)
    theirs = parallelize_module(copy.deepcopy(mlp), dmesh,
                                {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    x, w = torch.randn(B, T, C), torch.randn(B, T, C)
    ya, yb, ga, gb = _run(ours, theirs, x, x, w, w)
    close(ya, yb, "MLP output vs DTensor")
    close(ga, gb, "MLP input grad vs DTensor", grad)
    for k in ("c_fc", "c_proj"):
        for p in ("weight", "bias"):
            mine = getattr(getattr(ours, k), p).grad
            dt = getattr(getattr(theirs, k), p).grad.to_local()
            close(mine, dt, f"MLP {k}.{p} grad shard vs DTensor", grad)


def _check_from_dense_draws_no_master_weight(group):
    """`from_dense` copies the dense layer's slice in: no master weight is drawn to be thrown
    away (a layer built directly draws one; the counters see it)."""
    from reference.tensor_parallel import layers

    dense = nn.Linear(C, H), nn.Linear(H, C), nn.Embedding(11, C)  # drawn before counting
    drawn, master_linear, normal = [], layers._master_linear, nn.init.normal_
    layers._master_linear = lambda *a, **k: drawn.append("linear") or master_linear(*a, **k)
    nn.init.normal_ = lambda *a, **k: drawn.append("embedding") or normal(*a, **k)
    try:
        ColumnParallelLinear.from_dense(dense[0], group)
        RowParallelLinear.from_dense(dense[1], group)
        VocabParallelEmbedding.from_dense(dense[2], group)
        assert drawn == [], drawn
        ColumnParallelLinear(C, H, group)
        VocabParallelEmbedding(11, C, group)
        assert drawn == ["linear", "embedding"], drawn
    finally:
        layers._master_linear, nn.init.normal_ = master_linear, normal


def _layers_body():
    n = dist.get_world_size()
    mesh = Mesh(tp=n).build_groups()
    group, r = mesh.group("tp"), mesh.tp_rank
    _check_operators(group, r, n)
    _check_linears(group, r, n)
    _check_mlp_and_attention(group, r, n)
    _check_vocab(group, r, n)
    _check_dtensor_mlp(r, n)
    _check_from_dense_draws_no_master_weight(group)
    if n > 1:
        _check_errors(group, n)
    return "ok"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layers_equal_dense(tp):
    assert launch(_layers_body, tp, timeout=120.0, quiet=True, threads=1) == ["ok"] * tp
