"""Hidden checks of homework 03's sequence-parallel exercise and its written question, and
the course's answers to the homework's first two exercises (to refuse them).

sequence_parallel_mlp (2 and 3 ranks): Megatron's MLP sub-block under sequence
parallelism, z = x + GeLU(LN(x) A) B, where each rank holds its tokens of x, split along
the sequence as ``torch.tensor_split`` splits it (the first ``T % tp`` ranks one token
longer: uneven shards, which ``all_gather_into_tensor`` does not take as they are), the
LayerNorm's weight and bias whole (replicated), A's columns and B's rows. Forward must be
one all-gather along the sequence (of the LayerNorm's output) and one reduce-scatter
(of the partial sums); backward the reverse pair, plus at most two all-reduces of at
most 2 C numbers in all: the LayerNorm's gradients, partial on every rank since each
LayerNorm saw only its own tokens. Cases: T divisible by tp, T not divisible with an
uneven hidden split, float64, and H < tp (an empty shard of A). Judged against the
dense computation in float64: z and x.grad (this rank's tokens), a_shard.grad,
b_shard.grad (this rank's columns, rows), and the LayerNorm's gradients whole on every
rank. Tolerance `reference.tolerance.forward().at_scale(10)`, as for tensor_parallel_mlp
(partial sums added in another order than one dense product move float32 values of
order 1 to 10 by a few ulps of 10; the float64 case is held to the same bound).

tp_layer_bytes: the written question, graded exactly: bytes one TP rank sends per
transformer layer in forward and backward, without and with sequence parallelism.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.course.homework.data_parallel import collectives_allowed
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.questions import question
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tensor_parallel.comms import f as course_f, g as course_g
from reference.tensor_parallel.loss import vocab_parallel_cross_entropy as course_loss
from reference.tolerance import forward

__all__ = ["SEQUENCE_PARALLEL", "TP_LAYER_BYTES", "course_tensor_parallel_mlp",
           "course_vocab_parallel_cross_entropy", "course_sequence_parallel_mlp",
           "tp_layer_bytes_formula"]

TOLERANCE = forward().at_scale(10)  # values of order 1 to 10, as in tensor_parallel
_GATHER = ("allgather", "_allgather_base", "all_gather_single")
_SCATTER = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single")
ALLOWED = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
           "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
           "reduce_scatter_single")


# ------------------------------------------------------------------ the course's answers

def course_tensor_parallel_mlp(x, a_shard, b_shard, group=None):
    """Exercise tensor_parallel_mlp with the package's f and g."""
    return course_g(F.gelu(course_f(x, group) @ a_shard) @ b_shard, group)


def course_vocab_parallel_cross_entropy(logits_shard, targets, vocab_size, group=None):
    """Exercise vocab_parallel_cross_entropy with the package's loss."""
    return course_loss(logits_shard, targets, group, vocab_size=vocab_size)


def _lengths(seq_len: int, n: int) -> list[int]:
    return [len(c) for c in torch.arange(seq_len).tensor_split(n)]


