"""Hidden checks of homework 02's exercise on FSDP around a model the student writes.

``wrap_tiny_lm(weights, heads, mp_policy)``: build the small Transformer the exercise specifies
(its own Linear, Embedding and RMSNorm; parameter names and shapes as in ``weights``), load
``weights``, then wrap it with `reference.zero.fully_shard`: each block, then the root, with
``mp_policy``, the norms' gains in ``replicate_params``; return the model. On 2 ranks the grader
then trains it for `STEPS` AdamW steps, each rank on its own batch, and checks:

* the wrapped modules are every block and the root (a unit per block, the rest in the root);
* each wrapped module carries the policy passed in;
* between steps every Linear and Embedding weight holds its ceil(d0 / N) rows (a shard) and
  every norm's gain is whole (replicated);
* in fp32, the shards' gradients after the first backward are this rank's rows of one process's
  gradient on the whole batch, within `gradient(N)` at the scale of each tensor's largest;
* the whole weights after the steps (`full_state_dict`) equal one process's, which casts its
  fp32 master weights to ``param_dtype`` for each forward and backward and steps AdamW on the
  masters, within `adamw_weights(STEPS, lr, dtype)` (`reference/tolerance.py` says why: a weight
  whose gradient is within rounding of zero may take its whole step either way; the mean
  difference is held to a share of that). In fp16 and bf16 the gradients are left to that
  bound: an implementation of the same formulas in another order rounds differently.

Cases: fp32 with a vocabulary that 2 does not divide (padded rows); bf16 compute with fp32
reduction; fp16 compute and ``reduce_dtype=None`` (FSDP2: reduce in ``param_dtype``).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import adamw_weights, gradient
from reference.zero import MixedPrecisionPolicy, full_state_dict, fully_shard
from reference.zero.rows import shard_rows

__all__ = ["WRAP_TINY_LM", "TinyLM", "course_wrap_tiny_lm"]

STEPS, LR, BATCH, T, EPS = 3, 1e-3, 2, 8, 1e-6
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------ the grader's model
# Written as functions of the weights, not as the exercise's layer classes: a student's own
# classes are never mistaken for a copy of the grader's (`refuse`).
def _rms_norm(x, w):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).type_as(x) * w


def _block(b, x, heads):
    B, T_, C = x.shape
    q, k, v = F.linear(_rms_norm(x, b.norm1.weight), b.qkv.weight).split(C, dim=-1)   # (B, T, C)
    q, k, v = (t.view(B, T_, heads, C // heads).transpose(1, 2) for t in (q, k, v))    # (B, H, T, C/H)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T_, C)
    x = x + F.linear(y, b.proj.weight)
    return x + F.linear(F.gelu(F.linear(_rms_norm(x, b.norm2.weight), b.up.weight)), b.down.weight)


def _holder(weight: torch.Tensor) -> nn.Module:
    """A module whose one parameter is ``weight``: the exercise's names, ``<layer>.weight``."""
    m = nn.Module()
    m.weight = nn.Parameter(weight.clone())
    return m


class TinyLM(nn.Module):
    """The exercise's model, its shapes and weights from ``weights``."""

    def __init__(self, weights: dict, heads: int):
        super().__init__()
        self.heads, self.embed = heads, _holder(weights["embed.weight"])
        self.blocks = nn.ModuleList()
        for i in range(len({k.split(".")[1] for k in weights if k.startswith("blocks.")})):
            block = nn.Module()
            for name in ("norm1", "qkv", "proj", "norm2", "up", "down"):
                setattr(block, name, _holder(weights[f"blocks.{i}.{name}.weight"]))
            self.blocks.append(block)
        self.norm, self.head = _holder(weights["norm.weight"]), _holder(weights["head.weight"])

    def forward(self, idx, targets):
        x = F.embedding(idx, self.embed.weight)                                    # (B, T, C)
        for block in self.blocks:
            x = _block(block, x, self.heads)
        logits = F.linear(_rms_norm(x, self.norm.weight), self.head.weight)          # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def course_wrap_tiny_lm(weights, heads, mp_policy):
    """The course's answer: a unit per block, then the root; the norms' gains replicated."""
    model = TinyLM(weights, heads)
    norms = {p for name, p in model.named_parameters() if "norm" in name}
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy, replicate_params=norms)
    return fully_shard(model, mp_policy=mp_policy, replicate_params=norms)


# ------------------------------------------------------------------ cases
def _weights(generator, vocab, dim, layers) -> dict:
    def randn(*shape, scale):
        return torch.randn(*shape, generator=generator) * scale

    w = {"embed.weight": randn(vocab, dim, scale=0.5)}
    for i in range(layers):
        w |= {f"blocks.{i}.norm1.weight": 1 + randn(dim, scale=0.1),
              f"blocks.{i}.qkv.weight": randn(3 * dim, dim, scale=dim ** -0.5),
              f"blocks.{i}.proj.weight": randn(dim, dim, scale=dim ** -0.5),
              f"blocks.{i}.norm2.weight": 1 + randn(dim, scale=0.1),
              f"blocks.{i}.up.weight": randn(4 * dim, dim, scale=dim ** -0.5),
              f"blocks.{i}.down.weight": randn(dim, 4 * dim, scale=(4 * dim) ** -0.5)}
    return w | {"norm.weight": 1 + randn(dim, scale=0.1), "head.weight": randn(vocab, dim, scale=dim ** -0.5)}


