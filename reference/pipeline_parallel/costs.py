"""What each pipeline stage costs: compute (time) and memory, measured and counted.

A pipeline runs at the pace of its slowest stage (*time balance*: the flops of each stage's
forward and backward), and each stage holds its parameters, their gradients and optimizer
state, and the activations its micro-batches leave stored (*memory balance*). The two part
ways at the ends: the embedding is V x C parameters but a table lookup, while the head is as
many parameters, a (C x V) product, and the logits it keeps for the loss's backward.

`stage_costs` measures each stage on one micro-batch; `stage_flops_formula` and
`stored_bytes_formula` count the same in closed form, and `held_bytes_formula` what a zero-bubble
schedule holds from its I to its W (in place of what F stored). `lateness` and `idle_margin` bound how far a run with stages of
fixed times (`DelayedStage`) may stray from its ideal timeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from reference.model import GPTConfig, lm_loss
from reference.memory import SavedBytes
from reference.pipeline_parallel.registry import build_schedule
from reference.pipeline_parallel.stage import StageSpec, plan_stages
from reference.pipeline_parallel.zero_bubble import peak_bytes

__all__ = ["StageCost", "stage_costs", "stored_bytes_formula", "held_bytes_formula", "held_bytes_per_block",
           "held_bytes_of_head", "peak_bytes_by_rank", "stage_flops_formula", "lateness", "idle_margin"]


@dataclass(frozen=True)
class StageCost:
    """One stage, one micro-batch: parameters held, flops (forward + backward), bytes stored."""

    spec: StageSpec
    params: int
    flops: int
    stored_bytes: int


def stage_costs(stages: Sequence[torch.nn.Module], idx: torch.Tensor, targets: torch.Tensor) -> list[StageCost]:
    """Measure every stage of a whole pipeline (`split_stages`) on one micro-batch ``idx`` -> ``targets`` (b, T).

    Flops by `torch.utils.flop_counter` (matrix products; CPU attention kernels are not counted);
    stored bytes as `run_pipeline` counts them: saved tensors, parameters left out, plus the output
    kept until its gradient arrives (Megatron-LM frees the output's data after the send)."""
    params = {p.untyped_storage().data_ptr() for s in stages for p in s.parameters()}
    # copies, so that the ids and targets count their own bytes, not those of a batch they view
    x, targets, runs = idx.clone(), targets.clone(), []
    for k, stage in enumerate(stages):
        last = k == len(stages) - 1
        inp = x if k == 0 else x.detach().requires_grad_()       # a received activation
        with FlopCounterMode(display=False) as fwd, SavedBytes(params) as saved:
            out, _ = stage(inp)
            if last:
                out = lm_loss(out, targets)
        saved.add(inp)
        if not last:
            saved.add(out)                                        # kept until its gradient arrives
        runs.append((inp, out, fwd.get_total_flops(), saved.bytes))
        x = out
    grad, costs = None, []
    for stage, (inp, out, fwd_flops, stored) in reversed(list(zip(stages, runs))):
        with FlopCounterMode(display=False) as bwd:
            out.backward(grad)
        grad = inp.grad
        n_params = sum(p.numel() for p in stage.parameters())
        costs.append(StageCost(stage.spec, n_params, fwd_flops + bwd.get_total_flops(), stored))
    return costs[::-1]


def stored_bytes_formula(config: GPTConfig, micro_batch: int, spec: StageSpec) -> dict[str, int]:
    """Bytes one micro-batch's forward leaves stored on the stage ``spec``, by part (fp32, no dropout).

    A block keeps 16 S + 4 s + ℓ (S = b T C * 4 bytes, s = b T * 4, ℓ = b n_head T * 4: the
    LayerNorms' inputs, outputs and statistics, q, k, v, the attention output and log-sum-exp, the
    MLP's hidden layer; no T x T scores, the flash kernel recomputes them)."""
    b, T, C, V = micro_batch, config.block_size, config.n_embd, config.vocab_size
    S, s, lse = b * T * C * 4, b * T * 4, b * config.n_head * T * 4
    parts = {}
    if spec.embedding:
        parts["token ids and positions"] = b * T * 8 + T * 8          # int64
    if len(spec.layers):
        parts[f"{len(spec.layers)} block(s), 16S + 4s + ℓ each"] = len(spec.layers) * (16 * S + 4 * s + lse)
    if spec.head:
        # ln_f's input, statistics and output; log-softmax (b T, V); targets; the loss's weight total
        parts["head: LayerNorm, log-probabilities (b, T, V), targets"] = 2 * S + 2 * s + b * T * V * 4 + b * T * 8 + 4
    else:
        parts["output kept for its gradient, S"] = S
    return parts


def held_bytes_formula(config: GPTConfig, micro_batch: int, spec: StageSpec, n_experts: Optional[int] = None,
                       k: int = 2, moe_layers: Optional[Iterable[int]] = None,
                       shared_expert: bool = False) -> int:
    """Bytes one micro-batch holds on the stage ``spec`` from its I to its W, in place of what its
    F stored: each linear layer's X and dY (fp32, no tensor parallelism), 16 b T C * 4 a dense
    block, nothing for the embedding and the head (their gradients are computed in I). With
    ``n_experts`` the layers ``moe_layers`` (default all) route k of E experts per token, plus a
    ``shared_expert``."""
    moe = set(range(config.n_layer) if moe_layers is None else moe_layers) if n_experts else set()
    return int(sum(held_bytes_per_block(config.block_size, micro_batch, config.n_embd, act_bytes=4,
                                        d_ff=config.d_ff, n_experts=n_experts if i in moe else None, k=k,
                                        shared_experts=int(shared_expert), bias=config.bias)
                   for i in spec.layers))


def held_bytes_per_block(s: int, b: int, h: int, tp: int = 1, sequence_parallel: bool = False,
                         act_bytes: int = 2, d_ff: Optional[int] = None, n_experts: Optional[int] = None,
                         k: int = 2, shared_experts: int = 0, bias: bool = True) -> float:
    """What a zero-bubble schedule's W needs of one block and micro-batch of b sequences of s
    tokens, on one tp rank, held from its I to its W (`split_backward`): each linear layer's input
    X and output gradient dY.

    Per token at tp = 1: X of c_attn (ln_1's output, h), of the attention's c_proj (h), of c_fc
    (ln_2's output, h) and of the MLP's c_proj (the GELU's output, d_ff); dY of each, 3 h, h, d_ff
    and h: 16 s b h with d_ff = 4 h, as much as F stored less the LayerNorms' statistics and the
    log-sum-exp (`stored_bytes_formula`). Tensor parallelism splits a column-parallel layer's dY and
    a row-parallel layer's X by tp; a column-parallel layer's X and a row-parallel layer's dY are
    the whole sequence's whether or not ``sequence_parallel`` gathers them. A ``bias``'s gradient
    is the sum of dY's rows (held anyway) or, added apart (a row-parallel layer's), computed in I:
    it holds nothing. An MoE layer (``n_experts`` = E) is not split by tp: the router's gate (X,
    ln_2's output, and dY, E a token), for each of the k copies of a token routed an expert's
    c_fc and c_proj (X and dY, h + d_ff each), and a shared expert's (its X is the gate's, its
    last dY the block's output gradient: 2 d_ff + h), assuming no assignment dropped at capacity
    and, under expert parallelism, that an ep rank's experts receive the k s b rows it dispatches."""
    d_ff = d_ff or 4 * h
    attention = h + h / tp + 3 * h / tp + h  # X, X, dY, dY of c_attn and c_proj: (s b, .)
    if n_experts is None:
        mlp = h + d_ff / tp + d_ff / tp + h  # X of c_fc and c_proj, their dY
    else:
        mlp = h + n_experts + k * 2 * (h + d_ff) + shared_experts * (2 * d_ff + h)
    return act_bytes * s * b * (attention + mlp)


def held_bytes_of_head(s: int, b: int, h: int, vocab_size: int, tp: int = 1, sequence_parallel: bool = False,
                       act_bytes: int = 2) -> float:
    """What the head's W would hold from I to W if it were put off like a block's: the lm_head's
    X (ln_f's output, s b h, the whole sequence's under SP too) and dY, the logits' gradient (s b,
    V / tp rows of the vocabulary, rounded up). The executor computes the head's gradients in I
    instead (`split_backward`): b T (C + V) a micro-batch, on GPT-2-medium
    as much as 3 of its blocks hold."""
    return act_bytes * s * b * (h + (-(-vocab_size // tp)))


def stage_flops_formula(config: GPTConfig, micro_batch: int, spec: StageSpec) -> int:
    """Forward + backward flops of the stage's weight GEMMs for one micro-batch: what `stage_costs` counts."""
    tokens, C = micro_batch * config.block_size, config.n_embd
    return tokens * (72 * C * C * len(spec.layers) + (6 * C * config.vocab_size if spec.head else 0))


def peak_bytes_by_rank(config, kind: str, pp: int, m: int, micro_batch: int = 1,
                       head_w_deferred: bool = False) -> list[int]:
    """Each rank's `peak_bytes` running ``kind`` (``pp`` ranks, ``m`` micro-batches, the V's two
    chunks a rank) on the GPT ``config`` cut by layers (`plan_stages`), fp32, no recomputation:
    each F storing `stored_bytes_formula`, each I holding `held_bytes_formula` instead, the counts
    the executor measures. ``head_w_deferred``: as if the head's W were put off like a block's
    (`held_bytes_of_head` more on its stage), which the executor does not do."""
    v = 2 if kind in ("zb-v", "dualpipev") else 1
    schedule, specs = build_schedule(kind, pp, m, v), plan_stages(config, pp * v)
    out = []
    for rank in range(pp):
        mine = [specs[schedule.stage(rank, c)] for c in range(v)]
        stored = [sum(stored_bytes_formula(config, micro_batch, spec).values()) for spec in mine]
        held = [held_bytes_formula(config, micro_batch, spec) + (head_w_deferred and spec.head) * int(
            held_bytes_of_head(config.block_size, micro_batch, config.n_embd, config.vocab_size, act_bytes=4))
            for spec in mine]
        out.append(peak_bytes(schedule, rank, stored, held))
    return out


def lateness(timeline, cost: dict) -> float:
    """The mean time an action took beyond its injected cost (``cost``: seconds per op, for the ops it
    names): the sleep's overshoot, a tiny model's compute, and the runtime's code around the action."""
    over = [e.end - e.start - cost[e.action.op] for rank in timeline for e in rank if e.action.op in cost]
    return sum(over) / len(over)


def idle_margin(late: float, cost: dict) -> float:
    """How far a measured idle share may stray from the simulated one, as a share of the span.

    Every action takes its cost plus a lateness e, every hand-off a wake-up h. The span grows by
    the e + h along the critical path, at most S / c actions (c the smallest cost), so the idle
    share moves by at most (e + h) / c; a blocked receive wakes as late as a sleep, so h = e and
    the margin is 2 e / c, e the run's mean lateness."""
    return 2 * late / min(cost.values())