def _gather(x, seq_len, group):
    """(B, T_r, C) on each rank -> (B, T, C): every shard padded to the longest, then cut."""
    n = dist.get_world_size(group)
    lengths = _lengths(seq_len, n)
    padded = F.pad(x, (0, 0, 0, lengths[0] - x.shape[1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([parts[r][:, :lengths[r]] for r in range(n)], dim=1)


def _reduce_scatter(x, seq_len, group):
    """(B, T, C) partial sums -> (B, T_r, C), this rank's tokens summed over the ranks."""
    pieces = [p.contiguous() for p in x.split(_lengths(seq_len, dist.get_world_size(group)), dim=1)]
    out = torch.empty_like(pieces[dist.get_rank(group)])
    dist.reduce_scatter(out, pieces, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_len, group):
        ctx.seq_len, ctx.group = seq_len, group
        return _gather(x, seq_len, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.seq_len, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_len, group):
        ctx.seq_len, ctx.group = seq_len, group
        return _reduce_scatter(x, seq_len, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.seq_len, ctx.group), None, None


class _SumGradients(torch.autograd.Function):
    """A replicated parameter used on this rank's tokens only: its gradient is summed."""

    @staticmethod
    def forward(ctx, p, group):
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


def _summed(t, group):
    out = t.clone()  # all_reduce works in place; autograd may hand `t` elsewhere too
    dist.all_reduce(out, group=group)
    return out


def course_sequence_parallel_mlp(x_shard, ln_weight, ln_bias, a_shard, b_shard, seq_len,
                                 group=None):
    """The course's answer to sequence_parallel_mlp (uneven sequence shards included)."""
    weight, bias = _SumGradients.apply(ln_weight, group), _SumGradients.apply(ln_bias, group)
    h = F.layer_norm(x_shard, x_shard.shape[-1:], weight, bias)  # (B, T_r, C)
    full = _GatherSequence.apply(h, seq_len, group)  # (B, T, C)
    partial = F.gelu(full @ a_shard) @ b_shard  # (B, T, C), this rank's term
    return x_shard + _ReduceScatterSequence.apply(partial, seq_len, group)


# ------------------------------------------------------------------ cases, call, expect

def make_sp_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    t = world_size
    plan = (("T divides by tp", 2, 2 * t, 6, 2 * t, torch.float32),
            ("T does not divide, uneven hidden split", 1, 2 * t + 1, 5, 2 * t + 1, torch.float32),
            ("float64, T = tp + 1", 2, t + 1, 4, t, torch.float64),
            ("H < tp: an empty shard of A", 1, 3 * t - 1, 7, t - 1, torch.float32))
    cases = []
    for what, b, seq, c, hidden, dtype in plan:
        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)
        x, grad_z = rand(b, seq, c), rand(b, seq, c)
        weight, bias = 1 + rand(c, scale=0.2), rand(c, scale=0.2)
        a, bm = rand(c, hidden, scale=c ** -0.5), rand(hidden, c, scale=max(hidden, 1) ** -0.5)
        rows, cols = torch.arange(seq).tensor_split(t), torch.arange(hidden).tensor_split(t)
        inputs = [{"x": x[:, r].contiguous(), "grad_z": grad_z[:, r].contiguous(),
                   "ln_weight": weight, "ln_bias": bias, "a": a[:, k].contiguous(),
                   "b": bm[k].contiguous(), "seq_len": seq} for r, k in zip(rows, cols)]
        cases.append(Case(f"B={b} T={seq} C={c} H={hidden} ({what})", inputs))
    return cases


def call_sp(fn, inp: dict) -> dict:
    leaves = {k: inp[k].clone().requires_grad_() for k in ("x", "ln_weight", "ln_bias", "a", "b")}
    log: list = []
    out = {"z": None, "type": None}
    with collectives_allowed(("allreduce",) + _GATHER + _SCATTER,
                             lambda name, numel, *_: log.append([name, int(numel)])):
        z = fn(leaves["x"], leaves["ln_weight"], leaves["ln_bias"], leaves["a"], leaves["b"],
               inp["seq_len"], dist.group.WORLD)
        out.update(type=type(z).__name__, forward=list(log))
        if type(z) is not torch.Tensor:
            return out
        out["z"] = z.detach().clone()
        out["requires_grad"] = z.requires_grad
        if z.shape != inp["grad_z"].shape or not z.requires_grad:
            return out
        z.backward(inp["grad_z"])
        out["backward"] = log[len(out["forward"]):]
    out["grads"] = {k: None if v.grad is None else v.grad.detach().clone() for k, v in leaves.items()}
    return out


def expect_sp(inputs: list) -> list:
    """Dense float64 truth; the LayerNorm's gradients also as each rank's own part."""
    xs = [i["x"].double().requires_grad_() for i in inputs]
    a = torch.cat([i["a"] for i in inputs], dim=1).double().requires_grad_()
    bm = torch.cat([i["b"] for i in inputs], dim=0).double().requires_grad_()
    weight, bias = inputs[0]["ln_weight"].double(), inputs[0]["ln_bias"].double()
    # One copy of the LayerNorm per rank's tokens: their gradients are the ranks' parts.
    parts = [(weight.clone().requires_grad_(), bias.clone().requires_grad_()) for _ in inputs]
    x = torch.cat(xs, dim=1)
    h = torch.cat([F.layer_norm(xr, xr.shape[-1:], w, b) for xr, (w, b) in zip(xs, parts)], dim=1)
    z = x + F.gelu(h @ a) @ bm
    z.backward(torch.cat([i["grad_z"] for i in inputs], dim=1).double())
    weight = sum(w.grad for w, _ in parts)
    bias = sum(b.grad for _, b in parts)
    widths = [i["a"].shape[1] for i in inputs]
    lengths = [i["x"].shape[1] for i in inputs]
    return [{"z": zr.detach(), "x": xr.grad, "a": ga, "b": gb, "ln_weight": weight, "ln_bias": bias,
             "partial": (w.grad, b.grad)}
            for zr, xr, ga, gb, (w, b) in zip(z.split(lengths, dim=1), xs, a.grad.split(widths, dim=1),
                                              bm.grad.split(widths, dim=0), parts)]


# ------------------------------------------------------------------ judge

def _close(got, want) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and TOLERANCE.close(got, want))


def _count(log, names) -> list:
    return [n for name, n in log if name in names]


def _traffic(out: dict, n_channels: int) -> str:
    fwd, bwd = out["forward"], out["backward"]
    if _count(fwd, ("allreduce",)):
        return "forward all-reduces: the pair is an all-gather and a reduce-scatter, no all-reduce"
    if len(_count(fwd, _GATHER)) != 1 or len(_count(fwd, _SCATTER)) != 1:
        return (f"forward made {len(_count(fwd, _GATHER))} all-gather(s) and "
                f"{len(_count(fwd, _SCATTER))} reduce-scatter(s); it needs one of each")
    if len(_count(bwd, _GATHER)) != 1 or len(_count(bwd, _SCATTER)) != 1:
        return (f"backward made {len(_count(bwd, _GATHER))} all-gather(s) and "
                f"{len(_count(bwd, _SCATTER))} reduce-scatter(s); it needs one of each")
    reduced = _count(bwd, ("allreduce",))
    if len(reduced) > 2 or sum(reduced) > 2 * n_channels:
        return (f"backward all-reduced {reduced} numbers; only the LayerNorm's gradients "
                f"(2 C = {2 * n_channels} numbers) need it")
    return ""


def judge_sp(inputs, expected, outputs, world_size) -> str:
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        if out["z"] is None:
            return f"rank {rank} returned {out['type']}, not a tensor"
        if not _close(out["z"], want["z"]):
            return (f"rank {rank}: wrong output z (shape {tuple(out['z'].shape)}, expected this "
                    f"rank's {tuple(want['z'].shape)} tokens of x + GeLU(LN(x) A) B)")
        if not out["requires_grad"] or "grads" not in out:
            return f"rank {rank}: z does not require grad (the graph to the inputs is cut)"
        grads = out["grads"]
        for key, name in (("x", "x_shard.grad"), ("a", "a_shard.grad"), ("b", "b_shard.grad")):
            if not _close(grads[key], want[key]):
                return f"rank {rank}: wrong {name}"
        for key, partial in (("ln_weight", want["partial"][0]), ("ln_bias", want["partial"][1])):
            if not _close(grads[key], want[key]):
                own = _close(grads[key], partial)
                return (f"rank {rank}: wrong {key}.grad" + (
                    ": it is this rank's tokens' part only; sum it over the group" if own else ""))
    for rank, out in enumerate(outputs):
        if why := _traffic(out, inputs[rank]["ln_weight"].numel()):
            return f"rank {rank}: {why}"
    return ""


def _dense_only(_):
    raise TypeError("checked against the dense computation in the calling process")


# ------------------------------------------------------------------ the written question

def tp_layer_bytes_formula(b, s, h, tp, bytes_per_element, mode) -> int:
    """Bytes one TP rank sends in one layer's forward and backward (ring collectives):
    "tp" 4 all-reduces of b s h; "sp" 4 all-gathers and 4 reduce-scatters, plus the
    all-reduce of the 6 h sequence-parallel gradients; "sp_regather" 2 all-gathers more."""
    n = b * s * h
    numbers = {"tp": 8 * n, "sp": 8 * n + 12 * h, "sp_regather": 10 * n + 12 * h}[mode]
    return (tp - 1) * numbers * bytes_per_element // tp


SEQUENCE_PARALLEL = ExerciseSpec(
    id="sequence_parallel_mlp", title="Megatron's sequence parallelism: the pair and the LayerNorm",
    difficulty="★★★ hard", world_sizes=(2, 3), make_cases=make_sp_cases, call=call_sp,
    expect=expect_sp, judge=judge_sp, reference=_dense_only,
    forbidden=tuple(c for c in COLLECTIVES if c not in ALLOWED),
    banned=("reference.course.homework.tensor_parallel_transfer.course_sequence_parallel_mlp",
            "reference.tensor_parallel.comms", "reference.comms.functional.all_gather_along",
            "reference.tensor_parallel.plan",
            "reference.tensor_parallel.layers"))
TP_LAYER_BYTES = question(
    "tp_layer_bytes", "Bytes a TP rank sends per layer, with and without sequence parallelism",
    tp_layer_bytes_formula,
    {"b": (1, 2, 4, 8), "s": (1024, 2048, 4096, 8192), "h": (768, 1024, 4096, 12288),
     "tp": (1, 2, 4, 8), "bytes_per_element": (2, 4), "mode": ("tp", "sp", "sp_regather")},
    fixed=({"b": 1, "s": 6, "h": 12, "tp": 3, "bytes_per_element": 2, "mode": "sp"},
           {"b": 2, "s": 2048, "h": 4096, "tp": 8, "bytes_per_element": 2, "mode": "sp_regather"}),
    banned=("reference.course.homework.tensor_parallel_transfer.tp_layer_bytes_formula",), difficulty="★★☆ medium")
