"""Mixture of experts, on one process and with its experts spread over ranks.

A mixture-of-experts (MoE) feed-forward layer holds E expert MLPs; a router (`router`) sends
each token to k of them and the token's output is the weighted sum of theirs: parameters grow
with E while each token pays for k MLPs. `MoE` is the single-process layer, the oracle every
parallel version is checked against; `ExpertParallelMoE` splits the experts over an ``ep``
group (1/P of the expert weights per rank), each rank sending its tokens to their experts'
ranks and back with all-to-alls (`comms`). Both return ``(output, aux_loss)`` and keep a
`MoEStats` of the last forward (this rank's tokens) in ``layer.last_stats``.

With data parallelism (the mesh carves ``ep`` out of ``dp``) the router and every dense
parameter is replicated on all ``dp`` ranks, an expert only on the ``edp`` ranks (same
ep_rank): `moe_all_reduce_gradients` averages each over its own group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms
from reference.comms.functional import all_to_all
from reference.expert_parallel.comms import exchange_counts
from reference.model import MLP, GPTConfig, init_weights
from reference.tensor_parallel.layers import check_init_seed, linear_init_
from reference.expert_parallel.router import Router, check_routing_args, combine, sort_by_expert

__all__ = ["Expert", "MoEStats", "MoELayer", "MoE", "ExpertParallelMoE", "moe_factory", "shard_experts",
           "expert_parameters", "moe_all_reduce_gradients"]


class Expert(nn.Module):
    """One expert: the GPT's MLP, C -> d_ff -> C with a GELU between (names as in `model.MLP`)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (n, d_ff) inside, (n, C) out


@dataclass
class MoEStats:
    """Routing statistics of one forward (detached; this rank's tokens under expert parallelism)."""

    tokens_per_expert: torch.Tensor  # (E,) assignments choosing each expert, before capacity
    kept_per_expert: torch.Tensor    # (E,) assignments each expert processed
    dropped: int                     # assignments dropped at capacity
    dropped_tokens: int              # tokens that lost all k of their assignments (output 0)
    capacity: int                    # slots per expert per group (one sequence)
    balance_loss: float              # Switch load-balancing loss, without its coefficient
    z_loss: float                    # router z-loss, without its coefficient
    expert_idx: torch.Tensor         # (G, T, k) chosen experts
    kept: torch.Tensor               # (G, T, k) bool, the assignment got a slot
    send_counts: Optional[torch.Tensor] = None  # (P,) rows dispatched to each ep rank (self included)
    recv_counts: Optional[torch.Tensor] = None  # (P, E // P) rows received per source rank and local expert


def _as_groups(x: torch.Tensor, d_model: int) -> torch.Tensor:
    """(B, T, C) stays, one routing group per sequence; (N, C) becomes one group (1, N, C)."""
    if x.dim() not in (2, 3) or x.shape[-1] != d_model:
        raise ValueError(f"MoE input must be (B, T, {d_model}) or (N, {d_model}), got {tuple(x.shape)}")
    return x if x.dim() == 3 else x.unsqueeze(0)


class MoELayer(nn.Module):
    """What the oracle and the expert-parallel layer share: router, shared expert, forward."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int = 2,
                 capacity_factor: Optional[float] = 1.25, *, shared_expert: bool = False,
                 normalize_weights: Optional[bool] = None, balance_coef: float = 0.01,
                 z_coef: float = 0.001, bias: bool = True, n_local_experts: Optional[int] = None,
                 bias_update_rate: float = 0.0, score_function: str = "softmax"):
        super().__init__()
        # Everything needed to build the same layer again (from_dense uses it).
        self.hparams = dict(d_model=d_model, d_ff=d_ff, n_experts=n_experts, k=k,
                            capacity_factor=capacity_factor, shared_expert=shared_expert,
                            normalize_weights=normalize_weights, balance_coef=balance_coef,
                            z_coef=z_coef, bias=bias, bias_update_rate=bias_update_rate,
                            score_function=score_function)
        self.d_model, self.n_experts, self.k = d_model, n_experts, k
        self.router = Router(d_model, n_experts, k, capacity_factor, normalize_weights=normalize_weights,
                             score_function=score_function, balance_coef=balance_coef, z_coef=z_coef,
                             bias_update_rate=bias_update_rate)
        n_local = n_experts if n_local_experts is None else n_local_experts
        self.experts = nn.ModuleList(Expert(d_model, d_ff, bias) for _ in range(n_local))
        # A shared expert sees every token, as in DeepSeekMoE; it is dense (not split by ep).
        self.shared_expert = Expert(d_model, d_ff, bias) if shared_expert else None
        self.last_stats: Optional[MoEStats] = None

    @property
    def last_dropped(self) -> Optional[int]:
        """Assignments dropped at capacity in the last forward (None before the first)."""
        return None if self.last_stats is None else self.last_stats.dropped

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) or (N, C) -> (output of the same shape, aux_loss 0-dim)."""
        groups = _as_groups(x, self.d_model)  # (G, T, C)
        routing = self.router(groups)
        plan = sort_by_expert(routing)
        tokens = groups.reshape(-1, self.d_model)  # (G*T, C)
        expert_out, comm_stats = self._run_experts(tokens[plan.token_idx], plan)  # (n, C), plan order
        y = combine(expert_out, plan, tokens.shape[0])  # (G*T, C)
        if self.shared_expert is not None:
            y = y + self.shared_expert(tokens)
        self.last_stats = MoEStats(
            tokens_per_expert=routing.tokens_per_expert(), kept_per_expert=routing.kept_per_expert(),
            dropped=routing.dropped, dropped_tokens=int((~routing.kept).all(dim=-1).sum()),
            capacity=routing.capacity,
            balance_loss=float(routing.balance_loss.detach()), z_loss=float(routing.z_loss.detach()),
            expert_idx=routing.expert_idx.detach(), kept=routing.kept.detach(), **comm_stats)
        return y.view(x.shape), routing.aux_loss

    def _run_experts(self, rows: torch.Tensor, plan) -> tuple[torch.Tensor, dict]:
        """rows (n, C) sorted by expert -> (expert outputs (n, C) in the same order, extra stats)."""
        raise NotImplementedError


