"""Routing tokens to experts: the gate, top-k, capacity, and the router's losses.

1. **Gate.** A linear map with no bias gives E logits per token, turned (in fp32) into E
   *scores* by the ``score_function`` (Megatron-Core's ``--moe-router-score-function``):

   * ``"softmax"``, the softmax gate (Switch, GShard): probabilities, summing to 1 over the E
     experts, so each is about 1/E;
   * ``"sigmoid"``, DeepSeek-V3's gate (section 2.1.2): affinities s_i = sigmoid(u . e_i),
     each in (0, 1) on its own, whatever E.

2. **Top-k.** The k highest-scoring experts are chosen (k = 1: the Switch Transformer, k = 2:
   GShard, k = 8 of 256: DeepSeek-V3). The combine weights are the chosen scores normalised
   over the k to sum to 1 (GShard; DeepSeek-V3's g_i = s_i / sum of the chosen s); with k = 1
   they stay the raw score (Switch, and Megatron's sigmoid gate): a single normalised weight
   would always be 1 and the gate would get no gradient from the task loss.
3. **Capacity.** Each row of the layer's (G, T, C) input, one sequence, is a *group* (GShard's
   term), and each expert takes at most

       capacity = ceil(capacity_factor * T * k / E)

   of a group's assignments (``capacity_factor=None``: no limit). An assignment over capacity
   is *dropped*: that expert does not see the token (the residual connection still carries it).
   Slots go first to every token's first choice in position order, then to every second choice,
   and so on (GShard's order). One sequence per group makes a token's fate depend on its own
   sequence only, so splitting a batch over data-parallel ranks, micro-batches or
   expert-parallel ranks drops exactly what one process drops. (A (1, N, C) input makes its
   N tokens one group.)
4. **Auxiliary losses,** per group, then averaged over groups, so that averaging over ranks or
   micro-batches gives the whole batch's loss:

   * load balancing (Switch, eq. 4): ``E * sum_i f_i * P_i``, ``f_i`` the fraction of the
     group's k*T assignments choosing expert i (the gate's own top-k, before capacity and
     without the bias of 5; not differentiable), ``P_i`` the mean over the group's tokens of
     expert i's score normalised over the E experts (the probability itself under softmax;
     s_i / sum_j s_j under sigmoid; differentiable). It is 1 for uniform routing and up to
     E/k when every token's k choices are the same k experts, with all the score. With the
     sigmoid gate and a group of one sequence this is DeepSeek-V3's *complementary
     sequence-wise balance loss* (eq. 17-20, its f_i being E/(kT) times the count, i.e. E
     times ours), meant with a tiny ``balance_coef`` (alpha = 0.0001 there);
   * router z-loss (ST-MoE): the mean of ``logsumexp(logits)**2``, keeping the logits small.

   ``aux_loss = balance_coef * balance_loss + z_coef * z_loss``.
5. **Balancing by a bias** (loss-free balancing, Wang et al. 2024; DeepSeek-V3): with
   ``bias_update_rate`` u > 0 a per-expert bias (a buffer, saved with the weights, no gradient)
   is added to the scores *for choosing* the top-k only; the combine weights are the chosen
   experts' own scores. The assignments each expert got (before capacity) are counted into
   ``step_tokens_per_expert`` once per micro-batch; `bias_balance` moves the bias after the
   step. DeepSeek-V3 adds it to sigmoid scores (u = 0.001); Megatron-Core allows it with
   sigmoid scores only; torchtitan with either. The course keeps both: u is in the scores'
   units, so the same u is a much larger step for softmax probabilities of 1/E each.

`sort_by_expert` lays the kept assignments out expert by expert, the layout of both the
single-process layer and the all-to-all dispatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["expert_capacity", "Routing", "Router", "DispatchPlan", "sort_by_expert", "combine"]


def expert_capacity(tokens_per_group: int, n_experts: int, k: int,
                    capacity_factor: Optional[float]) -> int:
    """Slots of each expert per group: ceil(capacity_factor * T * k / E), at most T (no token
    chooses an expert twice, so T means "no limit", what ``capacity_factor=None`` gives)."""
    if capacity_factor is None:
        return tokens_per_group
    # The 1e-9 keeps a product that is an integer in exact arithmetic (1.25 * 32 * 2 / 4)
    # from rounding up to the next integer through a float error.
    slots = math.ceil(capacity_factor * tokens_per_group * k / n_experts - 1e-9)
    return min(tokens_per_group, max(slots, 0))


@dataclass
class Routing:
    """What the router decided for a (G, T, C) input; E experts, k choices."""

    logits: torch.Tensor      # (G, T, E) gate output, fp32
    probs: torch.Tensor       # (G, T, E) the scores: softmax probabilities, or sigmoid affinities
    expert_idx: torch.Tensor  # (G, T, k) chosen experts, highest (biased) score first
    weights: torch.Tensor     # (G, T, k) combine weights
    kept: torch.Tensor        # (G, T, k) bool: the assignment got a slot
    capacity: int             # slots per expert per group
    balance_loss: torch.Tensor  # 0-dim, Switch (sequence-wise) load-balancing loss, no coefficient
    z_loss: torch.Tensor        # 0-dim, router z-loss (without coefficient)
    aux_loss: torch.Tensor      # 0-dim, balance_coef * balance_loss + z_coef * z_loss

    @property
    def n_experts(self) -> int:
        return self.probs.shape[-1]

    def tokens_per_expert(self) -> torch.Tensor:
        """(E,) int64: assignments that chose each expert, before capacity."""
        return torch.bincount(self.expert_idx.reshape(-1), minlength=self.n_experts)

    def kept_per_expert(self) -> torch.Tensor:
        """(E,) int64: assignments each expert processes, after capacity."""
        return torch.bincount(self.expert_idx[self.kept], minlength=self.n_experts)

    @property
    def dropped(self) -> int:
        """Number of (token, expert) assignments dropped at capacity."""
        return int((~self.kept).sum())


SCORE_FUNCTIONS = ("softmax", "sigmoid")  # the softmax gate (Switch, GShard); DeepSeek-V3's


class Router(nn.Module):
    """Linear gate, scores (softmax or sigmoid), top-k, capacity and auxiliary losses (see the
    module docstring). DeepSeek-V3's router is ``score_function="sigmoid"`` with
    ``bias_update_rate=1e-3`` and ``balance_coef=1e-4``."""

    def __init__(self, d_model: int, n_experts: int, k: int = 2,
                 capacity_factor: Optional[float] = 1.25, *,
                 normalize_weights: Optional[bool] = None, score_function: str = "softmax",
                 balance_coef: float = 0.01, z_coef: float = 0.001, bias_update_rate: float = 0.0):
        super().__init__()
        check_routing_args(n_experts, k, capacity_factor)
        if not bias_update_rate >= 0:
            raise ValueError(f"bias_update_rate must be >= 0 (0: no bias), got {bias_update_rate!r}")
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS} (softmax: Switch and "
                             f"GShard's gate; sigmoid: DeepSeek-V3's), got {score_function!r}")
        self.score_function = score_function
        self.n_experts, self.k, self.capacity_factor = n_experts, k, capacity_factor
        self.normalize_weights = k > 1 if normalize_weights is None else bool(normalize_weights)
        self.balance_coef, self.z_coef = float(balance_coef), float(z_coef)
        self.bias_update_rate = float(bias_update_rate)
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        if self.bias_update_rate > 0:
            # The bias is state, saved with the weights (a resumed run routes as the run that never
            # stopped); the step's counts are not: a step starts them at 0 (torchtitan, Megatron).
            self.register_buffer("expert_bias", torch.zeros(n_experts))
            self.register_buffer("step_tokens_per_expert", torch.zeros(n_experts, dtype=torch.int64),
                                 persistent=False)
        else:
            self.expert_bias = self.step_tokens_per_expert = None

    @torch.no_grad()
    def move_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's update from the step's ``load`` (E,), the assignments each expert got
        over the whole step: b <- b + u * sign(mean load - load); the counts start again at 0."""
        load = load.to(self.expert_bias.dtype)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.step_tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, k={self.k}, capacity_factor={self.capacity_factor}, "
                f"score_function={self.score_function}, balance_coef={self.balance_coef}, z_coef={self.z_coef}"
                + (f", bias_update_rate={self.bias_update_rate}" if self.bias_update_rate else ""))

    def forward(self, x: torch.Tensor) -> Routing:
        """x: (G, T, C), one group per row -> the `Routing` of its G * T tokens."""
        G, T, _ = x.shape
        E, k = self.n_experts, self.k
        # fp32 routing: the scores and top-k decide discrete choices. Under autocast the gate's
        # product would be bf16 or fp16, its logits rounded to the format (two experts' bf16 logits
        # come out equal often enough to matter), so the gate runs in fp32, as Megatron-Core's
        # --moe-router-dtype fp32 runs it.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())  # (G, T, E)
        # softmax: probabilities p_i, sum 1; sigmoid: DeepSeek-V3's affinities s_i = sigmoid(u . e_i)
        scores = logits.softmax(dim=-1) if self.score_function == "softmax" else logits.sigmoid()
        top_scores, own_idx = scores.topk(k, dim=-1)  # (G, T, k) each, the gate's own choice, best first
        expert_idx = own_idx
        if self.expert_bias is not None:  # the bias chooses; the weights stay the chosen experts' scores
            expert_idx = (scores.detach() + self.expert_bias).topk(k, dim=-1).indices  # (G, T, k)
            top_scores = scores.gather(-1, expert_idx)
            if torch.is_grad_enabled():  # once per micro-batch (a recompute's first run has no grad)
                self.step_tokens_per_expert += torch.bincount(expert_idx.reshape(-1), minlength=E)
        # normalised over the chosen k (GShard; DeepSeek-V3's g_i), or the raw score (k = 1)
        weights = top_scores / top_scores.sum(dim=-1, keepdim=True) if self.normalize_weights else top_scores

        # Slots in GShard's order: choice-major, then position. Reorder the
        # assignments to (G, k * T) so a cumulative count gives each its slot.
        capacity = expert_capacity(T, E, k, self.capacity_factor)
        by_choice = expert_idx.transpose(1, 2).reshape(G, k * T)  # (G, k*T)
        onehot = F.one_hot(by_choice, E)  # (G, k*T, E)
        slot = ((onehot.cumsum(dim=1) - 1) * onehot).sum(dim=-1)  # (G, k*T): slot taken in its expert
        kept = (slot < capacity).reshape(G, k, T).transpose(1, 2)  # (G, T, k)

        # Switch load balancing per group (a sequence: DeepSeek-V3's sequence-wise loss with the
        # sigmoid gate), then the mean over groups. f_i counts the gate's own top-k, not the
        # bias's choice (DeepSeek-V3's eq. 18 counts the top-k of s, without the bias).
        density = F.one_hot(own_idx.reshape(G, T * k), E).float().mean(dim=1)  # (G, E): f_i
        shares = scores if self.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
        mean_share = shares.mean(dim=1)  # (G, E): P_i, the mean normalised score
        balance_loss = E * (density * mean_share).sum(dim=-1).mean()
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()  # mean over G * T tokens
        aux_loss = self.balance_coef * balance_loss + self.z_coef * z_loss
        return Routing(logits, scores, expert_idx, weights, kept, capacity,
                       balance_loss, z_loss, aux_loss)


