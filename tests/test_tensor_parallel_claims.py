"""The claims notebook 03 (tensor parallelism) makes, measured.

* Activation memory per rank of one block, in bytes, equals the notebook's formula
  for TP, TP + SP and TP + SP with regathering, at tp = 1, 2, 4.
* Without f the input gradient of the parallel MLP is only this rank's term (the
  terms add up to the dense gradient); with f it is the dense gradient. The MLP
  sends one all-reduce of the activation forward and one backward.
* The vocabulary-parallel loss sends 3 all-reduces of B * T floats forward, nothing
  backward: V_pad / 6 times fewer bytes than a ring all-gather of the logits.
* A block has 12 C^2 + 13 C parameters and its weight GEMMs cost 72 C^2 flops per
  token, forward and backward (the numbers the TP-versus-DP comparison uses).

The per-block communication counts (with and without SP, and with regathering)
are measured in tests/test_tensor_parallel_gpt.py.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from reference import comms
from reference.mesh import Mesh
from reference.model import GPT, MLP, Block, GPTConfig
from reference.runtime import launch
from reference.tensor_parallel import (
    apply_tensor_parallel, f, g, padded_vocab_size, vocab_parallel_cross_entropy,
)
from reference.tolerance import forward, gradient

TOL = forward()  # fp32: the same sums in another order (reference.tolerance)
CFG = GPTConfig.tiny(block_size=16)  # C = 32, 4 heads, d_ff = 4C: the notebook's model
B, T, C = 2, CFG.block_size, CFG.n_embd
S = B * T * C * 4  # one fp32 activation (B, T, C)


def saved_activation_bytes(module, x):
    """Bytes of the distinct storages autograd saves in module(x), parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(kept.values())


def activation_formula(mode, t):
    """The notebook's table: s = B T x 4 (a LayerNorm statistic), ℓ = B n_head T x 4 (log-sum-exp)."""
    s, lse = B * T * 4, B * CFG.n_head * T * 4
    return {"dense": 16 * S + 4 * s + lse,
            "TP": 4 * S + 4 * s + (12 * S + lse) / t,
            "TP+SP": 2 * S + (14 * S + 4 * s + lse) / t,
            "TP+SP, regather": (16 * S + 4 * s + lse) / t}[mode]


MODES = {"TP": (False, False), "TP+SP": (True, False), "TP+SP, regather": (True, True)}


def _check_activation_memory(mesh):
    torch.manual_seed(1)
    x = torch.randn(B, T, C)
    for mode, (sp, regather) in MODES.items():
        model = apply_tensor_parallel(GPT.from_config_seed(CFG, 0), mesh, sequence_parallel=sp,
                                      regather_input=regather)
        xin = x.chunk(mesh.tp, dim=1)[mesh.tp_rank].clone() if sp else x
        got = saved_activation_bytes(model.h[0], xin.requires_grad_())
        assert got == activation_formula(mode, mesh.tp), (mode, mesh.tp, got / S)