class MoE(MoELayer):
    """Single-process mixture-of-experts feed-forward layer: the oracle.

    Routing, its gate (``score_function``: softmax, or DeepSeek-V3's sigmoid), capacity (per
    sequence), the losses (``balance_coef``, ``z_coef``) and the bias (``bias_update_rate``,
    `bias_balance`) are `router`'s. ``shared_expert=True`` adds an expert
    every token goes through; ``normalize_weights`` defaults to k > 1 (GShard renormalises top-2).
    """

    def _run_experts(self, rows: torch.Tensor, plan) -> tuple[torch.Tensor, dict]:
        # rows (n, C) sorted by expert: expert e takes the e-th block of plan.counts.
        blocks = rows.split(plan.counts.tolist())
        return torch.cat([expert(block) for expert, block in zip(self.experts, blocks)]), {}


class ExpertParallelMoE(MoELayer):
    """The MoE with its experts split over the ranks of `group` (the ep group).

    Group rank r holds experts ``r * E / P ... (r + 1) * E / P - 1`` (``expert_ids``); the router
    and the shared expert are whole on every rank. Built directly, it holds those parts of the
    `MoE` built on the CPU after `torch.manual_seed(seed)` (master-weight init; the same ``seed``
    on every rank); `from_dense` copies an existing `MoE`, built with
    ``perform_initialization=False`` (Megatron's name), which skips that replay of every expert's draws.
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int = 2,
                 capacity_factor: Optional[float] = 1.25, *, group=None, seed: int = 0,
                 perform_initialization: bool = True, **kwargs):
        check_routing_args(n_experts, k, capacity_factor)
        check_init_seed("ExpertParallelMoE", seed)
        ep = dist.get_world_size(group)
        if n_experts % ep != 0:
            raise ValueError(
                f"n_experts={n_experts} does not divide by ep={ep} (world_size="
                f"{dist.get_world_size()}): every expert-parallel rank must hold the same "
                f"number of experts")
        with torch.random.fork_rng(devices=[]):  # these draws are replaced by _draw_from_seed
            super().__init__(d_model, d_ff, n_experts, k, capacity_factor,
                             n_local_experts=n_experts // ep, **kwargs)
        self.ep_group, self.ep_size, self.ep_rank = group, ep, dist.get_rank(group)
        self.n_local_experts = n_experts // ep
        first = self.ep_rank * self.n_local_experts
        self.expert_ids = list(range(first, first + self.n_local_experts))
        if perform_initialization:  # False: `from_dense` copies the weights in
            self._draw_from_seed(seed)

    @torch.no_grad()
    def _draw_from_seed(self, seed: int) -> None:
        """Replay `MoE(...)`'s construction draws on a CPU generator seeded `seed`, in its order:
        the router's gate, experts 0 .. E-1 (c_fc, c_proj: weight then bias), the shared
        expert. Another rank's expert is drawn into scratch and dropped, so the stream
        reaches each of this rank's experts exactly where MoE's does."""
        gen = torch.Generator().manual_seed(seed)

        def draw(linear: nn.Linear, keep: bool = True) -> None:
            w = torch.empty_like(linear.weight, device="cpu")  # (out, in), on the CPU as MoE's
            b = None if linear.bias is None else torch.empty_like(linear.bias, device="cpu")
            linear_init_(w, b, gen)
            if keep:  # copied to the parameter's device
                linear.weight.copy_(w)
                if b is not None:
                    linear.bias.copy_(b)

        draw(self.router.gate)
        for e in range(self.n_experts):
            mine = e in self.expert_ids
            expert = self.experts[e - self.expert_ids[0]] if mine else self.experts[0]  # same shapes
            for linear in (expert.c_fc, expert.c_proj):
                draw(linear, keep=mine)
        if self.shared_expert is not None:
            draw(self.shared_expert.c_fc)
            draw(self.shared_expert.c_proj)

    @classmethod
    def from_dense(cls, moe: MoE, group=None) -> "ExpertParallelMoE":
        """This rank's share of `moe`: the same router and shared expert, its experts copied."""
        layer = cls(**moe.hparams, group=group, perform_initialization=False)
        layer.router.load_state_dict(moe.router.state_dict())  # the gate, and the bias if any
        if moe.router.expert_bias is not None:  # the step's counts so far (not in state_dict)
            layer.router.step_tokens_per_expert.copy_(moe.router.step_tokens_per_expert)
        for local, global_id in zip(layer.experts, layer.expert_ids):
            local.load_state_dict(moe.experts[global_id].state_dict())
        if moe.shared_expert is not None:
            layer.shared_expert.load_state_dict(moe.shared_expert.state_dict())
        return layer.to(next(moe.parameters()).device)

    def extra_repr(self) -> str:
        return f"ep_rank={self.ep_rank}, ep={self.ep_size}, expert_ids={self.expert_ids}"

    def _run_experts(self, rows: torch.Tensor, plan) -> tuple[torch.Tensor, dict]:
        P, E_l, group = self.ep_size, self.n_local_experts, self.ep_group
        recv_counts = exchange_counts(plan.counts, group)  # (P, E_l): rows from rank s for my expert l
        send_splits = plan.counts.view(P, E_l).sum(dim=1).tolist()  # rows to each rank
        recv_splits = recv_counts.sum(dim=1).tolist()  # rows from each rank
        # Dispatch: (n, C) sorted by expert -> (sum(recv_splits), C), by source rank then local expert.
        received = all_to_all(rows, recv_splits, send_splits, group)
        blocks = list(received.split(recv_counts.reshape(-1).tolist()))  # block (s, l) at s * E_l + l
        for l, expert in enumerate(self.experts):
            mine = [s * E_l + l for s in range(P)]
            out = expert(torch.cat([blocks[i] for i in mine]))  # all of expert l's rows at once
            for i, piece in zip(mine, out.split([blocks[i].shape[0] for i in mine])):
                blocks[i] = piece
        # Combine: the results go back to their tokens' ranks, arriving in plan order.
        returned = all_to_all(torch.cat(blocks), send_splits, recv_splits, group)  # (n, C)
        return returned, dict(send_counts=torch.tensor(send_splits), recv_counts=recv_counts)