def check_routing_args(n_experts, k, capacity_factor) -> None:
    """ValueError for a number of experts, k or capacity factor that cannot route."""
    if not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive int, got {n_experts!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if k > n_experts:
        raise ValueError(f"k={k} exceeds n_experts={n_experts}: a token cannot choose "
                         f"{k} different experts out of {n_experts}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive or None (no limit), got {capacity_factor!r}")


class DispatchPlan(NamedTuple):
    """The kept assignments of one forward, sorted by expert (then token, then choice)."""

    token_idx: torch.Tensor   # (n,) row of the flattened (G * T, C) input each assignment reads
    expert_idx: torch.Tensor  # (n,) its expert, non-decreasing
    weights: torch.Tensor     # (n,) its combine weight
    counts: torch.Tensor      # (E,) int64, assignments per expert: n = counts.sum()


def sort_by_expert(routing: Routing) -> DispatchPlan:
    """Lay the kept assignments out expert by expert: expert e's rows form the e-th block of
    ``counts``, in input order inside it. An ep rank's experts are consecutive, so are its blocks:
    the all-to-all send buffer's order."""
    k = routing.expert_idx.shape[-1]
    flat_expert = routing.expert_idx.reshape(-1)  # (G*T*k,), token-major
    assignment = routing.kept.reshape(-1).nonzero().squeeze(1)  # kept assignments, token-major
    # A stable sort keeps token order inside each expert's block.
    assignment = assignment[torch.argsort(flat_expert[assignment], stable=True)]
    expert_idx = flat_expert[assignment]
    return DispatchPlan(
        token_idx=assignment // k,
        expert_idx=expert_idx,
        weights=routing.weights.reshape(-1)[assignment],
        counts=torch.bincount(expert_idx, minlength=routing.n_experts),
    )


def combine(expert_out: torch.Tensor, plan: DispatchPlan, n_tokens: int) -> torch.Tensor:
    """Sum each token's expert outputs (in `plan` order) times their weights: (n, C) -> (n_tokens, C);
    a token whose assignments were all dropped gets zeros."""
    weighted = expert_out * plan.weights.to(expert_out.dtype).unsqueeze(1)  # (n, C)
    out = expert_out.new_zeros(n_tokens, expert_out.shape[1])  # (G*T, C)
    return out.index_add(0, plan.token_idx, weighted)
