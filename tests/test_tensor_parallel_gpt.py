"""A tensor-parallel transformer block and GPT against the dense single-process model.

For tp = 1, 2, 4, with and without sequence parallelism: outputs, input gradients
and the weight-gradient shard of every parameter; the sequence-parallel LayerNorm
gradients, wrong until summed over the TP group; losses and parameters over
several AdamW steps; a vocabulary that needs padding and tied embedding / output
weights. Then the communication of one block measured against the counts in
`reference.tensor_parallel`'s docstring, and the dropout seeds of shards and replicas.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from reference import comms
from reference.mesh import Mesh
from reference.model import GPT, Block, GPTConfig
from reference.runtime import launch
from reference.tensor_parallel import (
    ColumnParallelLinear, ParallelCausalSelfAttention, RowParallelLinear, ShardedDropout,
    TensorParallelRNG, allreduce_sequence_parallel_grads, apply_tensor_parallel, column_shard,
    padded_vocab_size, row_shard,
)
from reference.tolerance import adamw_weights, forward, gradient, loss
from reference.train import make_optimizer
from reference.train.single import accumulated_step

# Tolerances: the course's policy (reference.tolerance says why). Outputs and losses:
# `forward()`; gradients summed over the tp ranks: `gradient(tp)`. A block's weight gradients
# with the random upstream gradient w ~ N(0, 1) are sums over B x T = 32 rows of terms up to
# about 4, which sequence parallelism adds in another order (per shard, then over tp): values
# of order 4, `gradient(tp).at_scale(4)`. Parameters after AdamW steps: `adamw_weights`.
TOL = forward()
LR = 1e-2
# 251 is prime: padded to 252 on 2 and 4 ranks. T = 16 splits over 4 ranks.
CFG = GPTConfig.tiny(vocab_size=251, block_size=16)
B = 2


def close(actual, expected, what, tol=TOL):
    tol.assert_close(actual, expected, what)


def seq_shard(t, r, n):
    return t.chunk(n, dim=1)[r]


def dense_shard(name, t, r, n, vocab=CFG.vocab_size):
    """This rank's part of the dense tensor `t` that TP parameter `name` holds."""
    if name in ("wte.weight", "lm_head.weight"):
        padded = torch.cat([t, t.new_zeros(padded_vocab_size(vocab, n) - vocab, t.shape[1])])
        return padded.chunk(n, dim=0)[r]
    if ".c_attn." in name:
        return column_shard(t, r, n, chunks=3)  # [q_r | k_r | v_r]
    if ".c_fc." in name:
        return column_shard(t, r, n)
    if name.endswith("c_proj.weight"):
        return row_shard(t, r, n)
    return t  # replicated: positions, LayerNorms, row-parallel biases


def tp_block(block, group, sp, regather=False):
    """The Megatron block, swapped in by hand as a notebook would."""
    tp = copy.deepcopy(block)
    tp.attn = ParallelCausalSelfAttention.from_dense(block.attn, group, sequence_parallel=sp,
                                                     regather_input=regather)
    tp.ffn.c_fc = ColumnParallelLinear.from_dense(block.ffn.c_fc, group, sequence_parallel=sp,
                                                  regather_input=regather)
    tp.ffn.c_proj = RowParallelLinear.from_dense(block.ffn.c_proj, group, sequence_parallel=sp)
    if sp:
        for p in (*tp.ln_1.parameters(), *tp.ln_2.parameters()):
            p.sequence_parallel = True
    return tp


