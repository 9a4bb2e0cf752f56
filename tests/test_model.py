"""The single-process GPT: shapes, causality, tied weights, parameter count, the ffn slot."""

import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn as nn

import reference.model as model_module
from reference.data import synthetic_batch
from reference.model import GPT, MLP, Block, GPTConfig, lm_loss
from reference.tolerance import exact, forward

TINY = GPTConfig.tiny()
TOL = forward()  # fp32: the same numbers added in another order (reference.tolerance)


def tiny_model(seed=0, **overrides):
    return GPT.from_config_seed(GPTConfig.tiny(**overrides), seed)


def test_forward_shapes():
    model = tiny_model()
    x, y = synthetic_batch(3, TINY.block_size, seed=1)
    logits, loss = model(x, y)
    assert logits.shape == (3, TINY.block_size, TINY.vocab_size)
    assert loss.shape == ()
    # Shorter sequences than block_size work too, and no targets means no loss.
    logits, loss = model(x[:, :7])
    assert logits.shape == (3, 7, TINY.vocab_size)
    assert loss is None and model.last_lm_loss is None


def test_sequence_longer_than_block_size_is_rejected():
    model = tiny_model()
    idx = torch.zeros(1, TINY.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size"):
        model(idx)


def test_config_validation_names_both_sizes():
    with pytest.raises(ValueError, match=r"n_embd=30.*n_head=4"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)


def test_config_defaults_and_presets():
    assert GPTConfig().vocab_size == 256
    assert GPTConfig(n_embd=64, n_head=4).d_ff == 256  # 4 * n_embd
    assert GPTConfig(n_embd=64, n_head=4, d_ff=100).d_ff == 100
    assert GPTConfig.tiny(n_layer=3).n_layer == 3
    small = GPTConfig.small()
    assert (small.n_layer, small.n_head, small.n_embd, small.block_size) == (4, 4, 128, 128)


def test_causal_masking():
    model = tiny_model()
    x, _ = synthetic_batch(2, TINY.block_size, seed=2)
    t = 10
    changed = x.clone()
    changed[:, t] = (changed[:, t] + 1) % TINY.vocab_size
    logits, _ = model(x)
    logits_changed, _ = model(changed)
    # Positions before t cannot see token t.
    torch.testing.assert_close(logits_changed[:, :t], logits[:, :t], **TOL)
    # Position t and later do see it (so the check above can fail).
    assert (logits_changed[:, t:] - logits[:, t:]).abs().amax(dim=-1).min() > 1e-4


def test_weight_tying_shares_one_tensor():
    model = tiny_model()
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    params = list(model.parameters())
    assert sum(p is model.wte.weight for p in params) == 1  # one tensor, one optimizer entry

    # Inputs use only tokens 0..9, so the embedding lookup gives gradient to
    # rows 0..9 only; rows 10.. get gradient only through the output layer.
    # With tying, that output gradient lands in the same tensor.
    idx = torch.randint(0, 10, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, targets)
    loss.backward()
    assert model.lm_head.weight.grad is model.wte.weight.grad
    assert model.wte.weight.grad[10:].abs().sum() > 0

    untied = tiny_model(tie_weights=False)
    assert untied.lm_head.weight is not untied.wte.weight
    _, loss = untied(idx, targets)
    loss.backward()
    assert untied.wte.weight.grad[10:].abs().sum() == 0
    assert untied.lm_head.weight.grad[10:].abs().sum() > 0


def expected_num_parameters(c: GPTConfig) -> int:
    C, F, V, L = c.n_embd, c.d_ff, c.vocab_size, c.n_layer
    embeddings = V * C + c.block_size * C  # wte, wpe
    per_block = (
        2 * C  # ln_1 gain and bias
        + (C * 3 * C + 3 * C)  # attn.c_attn
        + (C * C + C)  # attn.c_proj
        + 2 * C  # ln_2
        + (C * F + F)  # ffn.c_fc
        + (F * C + C)  # ffn.c_proj
    )
    ln_f = 2 * C
    lm_head = 0 if c.tie_weights else V * C  # no bias; tied means it is wte
    return embeddings + L * per_block + ln_f + lm_head


def test_parameter_count_matches_formula():
    model = tiny_model()
    # tiny: C=32, F=128, V=256, T=32, L=2:
    # 8192 + 1024 + 2 * (64 + 3168 + 1056 + 64 + 4224 + 4128) + 64 = 34688
    assert model.num_parameters() == expected_num_parameters(TINY) == 34688
    assert model.num_parameters(exclude_embeddings=True) == 34688 - 256 * 32 - 32 * 32

    untied = tiny_model(tie_weights=False)
    untied_cfg = GPTConfig.tiny(tie_weights=False)
    assert untied.num_parameters() == expected_num_parameters(untied_cfg) == 34688 + 256 * 32
    assert untied.num_parameters(exclude_embeddings=True) == 34688 - 256 * 32 - 32 * 32


def test_init_is_gpt2_style():
    cfg = GPTConfig.small()
    model = GPT.from_config_seed(cfg, 0)
    # Standard errors of the sample std are ~0.1% here, far inside these bounds.
    assert model.h[0].ffn.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert model.h[0].attn.c_proj.weight.std().item() == pytest.approx(proj_std, rel=0.05)
    assert model.h[0].ffn.c_proj.weight.std().item() == pytest.approx(proj_std, rel=0.05)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.h[0].attn.c_attn.bias.abs().sum() == 0
    assert torch.equal(model.ln_f.weight, torch.ones(cfg.n_embd))


def test_same_seed_same_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = tiny_model(seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = tiny_model(seed=7)
    c = tiny_model(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["h.0.attn.c_attn.weight"], sc["h.0.attn.c_attn.weight"])
    # Seeding the global RNG by hand gives the same model.
    torch.manual_seed(7)
    d = GPT(TINY)
    assert all(torch.equal(sa[k], v) for k, v in d.state_dict().items())


class ToyFFN(nn.Module):
    """A stand-in for a mixture of experts: scales its input and reports an aux loss."""

    def __init__(self, config, layer_index):
        super().__init__()
        self.layer_index = layer_index
        self.scale = nn.Parameter(torch.tensor(0.5 + layer_index))

    def forward(self, x):
        return x * self.scale, self.scale**2  # (B, T, C), 0-dim aux loss


def test_ffn_slot_with_aux_loss():
    seen = []

    def factory(config, layer_index):
        seen.append(layer_index)
        return ToyFFN(config, layer_index)

    model = GPT.from_config_seed(TINY, 0, ffn_factory=factory)
    assert seen == list(range(TINY.n_layer))
    assert [block.ffn.layer_index for block in model.h] == seen

    x, y = synthetic_batch(2, 16, seed=3)
    logits, loss = model(x, y)
    expected_aux = sum((0.5 + i) ** 2 for i in range(TINY.n_layer))  # 0.25 + 2.25
    lm = lm_loss(logits, y)
    torch.testing.assert_close(model.last_aux_loss, torch.tensor(expected_aux), **TOL)
    torch.testing.assert_close(model.last_lm_loss, lm.detach(), **TOL)
    torch.testing.assert_close(loss, lm + expected_aux, **TOL)
    assert not model.last_lm_loss.requires_grad and not model.last_aux_loss.requires_grad

    # Without targets there is no loss, but the aux losses are still collected.
    _, no_loss = model(x)
    assert no_loss is None and model.last_lm_loss is None
    assert model.last_aux_loss.item() == pytest.approx(expected_aux, rel=1e-6)

    # The non-ffn weights match the dense model built from the same seed.
    dense = tiny_model(seed=0)
    dense_state = dense.state_dict()
    for k, v in model.state_dict().items():
        if ".ffn." not in k:
            assert torch.equal(v, dense_state[k]), k


def test_aux_loss_gradient_reaches_the_ffn():
    model = GPT.from_config_seed(TINY, 0, ffn_factory=ToyFFN)
    x, y = synthetic_batch(2, 16, seed=4)
    _, loss = model(x, y)
    loss.backward()  # lm loss + aux losses
    grads_total = [b.ffn.scale.grad.clone() for b in model.h]

    model.zero_grad()
    logits, _ = model(x)
    lm_loss(logits, y).backward()
    grads_lm = [b.ffn.scale.grad.clone() for b in model.h]
    for i, (g_total, g_lm) in enumerate(zip(grads_total, grads_lm)):
        scale = 0.5 + i
        # a difference of two gradients of the size of g_total: the atol grows with them
        torch.testing.assert_close(g_total - g_lm, torch.tensor(2 * scale),
                                   **TOL.at_scale(max(1.0, g_total.abs().item())))


def test_dense_block_returns_zero_aux_loss():
    block = Block(TINY)
    assert isinstance(block.ffn, MLP)
    x = torch.randn(2, 5, TINY.n_embd)
    out, aux = block(x)
    assert out.shape == x.shape and aux.shape == () and aux.item() == 0.0
    model = tiny_model()
    model(synthetic_batch(1, 8)[0])
    assert model.last_aux_loss.item() == 0.0


def head_shard(attn, first_head, n_heads):
    """An attention module holding only heads [first_head, first_head + n_heads) of ``attn``."""
    C, hd = TINY.n_embd, TINY.head_dim
    cols = torch.arange(first_head * hd, (first_head + n_heads) * hd)  # this shard's channels of q (and k, v)
    rows = torch.cat([cols, C + cols, 2 * C + cols])  # its rows of c_attn's [q | k | v] output
    shard = model_module.CausalSelfAttention(TINY)
    shard.c_attn = nn.Linear(C, 3 * len(cols))
    shard.c_proj = nn.Linear(len(cols), C, bias=False)
    with torch.no_grad():
        shard.c_attn.weight.copy_(attn.c_attn.weight[rows])
        shard.c_attn.bias.copy_(attn.c_attn.bias[rows])
        shard.c_proj.weight.copy_(attn.c_proj.weight[:, cols])
    return shard


def test_attention_runs_with_a_subset_of_heads():
    # A tensor-parallel shard keeps 3 * C // tp rows of c_attn and C // tp
    # input columns of c_proj; the forward reads its head count from the width.
    attn = model_module.CausalSelfAttention(TINY)
    x = torch.randn(2, 9, TINY.n_embd, generator=torch.Generator().manual_seed(0))
    half = TINY.n_head // 2
    # Megatron's row-parallel c_proj: partial outputs summed, bias added once.
    combined = head_shard(attn, 0, half)(x) + head_shard(attn, half, half)(x) + attn.c_proj.bias
    torch.testing.assert_close(combined, attn(x), **TOL)


def test_generate():
    model = tiny_model()
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 40, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 43)  # 43 > block_size: the context is cropped
    assert torch.equal(out[:, :3], prompt)
    assert 0 <= out.min() and out.max() < TINY.vocab_size
    again = model.generate(prompt, 40, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    greedy = model.generate(prompt, 5, temperature=0)
    logits, _ = model(prompt)
    assert greedy[0, 3] == logits[0, -1].argmax()
    assert model.training  # mode restored


def test_dropout_only_in_training_mode():
    model = tiny_model(dropout=0.5)
    x, _ = synthetic_batch(1, 8)
    model.eval()
    torch.testing.assert_close(model(x)[0], model(x)[0], **exact())
    model.train()
    assert not torch.equal(model(x)[0], model(x)[0])


def test_config_replace_keeps_resolved_d_ff():
    # Documented behaviour: d_ff is resolved at creation, replace() keeps it.
    cfg = dataclasses.replace(TINY, n_embd=64)
    assert cfg.d_ff == TINY.d_ff
    assert dataclasses.replace(TINY, n_embd=64, d_ff=None).d_ff == 256


def test_model_source_does_not_use_torch_distributed():
    source = inspect.getsource(model_module)
    assert "torch.distributed" not in source
    assert "import reference" not in source and "from reference" not in source