def moe_factory(n_experts: int, k: int = 2, capacity_factor: Optional[float] = 1.25, *,
                layers: Optional[Iterable[int]] = None, **kwargs):
    """A `GPT` ``ffn_factory`` that puts a `MoE`, with the MLP's GPT-2 init, in the given layers
    (all by default); the others keep a dense `MLP` (Switch and GShard alternate them)."""
    check_routing_args(n_experts, k, capacity_factor)
    chosen = None if layers is None else set(layers)

    def factory(config: GPTConfig, layer: int) -> nn.Module:
        if chosen is not None and layer not in chosen:
            ffn = MLP(config)
        else:
            ffn = MoE(config.n_embd, config.d_ff, n_experts, k, capacity_factor,
                      bias=config.bias, **kwargs)
        init_weights(ffn, config)
        return ffn

    return factory


def shard_experts(model: nn.Module, group=None) -> nn.Module:
    """Replace every `MoE` inside `model` by its `ExpertParallelMoE` share, in place; returns `model`.
    Every rank of `group` calls it on identical models."""
    if type(model) is MoE:
        return ExpertParallelMoE.from_dense(model, group)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is MoE:
                setattr(parent, name, ExpertParallelMoE.from_dense(child, group))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts of every MoE layer in `model` (not router, not shared expert)."""
    return [p for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()]


def moe_all_reduce_gradients(model: nn.Module, dp_group, edp_group) -> None:
    """Average gradients for data parallelism with experts; call after backward, before the step.

    Dense parameters (router, attention, shared expert ...) get the mean over `dp_group`. An
    expert's gradient already holds the tokens of every rank of its ep group (the all-to-all's
    backward brought them back), so it is **summed** over `edp_group` and divided by the dp size:
    the same mean. Both groups come from the mesh (``mesh.dp_group``, ``mesh.edp_group``); with
    plain `MoE` layers pass the dp group twice. Parameters without a gradient are skipped (the
    same ones on every rank).
    """
    dp = dist.get_world_size(dp_group)
    experts = {id(p) for p in expert_parameters(model)}
    grads = [p for p in model.parameters() if p.grad is not None]
    # one all-reduce per group (`all_reduce_coalesced`), each divided by dp
    comms.all_reduce_coalesced([p.grad for p in grads if id(p) not in experts], group=dp_group, divide_by=dp)
    comms.all_reduce_coalesced([p.grad for p in grads if id(p) in experts], group=edp_group, divide_by=dp)