# ---------------------------------------------------------------------------
# Parity: block, GPT, AdamW steps
# ---------------------------------------------------------------------------
def _check_block(group, r, n):
    torch.manual_seed(0)
    block = Block(CFG)
    x, w = torch.randn(B, CFG.block_size, CFG.n_embd), torch.randn(B, CFG.block_size, CFG.n_embd)
    xd = x.clone().requires_grad_()
    yd, _ = block(xd)
    (yd * w).sum().backward()
    dense_grads = {k: p.grad for k, p in block.named_parameters()}
    for sp, regather in ((False, False), (True, False), (True, True)):
        what = f"block sp={sp} regather={regather}"
        tp = tp_block(block, group, sp, regather)
        part = (lambda t: seq_shard(t, r, n)) if sp else (lambda t: t)
        xt = part(x).clone().requires_grad_()
        yt, _ = tp(xt)
        (yt * part(w)).sum().backward()
        close(yt, part(yd), what + " output")
        close(xt.grad, part(xd.grad), what + " input grad", gradient(n))
        block_grad = gradient(n).at_scale(4)  # sums of terms up to about 4
        if sp and n > 1:
            # The classic silent error: without the all-reduce, each rank's
            # LayerNorm gradient covers only its own tokens.
            partial = tp.ln_1.weight.grad.clone()
            assert not block_grad.close(partial, dense_grads["ln_1.weight"]), what
            allreduce_sequence_parallel_grads(tp, group)
        for name, p in tp.named_parameters():
            close(p.grad, dense_shard(name, dense_grads[name], r, n), f"{what} grad of {name}", block_grad)


def _batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, CFG.vocab_size, (B, CFG.block_size), generator=g),
             torch.randint(0, CFG.vocab_size, (B, CFG.block_size), generator=g)) for _ in range(steps)]


def _check_gpt(mesh, sp, steps=3, cfg=CFG, frozen=()):
    group, r, n = mesh.group("tp"), mesh.tp_rank, mesh.tp
    dense = GPT.from_config_seed(cfg, 0)
    for name in frozen:
        dense.get_parameter(name).requires_grad_(False)
    tp = apply_tensor_parallel(copy.deepcopy(dense), mesh, sequence_parallel=sp)
    assert (tp.lm_head.weight is tp.wte.weight) == cfg.tie_weights, "tied weights stay tied"
    opt_d, opt_t = make_optimizer(dense, lr=LR), make_optimizer(tp, lr=LR)
    for step, (x, y) in enumerate(_batches(steps)):
        what = f"GPT sp={sp} tied={cfg.tie_weights} step {step}"
        if step == 0:
            with torch.no_grad():
                logits_d, _ = dense(x)  # the oracle's logits, before its first step
        loss_d, _ = accumulated_step(dense, opt_d, x, y)  # one process; its gradients stay in .grad
        logits_t, loss_t = tp(x, y)
        loss_t.backward()
        if sp:
            allreduce_sequence_parallel_grads(tp, group)
        close(loss_t, loss_d, what + " loss", loss())
        if step == 0:
            v_local = padded_vocab_size(CFG.vocab_size, n) // n
            real = min(v_local, CFG.vocab_size - r * v_local)  # columns before the padding
            close(logits_t[..., :real], logits_d[..., r * v_local: r * v_local + real], what + " logits")
            dense_params = dict(dense.named_parameters())
            for name, p in tp.named_parameters():
                if name in frozen:
                    assert not p.requires_grad and p.grad is None, f"{what}: {name} stays frozen"
                    continue
                close(p.grad, dense_shard(name, dense_params[name].grad, r, n), f"{what} grad of {name}",
                      gradient(n))
        opt_t.step()
        opt_t.zero_grad()
    # AdamW divides by sqrt(v): a gradient that is pure rounding noise still moves its
    # weight by up to lr, so any one weight may differ by AdamW's whole steps; the mean
    # over this rank's weights is what a wrong gradient would move.
    dense_params = dict(dense.named_parameters())
    adamw_weights(steps, LR).assert_weights(
        {name: p for name, p in tp.named_parameters()},
        {name: dense_shard(name, dense_params[name], r, n) for name, _ in tp.named_parameters()},
        f"GPT sp={sp} after {steps} AdamW steps")


def _parity_body():
    n = dist.get_world_size()
    mesh = Mesh(tp=n).build_groups()
    _check_block(mesh.group("tp"), mesh.tp_rank, n)
    for sp in (False, True):
        _check_gpt(mesh, sp)
    # Untied output layer; frozen parameters of each kind (column, row, LayerNorm, vocabulary).
    frozen = ("h.0.attn.c_attn.weight", "h.1.ffn.c_proj.bias", "h.1.ln_2.weight", "lm_head.weight")
    _check_gpt(mesh, sp=True, steps=2, frozen=frozen,
               cfg=GPTConfig.tiny(vocab_size=251, block_size=16, tie_weights=False))
    if n > 1:
        with pytest.raises(ValueError, match=r"sequence parallelism needs the sequence length"):
            model = apply_tensor_parallel(GPT.from_config_seed(CFG, 0), mesh, sequence_parallel=True)
            model(torch.zeros(1, n + 1, dtype=torch.long))
    return "ok"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_block_and_gpt_equal_dense(tp):
    assert launch(_parity_body, tp, timeout=150.0, quiet=True, threads=1) == ["ok"] * tp