def make_cases(generator, world_size) -> list:
    plan = (("fp32, a vocabulary N does not divide", "float32", None, 2),
            ("bf16 compute, fp32 reduction", "bfloat16", "float32", 2),
            ("fp16 compute, reduce_dtype None", "float16", None, 1))
    cases = []
    for name, param, reduce, layers in plan:
        vocab = world_size * int(torch.randint(8, 14, (), generator=generator)) + 1
        weights = _weights(generator, vocab, 16, layers)
        idx = torch.randint(0, vocab, (world_size, STEPS, BATCH, T + 1), generator=generator)
        cases.append(Case(name, [{"weights": weights, "heads": 2, "param_dtype": param,
                                  "reduce_dtype": reduce, "x": idx[r, :, :, :-1], "y": idx[r, :, :, 1:]}
                                 for r in range(world_size)]))
    return cases


def _policy(case) -> MixedPrecisionPolicy:
    param = None if case["param_dtype"] == "float32" else DTYPES[case["param_dtype"]]
    reduce = None if case["reduce_dtype"] is None else DTYPES[case["reduce_dtype"]]
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def call(fn, case: dict) -> dict:
    weights = {k: v.clone() for k, v in case["weights"].items()}
    model = fn(weights, case["heads"], _policy(case))
    if not isinstance(model, nn.Module):
        return {"error": f"returned a {type(model).__name__}, not the wrapped model (an nn.Module)"}
    states = {name: fully_shard.state(m) for name, m in model.named_modules()}
    wrapped = sorted(name for name, s in states.items() if s is not None)
    policies = sorted({(str(s.mp.param_dtype), str(s.mp.reduce_dtype))
                       for s in states.values() if s is not None})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    grads = {}
    for step in range(STEPS):
        model(case["x"][step], case["y"][step]).backward()
        if step == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"error": "", "wrapped": wrapped, "policies": [list(p) for p in policies],
            "shapes": {k: list(p.shape) for k, p in model.named_parameters()},
            "grads": grads, "weights": full_state_dict(model)}


def expect(inputs: list) -> dict:
    """One process on the whole batch: weights cast to param_dtype for forward and backward,
    gradients cast back, AdamW on the fp32 masters."""
    case = inputs[0]
    master = TinyLM({k: v.clone() for k, v in case["weights"].items()}, case["heads"])
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    grads = None
    for step in range(STEPS):
        work = copy.deepcopy(master).to(DTYPES[case["param_dtype"]])
        work(torch.cat([r["x"][step] for r in inputs]), torch.cat([r["y"][step] for r in inputs])).backward()
        for p, w in zip(master.parameters(), work.parameters()):
            p.grad = w.grad.float()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in master.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "weights": {k: p.detach().clone() for k, p in master.named_parameters()},
            "blocks": len(master.blocks)}


def judge(inputs, expected, outputs, world_size) -> str:
    case, want_w = inputs[0], expected["weights"]
    want_wrapped = sorted([""] + [f"blocks.{i}" for i in range(expected["blocks"])])
    policy = _policy(case)
    want_policy = [[str(policy.param_dtype), str(policy.reduce_dtype)]]
    dtype = DTYPES[case["param_dtype"]]
    for rank, out in enumerate(outputs):
        if out["error"]:
            return f"rank {rank}: {out['error']}"
        if out["wrapped"] != want_wrapped:
            return (f"rank {rank}: fully_shard wraps {out['wrapped'] or 'nothing'} ('' is the root), "
                    f"not each block and then the root {want_wrapped}")
        if out["policies"] != want_policy:
            return f"rank {rank}: the wrapped modules carry the policies {out['policies']}, not mp_policy"
        if sorted(out["shapes"]) != sorted(want_w):
            return (f"rank {rank}: the model's parameters are {sorted(out['shapes'])}, not the "
                    f"exercise's names {sorted(want_w)}")
        for k, shape in out["shapes"].items():
            whole = list(want_w[k].shape)
            want = whole if "norm" in k else [math.ceil(whole[0] / world_size)] + whole[1:]
            if shape != want:
                kind = "a norm's gain stays whole (replicated)" if "norm" in k else "a weight is sharded"
                return f"rank {rank}: {k} holds {shape} between steps, not {want}: {kind}"
        if dtype is torch.float32:
            for k, want in expected["grads"].items():
                rows = want if "norm" in k else shard_rows(want, rank, world_size)
                got = out["grads"].get(k)
                if got is None or not gradient(world_size).at_scale(want.abs().max().item()).close(got, rows):
                    return (f"rank {rank}: the gradient of {k} after the first backward is not this "
                            f"rank's rows of the whole batch's mean gradient")
        try:
            adamw_weights(STEPS, LR, dtype=dtype).assert_weights(out["weights"], want_w)
        except AssertionError as error:
            return (f"rank {rank}: after {STEPS} steps the weights differ from one process training "
                    f"on the whole batch ({str(error).lstrip(': ')})")
    return ""


WRAP_TINY_LM = ExerciseSpec(
    id="wrap_tiny_lm", title="FSDP around a Transformer you write", difficulty="★★☆ medium",
    world_sizes=(2,), make_cases=make_cases, call=call, expect=expect, judge=judge,
    reference=course_wrap_tiny_lm,
    forbidden=(),  # fully_shard's own collectives: the exercise is to use it
    banned=("reference.course.homework.zero_fully_shard.course_wrap_tiny_lm",
            "reference.course.homework.zero_fully_shard.TinyLM"))
