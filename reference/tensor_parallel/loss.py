"""The vocabulary split across the TP group: embedding in, cross-entropy out.

The token embedding (V, C), the output layer C -> V and the logits (B, T, V) are a small
GPT's largest matrices and activation. Megatron splits the vocabulary: rank r holds token
ids [r V_pad / tp, (r+1) V_pad / tp), V_pad being V rounded up to a multiple of tp (the
padding rows are zero: no id reaches them, and the loss leaves their logits out).
`VocabParallelEmbedding` looks up the ids of its block (zeros elsewhere) and g sums over the
ranks. `vocab_parallel_cross_entropy` never assembles the (B, T, V) logits: per token

    loss = log(sum_v exp(z_v - m)) - (z_target - m),     m = max_v z_v

and each piece is a reduction over the vocabulary, which one all-reduce finishes:

    m          all-reduce MAX of the local maxima         (B * T floats)
    z_target   all-reduce SUM; only the owner contributes (B * T floats)
    sum exp    all-reduce SUM of the local sums           (B * T floats)

instead of an all-gather of B * T * V. Backward needs no communication:
d loss / d z_v = softmax_v - [v = target], and each rank holds the softmax of its columns.
Targets equal to ``ignore_index`` count as in `F.cross_entropy` (loss 0, gradient 0, left out
of the mean; every rank holds the same targets, so the count needs no communication); Megatron-LM's
version has none, its caller masks the per-token losses with a ``loss_mask``. As in Megatron-LM
the max, the exponentials, their sums and the all-reduces run in fp32 whatever the logits' dtype
(a sum of V exponentials computed in bf16 is off in the third significant digit, as notebook 03
measures); the loss is fp32, the gradient in the logits' dtype.

With tied weights the output layer, `VocabParallelLMHead`, shares this rank's embedding shard
(one Parameter, one gradient); it knows the true V, scores its own logits (`loss`) and
gathers them whole for sampling (`gather`: every rank must draw the same next token).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference import comms
from reference.tensor_parallel.comms import (
    gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
)
from reference.tensor_parallel.cut import record_cut
from reference.tensor_parallel.layers import ColumnParallelLinear, check_init_seed

__all__ = ["VocabParallelEmbedding", "VocabParallelLMHead", "vocab_parallel_cross_entropy",
           "VocabParallelCrossEntropy", "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """V rounded up to a multiple of tp, so every rank holds the same number of ids."""
    return -(-vocab_size // tp) * tp


def _check_ids(ids: torch.Tensor, vocab_size: int, what: str, ignore_index: int | None = None) -> None:
    real = ids if ignore_index is None else ids[ids != ignore_index]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
        allowed = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
        raise ValueError(f"{what} must lie in [0, {vocab_size}){allowed}, got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")


class VocabParallelEmbedding(nn.Module):
    """Token ids (B, T) -> embeddings (B, T, C), this rank holding V_pad / tp rows of the table.

    Built directly: this rank's rows of ``torch.manual_seed(seed); nn.Embedding(V, C)`` (master-weight init)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group, seed: int = 0,
                 perform_initialization: bool = True):
        super().__init__()
        check_init_seed("VocabParallelEmbedding", seed)
        tp, tp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.tp = group, tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, tp)
        per_rank = self.num_embeddings_padded // tp
        self.vocab_start_index = tp_rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))  # (V_pad / tp, C)
        if perform_initialization:  # False: left empty, for `from_dense` to copy into
            full = torch.empty(num_embeddings, embedding_dim)  # (V, C), only for this constructor
            nn.init.normal_(full, generator=torch.Generator().manual_seed(seed))  # nn.Embedding's N(0, 1)
            self.copy_shard(full)
        record_cut(self.weight, 0, tp, tp_rank, self.num_embeddings_padded, real=num_embeddings)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group) -> "VocabParallelEmbedding":
        """This rank's rows of `embedding`'s table, copied (padding rows zero)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, perform_initialization=False)
        layer.copy_shard(embedding.weight)
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        return layer.to(embedding.weight.device)

    @torch.no_grad()
    def copy_shard(self, table: torch.Tensor) -> None:
        """Copy in this rank's rows of a dense table (V, C); the padding rows (ids >= V) stay zero."""
        rows = table[self.vocab_start_index:self.vocab_end_index]
        self.weight.zero_()
        self.weight[: rows.shape[0]].copy_(rows)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _check_ids(idx, self.num_embeddings, "token ids")
        outside = (idx < self.vocab_start_index) | (idx >= self.vocab_end_index)  # (B, T)
        local = (idx - self.vocab_start_index).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight)  # (B, T, C), rows of other ranks' ids wrong ...
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)  # ... so zeroed
        return reduce_from_tensor_parallel_region(emb, self.group)  # g: each id found on one rank

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.num_embeddings_padded}, this rank "
                f"[{self.vocab_start_index}, {self.vocab_end_index})), {self.embedding_dim}, tp={self.tp}")


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, ignore_index):
        # logits (N, V_local): this rank's columns, any float dtype; targets (N,) global ids.
        ctx.dtype = logits.dtype
        z = logits.to(torch.float32, copy=True)  # Megatron's upcast: every reduction in fp32
        v_local = z.shape[-1]
        pad_from = vocab_size - vocab_start  # local index of the first padding column
        if pad_from < v_local:
            z[:, max(0, pad_from):] = float("-inf")  # padding is not part of the vocabulary

        m = z.max(dim=-1).values  # (N,)
        comms.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z -= m.unsqueeze(-1)  # shifted: exp never overflows

        valid = targets != ignore_index  # (N,): the same on every rank
        mine = valid & (targets >= vocab_start) & (targets < vocab_start + v_local)  # (N,)
        local_t = (targets - vocab_start).masked_fill(~mine, 0)
        z_target = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        comms.all_reduce(z_target, group=group)  # only the owner of each target adds a term

        exp = z.exp_()  # (N, V_local) fp32, in place: the shifted logits are no longer needed
        sum_exp = exp.sum(dim=-1)
        comms.all_reduce(sum_exp, group=group)

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # this rank's columns of the softmax
        ctx.save_for_backward(softmax, mine, local_t, valid)
        return (sum_exp.log() - z_target).masked_fill(~valid, 0.0)  # (N,) fp32; 0 where ignored

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss (N,)
        softmax, mine, local_t, valid = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[mine], local_t[mine]] -= 1.0  # softmax - one_hot(target), on the owner's columns
        grad *= (grad_loss * valid).unsqueeze(-1)  # an ignored row gets no gradient
        return grad.to(ctx.dtype), None, None, None, None, None  # back in the logits' dtype


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_size: int | None = None, reduction: str = "mean",
                                 ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits (.., V_pad / tp) against global target ids (..).

    `vocab_size` is the true V when V_pad > V (default: no padding). ``reduction``: "mean" over the
    counted tokens (as `reference.model.lm_loss`; NaN when all are ignored), "sum", or "none" (0 where
    ignored). The same fp32 value on every rank of the group.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    tp, tp_rank = dist.get_world_size(group), dist.get_rank(group)
    v_local = logits_shard.shape[-1]
    if vocab_size is None:
        vocab_size = v_local * tp
    if padded_vocab_size(vocab_size, tp) != tp * v_local:
        raise ValueError(f"vocab_size={vocab_size} on tp={tp} ranks pads to "
                         f"{padded_vocab_size(vocab_size, tp)} columns, but the logits have "
                         f"{v_local} per rank ({tp * v_local} in all)")
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and targets {tuple(targets.shape)} "
                         f"must agree on every dimension but the last")
    _check_ids(targets, vocab_size, "targets", ignore_index)
    losses = VocabParallelCrossEntropy.apply(
        logits_shard.reshape(-1, v_local), targets.reshape(-1), group, tp_rank * v_local,
        vocab_size, ignore_index)
    losses = losses.view(targets.shape)  # fp32
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()  # over the counted tokens (an ignored one's loss is 0)
    return losses.sum() / (targets != ignore_index).sum()  # the mean over the counted tokens


