"""The plan that turns the plain GPT into its tensor-parallel version, from outside.

`apply_tensor_parallel(model, mesh)` swaps modules following `TP_PLAN` (and `SP_PLAN` with
sequence parallelism) and leaves the model's forward as it is: two hooks adapt what it returns.
`allreduce_sequence_parallel_grads` sums the gradients of the parameters that see only this
rank's tokens under SP.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from reference import comms
from reference.model import MLP, GPT
from reference.tensor_parallel.comms import SEQ_DIM, scatter_to_sequence_parallel_region
from reference.tensor_parallel.attention import ParallelCausalSelfAttention
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.loss import VocabParallelEmbedding, VocabParallelLMHead
from reference.tensor_parallel.rng import ShardedDropout, TensorParallelRNG

__all__ = ["apply_tensor_parallel", "allreduce_sequence_parallel_grads", "TP_PLAN", "SP_PLAN",
           "SequenceParallelScatter"]

# What each module of reference.model.GPT becomes; "*" stands for one block index.
TP_PLAN: tuple[tuple[str, str], ...] = (
    ("wte", "vocab_embedding"),     # token rows split; g sums the one rank that has each id
    ("h.*.attn", "attention"),      # heads split: c_attn column (q|k|v by head), c_proj row
    ("h.*.ffn.c_fc", "column"),     # f, then X A_r
    ("h.*.ffn.c_proj", "row"),      # Y_r B_r, then g
    ("lm_head", "vocab_head"),      # column split over the vocabulary, wte's shard if tied
)

# Added with sequence_parallel=True: the regions between TP regions hold sequence shards.
SP_PLAN: tuple[tuple[str, str], ...] = (
    ("drop", "sequence_scatter"),   # the residual stream becomes (B, T // tp, C) here
    ("h.*.ln_1", "sequence_norm"),  # LayerNorm on this rank's tokens; grads summed over TP
    ("h.*.ln_2", "sequence_norm"),
    ("h.*.ffn.dropout", "sharded_dropout"),
    ("ln_f", "sequence_norm"),
)


class SequenceParallelScatter(nn.Module):
    """Enter the sequence-parallel region: (B, T, C) -> (B, T // tp, C), then dropout of the shard.

    In eval mode (generation grows T one token at a time) a T that tp does not divide is padded at
    the end with zeros: causal attention hides them from every real token, and the model's hook
    drops their logits. In training T must divide."""

    def __init__(self, group, dropout: nn.Module):
        super().__init__()
        self.group, self.dropout = group, dropout
        self.tp = torch.distributed.get_world_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = -x.shape[SEQ_DIM] % self.tp
        if pad and not self.training:
            x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=SEQ_DIM)  # (B, T_pad, C)
        return self.dropout(scatter_to_sequence_parallel_region(x, self.group))


@dataclass
class _Context:
    group: object
    tp: int
    sequence_parallel: bool
    regather_input: bool
    rng: TensorParallelRNG
    tied: bool
    embedding: VocabParallelEmbedding | None = None


def _vocab_embedding(m: nn.Embedding, c: _Context) -> nn.Module:
    c.embedding = VocabParallelEmbedding.from_dense(m, c.group)
    return c.embedding


def _vocab_head(m: nn.Linear, c: _Context) -> nn.Module:
    # The output layer C -> V_pad, split like the embedding; logits stay (B, T, V_pad / tp).
    head = VocabParallelLMHead.from_dense_head(m, c.group, sequence_parallel=c.sequence_parallel,
                                               regather_input=c.regather_input)
    if c.tied:
        head.weight = c.embedding.weight  # one Parameter: both uses add into its gradient
    return head


def _sequence_norm(m: nn.LayerNorm, c: _Context) -> nn.Module:
    for p in m.parameters():
        p.sequence_parallel = True  # found by allreduce_sequence_parallel_grads
    return m


# What each style of the plans builds from the dense module m.
STYLES: dict[str, Callable[[nn.Module, _Context], nn.Module]] = {
    "vocab_embedding": _vocab_embedding,
    "attention": lambda m, c: ParallelCausalSelfAttention.from_dense(
        m, c.group, sequence_parallel=c.sequence_parallel, regather_input=c.regather_input, rng=c.rng),
    "column": lambda m, c: ColumnParallelLinear.from_dense(
        m, c.group, gather_output=False, sequence_parallel=c.sequence_parallel, regather_input=c.regather_input),
    "row": lambda m, c: RowParallelLinear.from_dense(
        m, c.group, input_is_parallel=True, sequence_parallel=c.sequence_parallel),
    "vocab_head": _vocab_head,
    "sequence_scatter": lambda m, c: SequenceParallelScatter(c.group, ShardedDropout(m.p, c.rng)),
    "sequence_norm": _sequence_norm,
    "sharded_dropout": lambda m, c: ShardedDropout(m.p, c.rng),
}


def _check_divisible(model: GPT, mesh, sequence_parallel: bool = False,
                     experts_gathered: bool = False) -> None:
    cfg, tp = model.config, mesh.tp
    sizes = dict(n_head=cfg.n_head, n_embd=cfg.n_embd, d_ff=cfg.d_ff)
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(
            f"tensor parallelism tp={tp} must divide n_head={cfg.n_head}, n_embd={cfg.n_embd} and "
            f"d_ff={cfg.d_ff}; {', '.join(bad)} do not (mesh pp={mesh.pp}, dp={mesh.dp}, "
            f"tp={mesh.tp}, ep={mesh.ep}, world_size={mesh.world_size})")
    for i, block in enumerate(model.h):
        # A mixture of experts stays whole on every tp rank (expert parallelism, not TP, splits
        # it); under SP its router, which counts capacity per whole sequence, would see a shard.
        experts = getattr(block.ffn, "experts", None) is not None
        if experts and sequence_parallel and tp > 1 and not experts_gathered:
            raise ValueError(f"block {i} has a mixture of experts, which routes whole sequences, "
                             f"and sequence_parallel=True (tp={tp}) hands it a T/tp shard: gather "
                             f"the sequence for it (reference.expert_parallel."
                             f"sequence_parallel_experts, then experts_gathered=True; "
                             f"reference.parallel.parallelize does both) or use "
                             f"sequence_parallel=False")
        if not isinstance(block.ffn, MLP) and not experts:
            raise ValueError(f"apply_tensor_parallel splits the dense MLP; block {i} has an ffn of "
                             f"type {type(block.ffn).__name__}")


def _route_loss_to_vocab_parallel(model: GPT, c: _Context) -> None:
    """model(idx, targets) keeps working, and model.generate(...) samples what the dense model would.

    A pre-hook takes the targets from the dense forward (whose cross-entropy would see vocab
    shards) and a hook after it computes `vocab_parallel_cross_entropy`. In eval mode without
    targets the hook gathers the logits whole, (B, T, V): ranks sampling from their own shards
    would feed different ids to the embedding and drift apart silently."""
    held = {}

    def take_targets(module, args, kwargs):
        held["targets"] = args[1] if len(args) > 1 else kwargs.pop("targets", None)
        return args[:1], kwargs

    def vocab_parallel_loss(module, args, kwargs, output):
        targets = held.pop("targets", None)
        logits, _ = output
        T = (args[0] if args else kwargs["idx"]).shape[1]
        logits = logits[:, :T]  # drop the positions SequenceParallelScatter padded (eval only)
        if targets is None:
            return (logits if module.training else module.lm_head.gather(logits)), None
        loss = module.lm_head.loss(logits, targets)
        module.last_lm_loss = loss.detach()
        return logits, loss  # the dense ffn has no aux loss (checked in apply)

    model.register_forward_pre_hook(take_targets, with_kwargs=True)
    model.register_forward_hook(vocab_parallel_loss, with_kwargs=True)


def apply_tensor_parallel(model: GPT, mesh, sequence_parallel: bool = False, *,
                          regather_input: bool = False, seed: int = 0,
                          experts_gathered: bool = False) -> GPT:
    """Split `model` (a `reference.model.GPT`) in place across ``mesh.group("tp")``; returns it.

    Every rank of the TP group calls this on a model with the same weights. In training mode
    ``model(idx)`` then returns this rank's vocab shard of the logits, (B, T, V_pad / tp), and
    ``model(idx, targets)`` the dense model's loss; in eval mode ``model(idx)`` returns the whole
    logits, so ``model.generate(...)`` draws the dense model's tokens on every rank. With
    ``sequence_parallel=True`` call `allreduce_sequence_parallel_grads` after each backward.
    `seed` seeds the dropout stream of sharded regions (`rng`). A mixture of experts under SP is
    refused unless ``experts_gathered`` (`reference.expert_parallel.sequence_parallel_experts`).
    """
    if not isinstance(model, GPT):
        raise TypeError(f"apply_tensor_parallel expects a reference.model.GPT, got {type(model).__name__}")
    _check_divisible(model, mesh, sequence_parallel, experts_gathered)
    if mesh.tp == 1:
        return model
    device = model.wte.weight.device
    c = _Context(group=mesh.group("tp"), tp=mesh.tp, sequence_parallel=sequence_parallel,
                 regather_input=regather_input, rng=TensorParallelRNG(seed, mesh.tp_rank, device),
                 tied=model.lm_head.weight is model.wte.weight)
    plan = TP_PLAN + (SP_PLAN if sequence_parallel else ())
    for pattern, style in plan:
        matcher = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))  # "*": one block index
        for name, module in list(model.named_modules()):
            if matcher.fullmatch(name):
                model.set_submodule(name, STYLES[style](module, c))
    model.tp_rng = c.rng
    _route_loss_to_vocab_parallel(model, c)
    return model


def allreduce_sequence_parallel_grads(model: nn.Module, tp_group) -> None:
    """Sum over the TP group, in one all-reduce, the gradients of the parameters marked ``sequence_parallel``
    (they meet only this rank's tokens). Call after backward, before clipping and the optimizer."""
    grads = [p.grad for p in model.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or torch.distributed.get_world_size(tp_group) == 1:
        return
    comms.all_reduce_coalesced(grads, group=tp_group)
