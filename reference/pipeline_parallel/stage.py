"""Cutting the plain GPT into pipeline stages.

The GPT is a chain: embedding -> block 0 -> ... -> block L-1 -> head (ln_f and lm_head); a stage
is a contiguous piece of it. `plan_stages` decides the cut as plain data (`StageSpec`);
`split_stages` builds one `GPTStage` per stage, *sharing* its layers with the model (no copy).

* ``balance="layers"``: the blocks dealt out evenly, any extra ones to the later stages, where 1F1B
  stores the fewest micro-batches.
* ``balance="params"``: the contiguous cut whose largest stage holds the fewest parameters (the
  lm_head counted even when tied: its stage holds a copy).

``embedding_stage=True`` (``head_stage=True``) gives the embedding (the head) a stage of its own:
with a large vocabulary it is as heavy as several blocks. Tied ``wte`` and ``lm_head`` on two ranks
are two copies (``GPTStage.tied``), kept equal by `reference.pipeline_parallel.tied`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from reference.model import GPT, Block, GPTConfig, lm_loss
from reference.tensor_parallel.loss import VocabParallelLMHead

__all__ = ["StageSpec", "plan_stages", "GPTStage", "split_stages", "local_stages", "DelayedStage"]


@dataclass(frozen=True)
class StageSpec:
    """Model stage ``stage`` holds blocks ``first_layer .. last_layer - 1`` and,
    when the flags say so, the embedding and the head."""

    stage: int
    first_layer: int
    last_layer: int
    embedding: bool = False
    head: bool = False

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer)

    def __str__(self) -> str:
        n = len(self.layers)
        blocks = [] if n == 0 else [f"block {self.first_layer}"] if n == 1 \
            else [f"blocks {self.first_layer}..{self.last_layer - 1}"]
        parts = (["embedding"] if self.embedding else []) + blocks + (["head"] if self.head else [])
        return f"stage {self.stage}: " + " + ".join(parts)


def _unit_costs(model_or_config) -> tuple[int, list[int], int, int]:
    """Parameter counts of (embedding, each block, head) and the number of blocks."""
    if isinstance(model_or_config, GPT):
        m = model_or_config
        emb = m.wte.weight.numel() + m.wpe.weight.numel()
        blocks = [sum(p.numel() for p in b.parameters()) for b in m.h]
        head = sum(p.numel() for p in m.ln_f.parameters()) + m.lm_head.weight.numel()
        return emb, blocks, head, len(blocks)
    if isinstance(model_or_config, GPTConfig):
        c = model_or_config
        with torch.device("meta"):  # shapes only: no memory, no random draws
            block = sum(p.numel() for p in Block(c).parameters())
        ln_f = c.n_embd * (2 if c.bias else 1)
        return (c.vocab_size + c.block_size) * c.n_embd, [block] * c.n_layer, \
            ln_f + c.vocab_size * c.n_embd, c.n_layer
    raise TypeError(f"expected a GPT or a GPTConfig, got {type(model_or_config).__name__}")


def _min_max_cut(costs: Sequence[int], k: int) -> list[int]:
    """Sizes of the k contiguous non-empty parts of ``costs`` whose largest sum is smallest
    (dynamic programming over (parts used, units taken))."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[j][i]: first i units in j parts
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for h in range(j - 1, i):
                worst = max(best[j - 1][h], prefix[i] - prefix[h])
                if worst < best[j][i]:
                    best[j][i], cut[j][i] = worst, h
    sizes, i = [], n
    for j in range(k, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def plan_stages(model_or_config, n_stages: int, balance: str = "layers",
                embedding_stage: bool = False, head_stage: bool = False) -> list[StageSpec]:
    """Where to cut the GPT into ``n_stages`` stages (pure: nothing is built)."""
    emb, blocks, head, n_layer = _unit_costs(model_or_config)
    if balance not in ("layers", "params"):
        raise ValueError(f"balance must be 'layers' or 'params', got {balance!r}")
    k = n_stages - int(embedding_stage) - int(head_stage)  # stages that hold blocks
    if not isinstance(n_stages, int) or k < 1 or (balance == "layers" and k > n_layer) \
            or n_layer + 2 - int(embedding_stage) - int(head_stage) < k:
        raise ValueError(
            f"cannot cut {n_layer} blocks into {n_stages} stages (embedding_stage="
            f"{embedding_stage}, head_stage={head_stage}, balance={balance!r}): every stage "
            f"needs at least one block, or the embedding or head on a stage of its own")
    # The units shared out over the k block-holding stages, as (kind, layer) pairs.
    units = ([] if embedding_stage else [("emb", None)]) + [("block", i) for i in range(n_layer)] \
        + ([] if head_stage else [("head", None)])
    if balance == "layers":
        base, extra = divmod(n_layer, k)
        per_stage = [base + (1 if i >= k - extra else 0) for i in range(k)]
        sizes = [n + (i == 0 and not embedding_stage) + (i == k - 1 and not head_stage)
                 for i, n in enumerate(per_stage)]
    else:
        cost = {"emb": emb, "head": head}
        sizes = _min_max_cut([cost.get(kind) or blocks[i] for kind, i in units], k)
    specs: list[StageSpec] = []
    if embedding_stage:
        specs.append(StageSpec(0, 0, 0, embedding=True))
    start, layer = 0, 0
    for size in sizes:
        part = units[start:start + size]
        n_blocks = sum(kind == "block" for kind, _ in part)
        specs.append(StageSpec(len(specs), layer, layer + n_blocks,
                               embedding=part[0][0] == "emb", head=part[-1][0] == "head"))
        start, layer = start + size, layer + n_blocks
    if head_stage:
        specs.append(StageSpec(len(specs), n_layer, n_layer, head=True))
    return specs


class GPTStage(nn.Module):
    """One stage of the GPT: optionally the embedding, some blocks, optionally the head; ``forward``
    returns ``(out, aux_loss)``. Parameter names are the model's own (``h.5.attn.c_attn.weight``)."""

    def __init__(self, model: GPT, spec: StageSpec):
        super().__init__()
        self.spec = spec
        self.config = model.config
        # Tied means one Parameter object serves both ends in the full model.
        self.tied = model.lm_head.weight is model.wte.weight
        if spec.embedding:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        # Keyed by the model's block index, so names match the full model's.
        self.h = nn.ModuleDict({str(i): model.h[i] for i in spec.layers})
        if spec.head:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.embedding:
            x = GPT.embed(self, x)  # (B, T) ids -> (B, T, C), the model's own code
        aux = x.new_zeros(())
        for block in self.h.values():
            x, block_aux = block(x)  # (B, T, C)
            aux = aux + block_aux
        if self.spec.head:
            x = GPT.head(self, x)  # (B, T, V), or this rank's (B, T, V_pad / tp) under TP
        return x, aux

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The head stage's loss: `lm_loss`, or the vocab-parallel cross-entropy when tensor
        parallelism split lm_head over the vocabulary (the logits are then this rank's columns)."""
        head = getattr(self, "lm_head", None)
        if isinstance(head, VocabParallelLMHead):
            return head.loss(logits, targets, reduction=reduction)
        return lm_loss(logits, targets, reduction)

    def extra_repr(self) -> str:
        return str(self.spec)


def split_stages(model: GPT, pp: int, virtual: int = 1, balance: str = "layers",
                 embedding_stage: bool = False, head_stage: bool = False) -> list[GPTStage]:
    """All ``pp * virtual`` stages of ``model``, in model order; rank r runs r, r + pp, ... (`local_stages`)."""
    if not isinstance(pp, int) or not isinstance(virtual, int) or pp < 1 or virtual < 1:
        raise ValueError(f"pp and virtual must be positive ints, got pp={pp!r}, virtual={virtual!r}")
    try:
        specs = plan_stages(model, pp * virtual, balance, embedding_stage, head_stage)
    except ValueError as err:
        raise ValueError(f"pp={pp} x virtual={virtual} = {pp * virtual} stages: {err}") from None
    return [GPTStage(model, spec) for spec in specs]


def local_stages(stages: Sequence[GPTStage], pp: int, pp_rank: int, schedule=None) -> list[GPTStage]:
    """The stages pipeline rank ``pp_rank`` runs, indexed by chunk: stage ``c * pp + pp_rank``,
    or, given the ``schedule``, where it places them (`Schedule.stage`: ZB-V's V; DualPipe's
    stages r and pp - 1 - r, `Schedule.model_stage`)."""
    if len(stages) % pp or not 0 <= pp_rank < pp:
        raise ValueError(f"{len(stages)} stages do not deal out over pp={pp} ranks "
                         f"(or pp_rank={pp_rank} is not in [0, {pp}))")
    if schedule is not None:
        mine = [schedule.model_stage(schedule.stage(pp_rank, c)) for c in range(schedule.virtual)]
        if len({schedule.model_stage(s) for s in range(schedule.n_stages)}) != len(stages):
            raise ValueError(f"{schedule!r} runs the model cut into "
                             f"{len({schedule.model_stage(s) for s in range(schedule.n_stages)})} "
                             f"stages, got {len(stages)}")
        return [stages[i] for i in mine]
    return list(stages[pp_rank::pp])


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` on the way forward and ``backward_s`` on the way back."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class DelayedStage(nn.Module):
    """A stage whose forward takes ``forward_s`` seconds more and its backward ``backward_s``: the
    process sleeps, leaving the CPU to the other ranks, so a timeline measured with fewer cores
    than ranks still shows the schedule, not the competition for cores."""

    def __init__(self, stage: nn.Module, forward_s: float, backward_s: float):
        super().__init__()
        self.stage, self.forward_s, self.backward_s = stage, forward_s, backward_s
        self.spec, self.config = getattr(stage, "spec", None), getattr(stage, "config", None)

    def forward(self, x):
        out, aux = self.stage(x)
        return _Sleep.apply(out, self.forward_s, self.backward_s), aux

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The wrapped stage's loss (`lm_loss` if it has none)."""
        return getattr(self.stage, "loss", lm_loss)(logits, targets, reduction)