def test_apply_rejects_sizes_that_do_not_split():
    # Pure checks: no process group is needed to reject the sizes.
    model = GPT.from_config_seed(CFG, 0)  # n_head=4, n_embd=32, d_ff=128
    with pytest.raises(ValueError, match=r"tp=3 must divide n_head=4, n_embd=32 and d_ff=128; "
                                         r"n_head=4, n_embd=32, d_ff=128 do not \(mesh pp=1, dp=1, "
                                         r"tp=3, ep=1, world_size=3\)"):
        apply_tensor_parallel(model, Mesh(tp=3))
    odd_ffn = GPT.from_config_seed(GPTConfig.tiny(d_ff=98), 0)  # 98 = 4 * 24 + 2
    with pytest.raises(ValueError, match=r"d_ff=98 do not .*dp=2, tp=4, ep=1, world_size=8"):
        apply_tensor_parallel(odd_ffn, Mesh(dp=2, tp=4))
    moe = GPT.from_config_seed(CFG, 0, ffn_factory=lambda cfg, i: torch.nn.Identity())
    with pytest.raises(ValueError, match="splits the dense MLP; block 0 has an ffn of type Identity"):
        apply_tensor_parallel(moe, Mesh(tp=2))


# ---------------------------------------------------------------------------
# Communication and activation memory of one block
# ---------------------------------------------------------------------------
def _saved_activation_bytes(module, x):
    """Bytes autograd keeps for backward, parameters excluded, each storage once."""
    params = {p.data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = module(x)
    return out, sum(seen.values())


def _comm_body():
    n = dist.get_world_size()
    mesh = Mesh(tp=n).build_groups()
    group = mesh.group("tp")
    torch.manual_seed(0)
    block = Block(CFG)
    S = B * CFG.block_size * CFG.n_embd * 4  # bytes of one (B, T, C) fp32 activation
    ring = (n - 1) * S // n  # what a rank sends in a ring all-gather or reduce-scatter of S
    expected = {  # (op, calls, payload bytes, sent bytes) per pass: the docstring's table
        "tp": {"forward": {("all_reduce", 2, 2 * S, 4 * ring)},
               "backward": {("all_reduce", 2, 2 * S, 4 * ring)}},
        "sp": {"forward": {("all_gather", 2, 2 * S, 2 * ring), ("reduce_scatter", 2, 2 * S, 2 * ring)},
               "backward": {("all_gather", 2, 2 * S, 2 * ring), ("reduce_scatter", 2, 2 * S, 2 * ring)}},
        "sp_regather": {"forward": {("all_gather", 2, 2 * S, 2 * ring), ("reduce_scatter", 2, 2 * S, 2 * ring)},
                        "backward": {("all_gather", 4, 4 * S, 4 * ring), ("reduce_scatter", 2, 2 * S, 2 * ring)}},
    }
    x = torch.randn(B, CFG.block_size, CFG.n_embd)
    memory = {}
    for mode, (sp, regather) in (("tp", (False, False)), ("sp", (True, False)), ("sp_regather", (True, True))):
        tp = tp_block(block, group, sp, regather)
        xin = (seq_shard(x, mesh.tp_rank, n) if sp else x).clone().requires_grad_()
        with comms.meter() as fwd:
            y, memory[mode] = _saved_activation_bytes(tp, xin)
        with comms.meter() as bwd:
            y.sum().backward()
        for pass_, m in (("forward", fwd), ("backward", bwd)):
            got = {(rec["op"], rec["calls"], rec["payload_bytes"], rec["sent_bytes"])
                   for rec in m.records()}
            assert all(rec["group"] == "tp" for rec in m.records())
            assert got == expected[mode][pass_], (mode, pass_, got)
        if sp:  # one all-reduce for the LayerNorms and the row-parallel biases: 6 C floats
            with comms.meter() as ln:
                allreduce_sequence_parallel_grads(tp, group)
            assert (ln.calls(), ln.payload_bytes()) == (1, 6 * CFG.n_embd * 4)
    # Sequence parallelism keeps shards of the LayerNorm and dropout regions; the
    # regathering form also drops the gathered inputs of c_attn and c_fc.
    assert memory["sp_regather"] < memory["sp"] < memory["tp"], memory
    # The same bytes sent, in all-gathers and reduce-scatters instead of all-reduces.
    assert sum(s for *_, s in expected["sp"]["forward"]) == sum(s for *_, s in expected["tp"]["forward"])
    return memory


@pytest.mark.parametrize("tp", [2, 4])
def test_block_communication_and_memory_match_the_counts(tp):
    launch(_comm_body, tp, timeout=90.0, quiet=True, threads=1)


# ---------------------------------------------------------------------------
# Dropout: one seed for replicas, one per rank for shards
# ---------------------------------------------------------------------------
def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _dropout_body():
    mesh = Mesh(tp=dist.get_world_size()).build_groups()
    group, r = mesh.group("tp"), mesh.tp_rank
    torch.manual_seed(0)  # the training loop seeds every rank alike
    rng = TensorParallelRNG(seed=0, tp_rank=r)
    reference_draws = torch.rand(8, generator=torch.Generator().manual_seed(0))
    with rng.fork():
        own = torch.rand(64)
    shared = torch.rand(8)
    # The fork leaves the default stream where it was: it continues as if unforked.
    assert torch.equal(shared, reference_draws)
    a, b = _gather(own)
    assert not torch.equal(a, b), "shards draw from per-rank streams"
    ones = torch.ones(4, 64)
    sharded = _gather(ShardedDropout(0.5, rng).train()(ones))
    replicated = _gather(torch.nn.Dropout(0.5).train()(ones))
    assert not torch.equal(*sharded) and torch.equal(*replicated)

    # Attention whose heads are all alike: the heads of the two ranks see the same
    # scores, so their outputs before c_proj differ only through the dropout masks.
    cfg = GPTConfig.tiny(dropout=0.3, block_size=8)
    block = Block(cfg)
    with torch.no_grad():
        for w in block.attn.c_attn.weight.view(3, cfg.n_head, cfg.head_dim, cfg.n_embd):
            w[:] = w[0]
        block.attn.c_attn.bias.zero_()
    x = torch.randn(1, 8, cfg.n_embd)

    def head_outputs(attn_rng):
        attn = ParallelCausalSelfAttention.from_dense(block.attn, group, rng=attn_rng).train()
        seen = []
        attn.c_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
        attn(x)
        return _gather(seen[0])

    assert not torch.equal(*head_outputs(rng)), "heads on different ranks must get their own masks"
    same_seed = TensorParallelRNG(seed=0, tp_rank=0)  # the mistake: one stream for all shards
    assert torch.equal(*head_outputs(same_seed)), "the control: one seed makes the masks equal"

    # A whole GPT with dropout, trained a step: the replicated residual stream
    # stays identical on every rank (replicated dropout draws alike), and so do
    # the replicated parameters after the step.
    for sp in (False, True):
        model = apply_tensor_parallel(GPT.from_config_seed(cfg, 0), mesh, sequence_parallel=sp, seed=5)
        stream = []
        model.h[0].register_forward_hook(lambda mod, args, out: stream.append(out[0]))
        x, y = _batches(1)[0]
        _, loss = model(x[:, :8], y[:, :8])
        loss.backward()
        if sp:
            allreduce_sequence_parallel_grads(model, group)
        else:
            first, second = _gather(stream[0])
            assert torch.equal(first, second), "replicated activations must stay replicas"
        for p in (model.wpe.weight, model.h[0].ln_1.weight):
            first, second = _gather(p.grad)
            assert torch.equal(first, second), f"sp={sp}: replicated gradients must agree"
    return "ok"


def test_dropout_seeds_shards_apart_and_replicas_alike():
    assert launch(_dropout_body, 2, timeout=90.0, quiet=True, threads=1) == ["ok"] * 2
