"""What each pipeline stage costs: compute (time) and memory, measured and counted.

A pipeline runs at the pace of its slowest stage, so *time balance* is about each
stage's compute: the flops of its forward and backward. *Memory balance* is about
what a stage holds: its parameters with their gradients and optimizer state, and
the activations its micro-batches leave stored for their backward. The two part
ways at the ends of the model: the embedding is V x C parameters but a table
lookup (no flops), while the head is as many parameters, a (C x V) product, and
the logits it keeps for the loss's backward.

* `stage_costs(stages, idx, targets)` runs one micro-batch through the stages in
  this process, forward then backward, and measures each stage: its parameters,
  the flops of its forward and backward (`torch.utils.flop_counter`, which counts
  matrix products; CPU attention kernels are not counted) and the bytes its
  forward leaves stored, counted the way `run_pipeline` counts them (saved
  tensors, parameters left out, plus the output kept until its gradient arrives:
  a cost of this executor, which Megatron-LM avoids by freeing the output's data
  after the send, since backward needs only its grad_fn).
* `stored_bytes_formula(config, micro_batch, spec)` is that last count in closed
  form, part by part, for the plain GPT in fp32 without dropout: a block keeps
  16 S + 4 s + ℓ (S = b T C * 4 bytes, s = b T * 4, ℓ = b n_head T * 4: the
  LayerNorm inputs, outputs and statistics, q, k, v, the attention output and
  log-sum-exp, the MLP's hidden layer; no T x T scores, the flash kernel
  recomputes them), the embedding its token ids and positions, the head its
  LayerNorm, the log-probabilities (b, T, V) and the targets, and every stage
  but the last its output.
* `held_bytes_formula(config, micro_batch, spec)`: what a zero-bubble schedule's I holds
  beyond that until its W, the gradients caught at the split points
  (`reference.pipeline_parallel.split_backward`): 11 S a block, S + b T V * 4 the head; an
  MoE block (``n_experts``) (6 C + E + k (C + d_ff)) b T * 4 (`held_bytes_per_block`, which
  `reference.parallel.estimate` counts with too, at any tp).
* `stage_flops_formula(config, micro_batch, spec)`: the weight GEMMs, 72 C^2 per
  token and block, 6 C V per token for the head, nothing for the embedding.
* `lateness(timeline, cost)` and `idle_margin(late, cost)`: when stages take fixed times
  (`DelayedStage`, or sleeps around each action), how late a run's actions were, and how far
  that lets its measured idle share stray from the ideal timeline's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from reference.model import GPTConfig, lm_loss
from reference.memory import SavedBytes
from reference.pipeline_parallel.stage import StageSpec

__all__ = ["StageCost", "stage_costs", "stored_bytes_formula", "held_bytes_formula", "held_bytes_per_block",
           "held_bytes_of_head", "stage_flops_formula", "lateness", "idle_margin"]


@dataclass(frozen=True)
class StageCost:
    """One stage, one micro-batch: parameters held, flops (forward + backward), bytes stored."""

    spec: StageSpec
    params: int
    flops: int
    stored_bytes: int


def stage_costs(stages: Sequence[torch.nn.Module], idx: torch.Tensor, targets: torch.Tensor) -> list[StageCost]:
    """Measure every stage of a whole pipeline (`split_stages`) on one micro-batch ``idx`` -> ``targets`` (b, T)."""
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
    """Bytes one micro-batch's forward leaves stored on the stage ``spec``, by part (fp32, no dropout)."""
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
    """Bytes one micro-batch's I holds on the stage ``spec`` until its W, beside what its F stored:
    the gradients caught at the split points (fp32, the plain GPT, no tensor parallelism).

    A dense block has six: its two LayerNorms (b T C each) and its four linear layers (3, 1, 4
    and 1 times b T C), 11 S in all with S = b T C * 4 bytes; the head its LayerNorm (S) and
    the lm_head (b T V * 4). With ``n_experts`` the layers ``moe_layers`` (default all, as
    `reference.expert_parallel.moe_factory`) are MoE layers routing k of E experts per token,
    ``shared_expert`` one more that every token goes through: each counted by
    `held_bytes_per_block` (exact when no assignment is dropped at capacity; a drop holds less).
    The first stage's I has nothing to compute: it holds nothing more."""
    if spec.stage == 0:
        return 0
    moe = set(range(config.n_layer) if moe_layers is None else moe_layers) if n_experts else set()
    blocks = sum(held_bytes_per_block(config.block_size, micro_batch, config.n_embd, act_bytes=4,
                                      d_ff=config.d_ff, n_experts=n_experts if i in moe else None, k=k,
                                      shared_experts=int(shared_expert), bias=config.bias)
                 for i in spec.layers)
    head = held_bytes_of_head(config.block_size, micro_batch, config.n_embd, config.vocab_size,
                              act_bytes=4) if spec.head else 0
    return int(blocks + head)