def _parallel_mlp(x, mlp, group, enter):
    """The notebook's from-scratch MLP: column shard of c_fc, row shard of c_proj, g to leave."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    A_r, a_r = mlp.c_fc.weight.chunk(n, dim=0)[r], mlp.c_fc.bias.chunk(n)[r]
    B_r = mlp.c_proj.weight.chunk(n, dim=1)[r]
    h = F.gelu(F.linear(enter(x), A_r, a_r))  # (B, T, 4C / n)
    return g(F.linear(h, B_r), group) + mlp.c_proj.bias  # (B, T, C)


def _check_f_is_needed(group):
    torch.manual_seed(0)
    mlp, x, w = MLP(CFG), torch.randn(B, T, C), torch.randn(B, T, C)
    x_dense = x.clone().requires_grad_()
    (mlp(x_dense) * w).sum().backward()
    grads = {}
    for use_f in (False, True):
        xt = x.clone().requires_grad_()
        enter = (lambda t: f(t, group)) if use_f else (lambda t: t)
        with comms.meter() as fwd:
            out = _parallel_mlp(xt, mlp, group, enter)
        with comms.meter() as bwd:
            (out * w).sum().backward()
        torch.testing.assert_close(out, mlp(x), **TOL)
        grads[use_f] = xt.grad
        # g forward; f backward when present
        assert (fwd.calls(), fwd.payload_bytes("all_reduce")) == (1, S)
        assert (bwd.calls(), bwd.payload_bytes("all_reduce")) == ((1, S) if use_f else (0, 0))
    grad_tol = gradient(dist.get_world_size(group))  # the input gradient: summed over the ranks
    grad_tol.assert_close(grads[True], x_dense.grad, "input gradient with f")
    assert not grad_tol.close(grads[False], x_dense.grad), "without f the gradient is partial"
    summed = grads[False].clone()
    dist.all_reduce(summed, group=group)
    grad_tol.assert_close(summed, x_dense.grad, "the ranks' terms summed")


def _check_vocab_loss_bytes(group, n):
    vocab = 251  # prime: padded on 2 and 4 ranks
    v_pad = padded_vocab_size(vocab, n)
    torch.manual_seed(0)
    logits = torch.randn(B * T, v_pad)
    targets = torch.randint(0, vocab, (B * T,))
    shard = logits.chunk(n, dim=1)[dist.get_rank(group)].clone().requires_grad_()
    with comms.meter() as fwd:
        loss = vocab_parallel_cross_entropy(shard, targets, group, vocab_size=vocab)
    with comms.meter() as bwd:
        loss.backward()
    assert shard.grad is not None and bwd.calls() == 0, "backward needs no communication"
    assert (fwd.calls(), fwd.calls("all_reduce")) == (3, 3)
    assert fwd.payload_bytes() == 3 * B * T * 4
    sent = fwd.sent_bytes()
    assert sent == 3 * 2 * (n - 1) * (B * T * 4) // n
    gather = (n - 1) * (B * T * v_pad * 4) // n  # a ring all-gather of the (B T, V_pad) logits
    assert gather * 6 == sent * v_pad


def _claims_body():
    n = dist.get_world_size()
    mesh = Mesh(tp=n).build_groups()
    _check_activation_memory(mesh)
    _check_vocab_loss_bytes(mesh.group("tp"), n)
    if n == 2:
        _check_f_is_needed(mesh.group("tp"))
    return "ok"


@pytest.mark.parametrize("tp", [2, 4])
def test_notebook_claims_measured_on_ranks(tp):
    assert launch(_claims_body, tp, timeout=90.0, quiet=True, threads=1) == ["ok"] * tp


def test_dense_block_memory_parameters_and_flops():
    block = GPT.from_config_seed(CFG, 0).h[0]
    assert saved_activation_bytes(block, torch.randn(B, T, C, requires_grad=True)) == activation_formula("dense", 1)
    block = Block(CFG)
    assert sum(p.numel() for p in block.parameters()) == 12 * C * C + 13 * C
    with FlopCounterMode(display=False) as counter:
        block(torch.randn(B, T, C, requires_grad=True))[0].sum().backward()
    # The six weight GEMMs: 2 x 12 C^2 per token forward, twice that backward
    # (the attention products are not counted by FlopCounterMode on CPU).
    assert counter.get_total_flops() == 72 * C * C * B * T
    # The counter sees no flops in the CPU's fused attention kernel, and 4 B T^2 C in the same
    # two products written out: the count above is the weight products alone.
    q = torch.randn(B, CFG.n_head, T, C // CFG.n_head)
    with FlopCounterMode(display=False) as fused:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with FlopCounterMode(display=False) as written:
        (q @ q.transpose(-2, -1)).softmax(dim=-1) @ q
    assert fused.get_total_flops() == 0 and written.get_total_flops() == 4 * B * T * T * C


def test_megatron_masked_mean_as_its_source_divides():
    """tp23: Megatron's pipeline schedule divides the masked sum by the mask's sum per micro-batch;
    with --calculate-per-token-loss it does not, and finalize_model_grads divides the gradients by
    the whole step's tokens (megatron/core/pipeline_parallel/schedules.py, finalize_model_grads.py)."""
    from notebook_cells import ROOT, source
    text = " ".join(source(ROOT / "notebooks" / "03_tensor_parallel.ipynb", "tp23").split())
    assert "or over the whole step with `--calculate-per-token-loss`" not in text
    assert "`finalize_model_grads` divides the gradients by the tokens of the whole step" in text
