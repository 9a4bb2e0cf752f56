"""Sampling from a parallel model: every rank draws the same tokens as the plain GPT would.

    tokens = generate(pm, prompt, max_new_tokens=20, temperature=1.0,
                      generator=torch.Generator().manual_seed(0))   # on every rank

One token at a time, the context runs down the pipeline (each stage sends its output to the
next stage's rank), the last stage's vocab-parallel logits are gathered whole, the last stage
samples as `GPT.generate` does and broadcasts the token to every stage. Only the last stage's
generator draws. Under sequence parallelism a context whose length tp does not divide is
padded at the end; attention is causal, so no real position sees the padding."""
from __future__ import annotations

from typing import Optional

import torch

from reference import comms
from reference.model import sample_next_token
from reference.tensor_parallel.loss import VocabParallelLMHead

__all__ = ["generate"]


def _logits_of_last_position(pm, context: torch.Tensor, device) -> Optional[torch.Tensor]:
    """Run ``context`` (B, T) through the pipeline; (B, V) on the last stage, None elsewhere."""
    mesh, config = pm.mesh, pm.config
    B, T = context.shape
    tp = mesh.tp
    t_msg = -(-T // tp) if config.sequence_parallel and tp > 1 else T  # (B, T / tp, C) under SP
    C = pm.model_config.n_embd
    pp_ranks = mesh.group_ranks_of(mesh.rank, "pp") if mesh.pp > 1 else [mesh.rank]
    out, sched = None, pm.schedule  # where each stage lives: `Schedule.rank_of` (ZB-V: a V)
    for s in range(config.n_stages):
        owner = sched.rank_of(s)
        if owner != mesh.pp_rank:
            continue
        stage = pm.stages[next(c for c in range(sched.virtual) if sched.stage(owner, c) == s)]
        if s == 0:
            x = context.to(device)
        elif sched.rank_of(s - 1) == owner:  # the V's turn: the previous stage is this rank's
            x = out
        else:
            x = torch.empty(B, t_msg, C, device=device)
            comms.recv(x, src=pp_ranks[sched.rank_of(s - 1)], group=mesh.group("pp"))
        out, _ = stage(x)
        if s < config.n_stages - 1 and sched.rank_of(s + 1) != owner:
            comms.send(out.contiguous(), dst=pp_ranks[sched.rank_of(s + 1)], group=mesh.group("pp"))
    last = config.n_stages - 1  # (DualPipe: the last stage of the direction from rank 0)
    if sched.rank_of(last) != mesh.pp_rank:
        return None
    head = pm.stages[next(c for c in range(sched.virtual) if sched.stage(mesh.pp_rank, c) == last)].lm_head
    logits = head.gather(out) if isinstance(head, VocabParallelLMHead) else out  # (B, T', V)
    return logits[:, T - 1, :]  # the last real position (padding, if any, lies after it)


@torch.no_grad()
def generate(pm, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """`GPT.generate` for a `ParallelGPT`: (B, T) -> (B, T + max_new_tokens), on every rank."""
    if pm.mesh.cp > 1:
        raise ValueError(f"generate with cp={pm.mesh.cp} ({pm.config}): the context grows one token "
                         f"at a time and does not split over the cp ranks; sample with cp=1")
    # ZeRO-3: sampled on whole weights (gathered for it, or by the wrapped GPT itself)
    return pm.data_parallel.generate(pm, _sample, idx, max_new_tokens, temperature, top_k, generator)


@torch.no_grad()
def _sample(pm, idx, max_new_tokens, temperature, top_k, generator) -> torch.Tensor:
    """The tokens, one at a time, on the last `block_size` positions (the module docstring's loop)."""
    from reference.runtime import device as rank_device

    device = rank_device()
    was_training = [st.training for st in pm.stages]
    pm.eval()
    block = pm.model_config.block_size
    idx = idx.to(device)
    try:
        for _ in range(max_new_tokens):
            logits = _logits_of_last_position(pm, idx[:, -block:], device)
            token = torch.empty(idx.shape[0], 1, dtype=torch.long, device=device)
            if logits is not None:  # the last stage samples, as GPT.generate does
                token = sample_next_token(logits, temperature, top_k, generator)
            if pm.mesh.pp > 1:  # the last stage's token, to every stage
                last = pm.mesh.group_ranks_of(pm.mesh.rank, "pp")[pm.schedule.rank_of(pm.config.n_stages - 1)]
                comms.broadcast(token, src=last, group=pm.mesh.group("pp"))
            idx = torch.cat([idx, token], dim=1)
    finally:
        for st, mode in zip(pm.stages, was_training):
            st.train(mode)
    return idx