def held_bytes_per_block(s: int, b: int, h: int, tp: int = 1, sequence_parallel: bool = False,
                         act_bytes: int = 2, d_ff: Optional[int] = None, n_experts: Optional[int] = None,
                         k: int = 2, shared_experts: int = 0, bias: bool = True) -> float:
    """What a zero-bubble schedule's I holds for its W, per block and micro-batch of b sequences
    of s tokens, on one tp rank: the gradient caught at each split point (`split_backward`), the
    output gradient of each LayerNorm and linear layer.

    Attention: the LayerNorms' (s b h each, split by SP), q|k|v's (3 h, column-parallel: / tp),
    the projection's (h, row-parallel: whole). A dense MLP: c_fc's (d_ff / tp) and c_proj's (h,
    whole); 11 s b h at tp = 1 and d_ff = 4 h. An MoE layer (``n_experts`` = E): tp splits none
    of it and it routes the whole sequence (gathered under SP), so on every tp rank the router's
    logits (E a token), and for each of the s b k routed copies and each token's pass through a
    shared expert c_fc's (d_ff) and c_proj's (h) output gradients: s b (E + (k + shared) (d_ff
    + h)). That assumes no assignment dropped at capacity (a dropped one holds nothing) and,
    with expert parallelism, that an ep rank's experts receive the k s b rows it dispatches
    (routing decides how many they do). Under SP (tp > 1) a row-parallel layer with a
    ``bias`` adds it after the reduce-scatter, so its bias catches its own (s b h / tp)
    gradient beside the product's gathered one: the attention's projection and a dense MLP's
    c_proj (without SP the two are one tensor, the all-reduce's backward passing it on)."""
    d_ff = d_ff or 4 * h
    ln = tp if sequence_parallel and tp > 1 else 1
    row_bias = h / tp if bias and ln > 1 else 0  # a row-parallel bias's own gradient, (s b / tp, h)
    # per token: ln_1, ln_2; q|k|v (s b, 3 h / tp); proj (s b, h) and its bias
    attention = 2 * h / ln + 3 * h / tp + h + row_bias
    if n_experts is None:
        mlp = d_ff / tp + h + row_bias  # c_fc (s b, d_ff / tp), c_proj (s b, h) and its bias
    else:  # gate (s b, E); the experts' c_fc and c_proj, (k s b, d_ff) and (k s b, h), and a shared one's
        mlp = n_experts + (k + shared_experts) * (d_ff + h)
    return act_bytes * s * b * (attention + mlp)


def held_bytes_of_head(s: int, b: int, h: int, vocab_size: int, tp: int = 1, sequence_parallel: bool = False,
                       act_bytes: int = 2) -> float:
    """What I holds for W on the head's stage: ln_f's output gradient (s b h, split by SP) and the
    lm_head's, the logits' (s b, V / tp rows of the vocabulary, rounded up)."""
    ln = tp if sequence_parallel and tp > 1 else 1
    return act_bytes * s * b * (h / ln + (-(-vocab_size // tp)))


def stage_flops_formula(config: GPTConfig, micro_batch: int, spec: StageSpec) -> int:
    """Forward + backward flops of the stage's weight GEMMs for one micro-batch: what `stage_costs` counts."""
    tokens, C = micro_batch * config.block_size, config.n_embd
    return tokens * (72 * C * C * len(spec.layers) + (6 * C * config.vocab_size if spec.head else 0))


def lateness(timeline, cost: dict) -> float:
    """The mean time an action took beyond its injected cost (``cost``: seconds per op, the
    actions it names), over every such action of every rank's events: the sleep's own
    overshoot (the OS wakes a sleeping process late), a tiny model's compute, and the
    runtime's code around the action."""
    over = [e.end - e.start - cost[e.action.op] for rank in timeline for e in rank if e.action.op in cost]
    return sum(over) / len(over)


def idle_margin(late: float, cost: dict) -> float:
    """How far a measured idle share may stray from the simulated one, as a share of the span.

    Every action takes its cost plus a lateness e >= 0, and every hand-off to the next action
    (the next on its rank, or a message's receiver) a wake-up h >= 0. The real timeline keeps
    each rank's order, so its span S' is at least the ideal S and exceeds it by the e + h along
    the critical path, a chain of at most S / c actions (c the smallest cost: the chain tiles
    the ideal span without gaps); busy time grows by the e's. So the idle share moves by at
    most (e + h) / c either way. A blocked receive wakes as late as a sleep does (both are the
    OS waking a process), so h is taken as e: margin = 2 e / c, with e the run's mean
    lateness per action."""
    return 2 * late / min(cost.values())
