"""The vocabulary-parallel cross-entropy against `F.cross_entropy` on the whole logits.

* ``ignore_index``: targets equal to -100 (the dense loss's default) are left out of
  the mean and get a zero gradient row, on every rank, for ``reduction="mean"`` and
  ``"none"``; a whole TP GPT trained on such targets has the dense model's loss and
  gradients.
* Precision: bf16 logits are reduced in fp32 (Megatron's upcast). The loss equals the
  fp32 loss of the same bf16 values to fp32 rounding, far tighter than a bf16
  computation of the same three reductions; the gradient comes back in bf16.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.mesh import Mesh
from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.tensor_parallel import (
    apply_tensor_parallel, padded_vocab_size, vocab_parallel_cross_entropy,
)
from reference.tolerance import forward, gradient, loss

# fp32: the same sums in another order (reference.tolerance): a loss `loss()`, the logits'
# gradient `forward()` (one pass over the same sums), a gradient summed over the ranks `gradient(n)`.
TOL, LOSS = forward(), loss()
V = 251  # prime: padded to 252 on 2 and 4 ranks
N = 24   # rows (tokens)


def _padded_shard(logits, r, n):
    """Rank r's columns of (N, V) logits padded to V_pad with a large value (it must be ignored)."""
    pad = logits.new_full((logits.shape[0], padded_vocab_size(V, n) - V), 30.0)
    return torch.cat([logits, pad], dim=1).chunk(n, dim=1)[r]


def _targets(seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (N,), generator=g)
    t[::3] = -100            # a third of the rows ignored, on every rank's ids
    t[1] = V - 1             # the last real id, next to the padding
    return t


def _ignore_index_body():
    group, r, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(0))
    targets = _targets()
    dense = logits.clone().requires_grad_()
    expected = F.cross_entropy(dense, targets)  # ignore_index=-100 by default
    expected.backward()
    shard = _padded_shard(logits, r, n).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, targets, group, vocab_size=V)
    loss.backward()
    LOSS.assert_close(loss, expected, "loss")
    grad = _padded_shard(dense.grad, r, n).clone()
    grad[:, max(0, V - r * shard.shape[1]):] = 0  # the padding columns get no gradient
    torch.testing.assert_close(shard.grad, grad, **TOL)
    assert shard.grad[targets == -100].abs().max() == 0, "ignored rows must get a zero gradient"

    # reduction="none": zero loss on ignored rows, as F.cross_entropy
    per_token = vocab_parallel_cross_entropy(shard.detach(), targets, group, vocab_size=V,
                                             reduction="none")
    torch.testing.assert_close(per_token, F.cross_entropy(logits, targets, reduction="none"), **TOL)
    # another ignore_index, a real token id: left out like any other
    other = vocab_parallel_cross_entropy(shard.detach(), targets.clamp(min=0), group, vocab_size=V,
                                         ignore_index=0)
    torch.testing.assert_close(other, F.cross_entropy(logits, targets.clamp(min=0), ignore_index=0), **TOL)
    # every row ignored: 0 / 0, NaN, as F.cross_entropy
    none_left = torch.full((N,), -100)
    assert torch.isnan(vocab_parallel_cross_entropy(shard.detach(), none_left, group, vocab_size=V))
    assert torch.isnan(F.cross_entropy(logits, none_left))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 251\) or equal "
                                         r"ignore_index=-100, got values in \[-100, 251\]"):
        vocab_parallel_cross_entropy(shard, torch.cat([targets[:-1], torch.tensor([V])]), group,
                                     vocab_size=V)

    # A whole TP GPT on targets with ignored positions: the dense model's loss and grads.
    mesh = Mesh(tp=n).build_groups()
    cfg = GPTConfig.tiny(vocab_size=V, block_size=8)
    dense_model = GPT.from_config_seed(cfg, 0)
    tp_model = apply_tensor_parallel(copy.deepcopy(dense_model), mesh)
    idx = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(3))
    y[:, :3] = -100  # e.g. a prompt that is not trained on
    _, loss_d = dense_model(idx, y)
    _, loss_t = tp_model(idx, y)
    loss_d.backward()
    loss_t.backward()
    LOSS.assert_close(loss_t, loss_d, "the GPT's loss")
    gradient(n).assert_close(tp_model.wpe.weight.grad, dense_model.wpe.weight.grad, "wpe's gradient")
    return "ok"


@pytest.mark.parametrize("tp", [2, 4])
def test_ignore_index_equals_cross_entropy(tp):
    assert launch(_ignore_index_body, tp, timeout=90.0, quiet=True, threads=1) == ["ok"] * tp


def _bf16_three_reductions(logits, targets):
    """The three reductions of the loss carried out in bf16, as a bf16 computation would."""
    m = logits.max(dim=-1, keepdim=True).values
    z = logits - m                                   # bf16
    sum_exp = z.exp().sum(dim=-1)                    # bf16 sum over V terms
    return (sum_exp.log() - z.gather(1, targets[:, None]).squeeze(1)).mean()


def _bf16_body():
    group, r, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    # Logits of a trained model's size (std 4): the sum of exponentials spans many
    # orders of magnitude, where bf16's 8 significant bits lose the most.
    logits = (4 * torch.randn(N, V, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    targets = _targets().clamp(min=0)
    exact = logits.float().requires_grad_()       # the same bf16 values, in fp32
    expected = F.cross_entropy(exact, targets)
    expected.backward()
    shard = _padded_shard(logits, r, n).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, targets, group, vocab_size=V)
    loss.backward()
    # Computed in fp32 from the exact same values: fp32 rounding only.
    LOSS.assert_close(loss.float(), expected, "bf16 logits, fp32 loss")
    assert loss.dtype == torch.float32, "the loss is returned in fp32"
    assert shard.grad.dtype == torch.bfloat16, "the gradient flows back in the logits' dtype"
    # The gradient is computed in fp32 and rounded once to bf16: within the course's bf16
    # bound (one rounding of the result, reference.tolerance) of the fp32 gradient, for
    # values of the size of its largest entry (at most 1/N: a mean over N rows).
    grad = _padded_shard(exact.grad, r, n).float()
    grad[:, max(0, V - r * shard.shape[1]):] = 0
    bf16 = forward(torch.bfloat16).at_scale(exact.grad.abs().max().item())
    bf16.assert_close(shard.grad.float(), grad, "bf16 logits' gradient")
    # What the same reductions cost in bf16 (the loss computed in the logits' dtype):
    # about 1e-2 here, some 80 times the tolerance above.
    bf16_error = (_bf16_three_reductions(logits, targets).float() - expected).abs().item()
    fp32_error = (loss - expected).abs().item()
    assert bf16_error > 50 * (TOL.atol + TOL.rtol * expected.abs().item()), bf16_error
    return fp32_error, bf16_error


def test_bf16_logits_are_reduced_in_fp32():
    results = launch(_bf16_body, 2, timeout=90.0, quiet=True, threads=1)
    for fp32_error, bf16_error in results:
        assert fp32_error < bf16_error / 100