class VocabParallelLMHead(ColumnParallelLinear):
    """The output layer C -> V, column-parallel over the vocabulary: (.., C) -> logits (.., V_pad / tp).

    Its rows past V (the padding) are zero. Build it with `from_dense_head`."""

    vocab_size: int

    @classmethod
    def from_dense_head(cls, linear: nn.Linear, group, *, sequence_parallel: bool = False,
                        regather_input: bool = False) -> "VocabParallelLMHead":
        """This rank's vocabulary block of the dense `linear` (C -> V), padded to V_pad."""
        vocab = linear.out_features
        padded = nn.Linear(linear.in_features, padded_vocab_size(vocab, dist.get_world_size(group)),
                           bias=linear.bias is not None, device=linear.weight.device)
        with torch.no_grad():
            for name, dense in linear.named_parameters():
                pad = getattr(padded, name)
                pad.zero_()
                pad[:vocab].copy_(dense)
                pad.requires_grad_(dense.requires_grad)
        head = cls.from_dense(padded, group, gather_output=False, sequence_parallel=sequence_parallel,
                              regather_input=regather_input)
        head.vocab_size = vocab
        for p in head.parameters(recurse=False):  # the rows past V are padding
            record_cut(p, 0, head.tp, head.tp_rank, p.tp_cut.whole, real=vocab)
        return head

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
             reduction: str = "mean") -> torch.Tensor:
        """`vocab_parallel_cross_entropy` of this head's logits (.., V_pad / tp): 0-dim, fp32."""
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_size,
                                            reduction=reduction, ignore_index=ignore_index)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """(.., V_pad / tp) -> the whole logits (.., V), padding dropped: one all-gather of them."""
        return gather_from_tensor_parallel_region(logits, self.group)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, " + super().extra_repr()
