"""The plain GPT every parallel version in the course is compared with.

A GPT-2 style decoder (pre-LayerNorm blocks, learned positions, tied output layer), small
enough to train on a laptop CPU. It knows nothing of distribution: each parallelism is applied
to it from outside and checked against it. Module names follow nanoGPT and Megatron
(``c_attn``, ``c_proj``, ``c_fc``, ``wte``, ``wpe``, ``h``, ``ln_f``, ``lm_head``) so that
parallel code finds the layers it splits by name.

The feed-forward slot: ``GPT(config, ffn_factory=fn)`` builds each block's ``ffn`` with
``fn(config, layer_index)`` instead of the dense :class:`MLP`; a mixture of experts fills the
slot this way. The ffn maps ``(B, T, C) -> (B, T, C)`` and returns that tensor or
``(tensor, aux_loss)``, ``aux_loss`` 0-dim (a load-balancing loss, already multiplied by its
coefficient); :meth:`GPT.forward`'s loss adds every block's aux loss to the cross-entropy.
GPT does not re-initialise a module the factory built; the factory may call
:func:`init_weights` on it to match the dense MLP.
"""

from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["autocast", "weight_decay_groups", "GPTConfig", "causal_attention", "CausalSelfAttention", "MLP",
           "Block", "GPT", "init_weights", "lm_loss", "sample_next_token", "saved_buffers"]


@dataclass
class GPTConfig:
    """Shape of the model. ``d_ff=None`` means ``4 * n_embd``, resolved at creation: so
    ``dataclasses.replace(cfg, n_embd=...)`` keeps the old ``d_ff`` unless given ``d_ff=None``."""

    vocab_size: int = 256  # byte-level: every byte is a token
    block_size: int = 128  # longest sequence (number of learned positions)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    d_ff: Optional[int] = None  # hidden width of the MLP
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers
    tie_weights: bool = True  # lm_head.weight is wte.weight

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 4 * self.n_embd
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head} "
                             f"(each head gets n_embd // n_head channels)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def tiny(cls, **overrides) -> "GPTConfig":
        """For tests: trains a step in a few milliseconds on a CPU."""
        # 4 heads, d_ff 128 and vocab 256 all split evenly over 2 or 4 ranks.
        return cls(**{**dict(block_size=32, n_layer=2, n_head=4, n_embd=32), **overrides})

    @classmethod
    def small(cls, **overrides) -> "GPTConfig":
        """For demos: about 0.8M parameters, learns visible structure in minutes on a CPU."""
        return cls(**{**dict(block_size=128, n_layer=4, n_head=4, n_embd=128), **overrides})


def causal_attention(qkv: torch.Tensor, head_dim: int, dropout_p: float = 0.0) -> torch.Tensor:
    """The heads of a fused projection's output [q | k | v] attend: (B, T, 3 C) -> (B, T, C).

    The number of heads comes from the width, so a tensor-parallel c_attn holding only some
    heads (Megatron's column split: 3 * C // tp wide) runs through this same code."""
    B, T, _ = qkv.shape
    q, k, v = qkv.chunk(3, dim=-1)  # each (B, T, C)
    n_head = q.shape[-1] // head_dim
    q, k, v = (t.view(B, T, n_head, head_dim).transpose(1, 2) for t in (q, k, v))
    # q, k, v: (B, n_head, T, head_dim); softmax(q k^T / sqrt(head_dim)) v
    # with position t attending only to positions <= t.
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, n_head, T, head_dim)
    return y.transpose(1, 2).reshape(B, T, n_head * head_dim)  # (B, T, C)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q, k, v projection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        # One GEMM for q, k and v: the output columns are [q | k | v], each
        # C wide, and inside each the heads sit one after another.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 * C)
        y = causal_attention(qkv, self.head_dim, self.dropout if self.training else 0.0)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """The dense feed-forward network: C -> d_ff -> C with a GELU between."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.d_ff, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(config.d_ff, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gelu(self.c_fc(x))  # (B, T, d_ff)
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln_1(x)), then x + ffn(ln_2(x))."""

    def __init__(self, config: GPTConfig, ffn: Optional[nn.Module] = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.ffn = ffn if ffn is not None else MLP(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, C) -> ((B, T, C), aux_loss); aux_loss is 0-dim, zero for a dense ffn."""
        x = x + self.attn(self.ln_1(x))
        out = self.ffn(self.ln_2(x))
        if isinstance(out, tuple):
            out, aux_loss = out
        else:
            aux_loss = x.new_zeros(())
        return x + out, aux_loss


def init_weights(module: nn.Module, config: GPTConfig) -> None:
    """GPT-2 initialisation of every Linear and Embedding inside ``module``: weights ~ N(0, 0.02),
    biases 0; the projections into the residual stream (``c_proj``) get std 0.02 / sqrt(2 n_layer),
    so that the 2 n_layer branches adding to the stream keep its variance from growing with depth
    (GPT-2 paper, section 2.3). LayerNorms keep PyTorch's gain 1 and bias 0."""
    proj_std = 0.02 / math.sqrt(2 * config.n_layer)
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            std = proj_std if name.split(".")[-1] == "c_proj" else 0.02
            nn.init.normal_(sub.weight, mean=0.0, std=std)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.Embedding):
            nn.init.normal_(sub.weight, mean=0.0, std=0.02)


def saved_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: buffer} of the buffers ``module.state_dict()`` saves (the persistent ones: a router's
    ``expert_bias``), by the names state_dict gives them; state like the weights, never sharded."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in params}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of (B, T, V) logits against (B, T) targets: the mean over the counted
    tokens (targets of -100, such as padding, count for nothing), or with
    ``reduction="sum"`` their sum (`reference.loss` says which a parallel step needs)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)


FFNFactory = Callable[[GPTConfig, int], nn.Module]


class GPT(nn.Module):
    """The GPT language model: token ids (B, T) -> logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig, ffn_factory: Optional[FFNFactory] = None):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        init_weights(self, config)
        if config.tie_weights:
            # One (V, C) matrix both embeds tokens and scores them (Press & Wolf, 2017).
            self.lm_head.weight = self.wte.weight
        if ffn_factory is not None:
            # Built after GPT's own init, so the factory's module keeps its own
            # weights and the dense model's RNG draws are unchanged.
            for i, block in enumerate(self.h):
                block.ffn = ffn_factory(config, i)
        self.last_lm_loss: Optional[torch.Tensor] = None
        self.last_aux_loss: Optional[torch.Tensor] = None

    @classmethod
    def from_config_seed(cls, config: GPTConfig, seed: int, ffn_factory: Optional[FFNFactory] = None) -> "GPT":
        """Build the model with weights drawn from ``seed``; the global RNG is left as it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(config, ffn_factory)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, a tied matrix counted once. ``exclude_embeddings=True`` leaves out
        the token and position tables and an untied lm_head: Kaplan et al.'s "non-embedding" count
        (about 12 * n_layer * n_embd**2 with d_ff = 4 * n_embd)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
            if self.lm_head.weight is not self.wte.weight:
                n -= self.lm_head.weight.numel()
        return n

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the residual stream entering block 0, (B, T, C)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} is longer than block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last block (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.ln_f(x))

    def logits_and_aux(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (B, T) -> (logits (B, T, V), the sum of the blocks' auxiliary losses, 0-dim)."""
        x = self.embed(idx)  # (B, T, C)
        aux_loss = x.new_zeros(())
        for block in self.h:
            x, block_aux = block(x)
            aux_loss = aux_loss + block_aux
        return self.head(x), aux_loss  # (B, T, V)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns (logits (B, T, V), loss): loss = lm_loss + sum of aux losses, or None without targets.
        Both parts of the last forward are kept, detached, in ``last_lm_loss`` and ``last_aux_loss``."""
        logits, aux_loss = self.logits_and_aux(idx)
        self.last_aux_loss = aux_loss.detach()
        if targets is None:
            self.last_lm_loss = None
            return logits, None
        loss = lm_loss(logits, targets)
        self.last_lm_loss = loss.detach()
        return logits, loss + aux_loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Append ``max_new_tokens`` tokens drawn by `sample_next_token` to ``idx`` (B, T); returns
        (B, T + max_new_tokens). Runs in eval mode (no dropout) and restores the mode."""
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = idx[:, -self.config.block_size :]  # the model sees at most block_size tokens
                logits, _ = self(context)
                # (B, V): the next-token scores -> (B, 1)
                next_token = sample_next_token(logits[:, -1, :], temperature, top_k, generator)
                idx = torch.cat([idx, next_token], dim=1)
        finally:
            self.train(was_training)
        return idx


def autocast(precision: str, device_type: str):
    """The forward's precision, one place for every loop: ``torch.autocast`` to bf16 or fp16 for
    "bf16" and "fp16" (the weights and their gradients stay fp32), nothing for "fp32"."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def weight_decay_groups(params, weight_decay: float) -> list[dict]:
    """Optimizer groups as nanoGPT makes them: with ``weight_decay``, the matrices (dim >= 2)
    decayed and the biases and LayerNorm gains (dim < 2) not; one group without. An empty group
    is left out (torch refuses one). ZeRO-3's per-parameter shards keep each tensor's dim."""
    params = list(params)
    if weight_decay == 0:
        groups = [{"params": params, "weight_decay": 0.0}]
    else:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token of each row of ``logits`` (B, V): greedy at ``temperature=0``, else drawn
    from the softmax of logits / temperature, among the ``top_k`` largest when given. (B, 1)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if generator is not None and generator.device != probs.device:
        # A CPU generator with logits on a GPU (or the reverse): draw where the generator
        # lives, so that the same seed gives the same tokens on every device.
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator)
