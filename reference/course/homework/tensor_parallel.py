"""Hidden checks of homework 03: Megatron's f and g, and the vocabulary-parallel loss.

Both exercises may call `torch.distributed.all_reduce` and no other collective;
the course's own versions (`reference.tensor_parallel.comms`' f and g, and
`reference.tensor_parallel.loss`' cross-entropy) refuse to run while the
student's function is checked. Every all-reduce is counted, through the process
group itself, however the student's code reaches it.

tensor_parallel_mlp (2 and 4 ranks): Z = GeLU(X A) B with A split by columns and
B by the same rows. Cases: x of shapes (4, 6), (2, 3, 5), (3, 7) and (1, 4);
hidden sizes H that divide by tp, that do not (shards of different widths), and
H < tp (one rank holds an empty shard). Judged against the dense computation in
float64: Z and x.grad on every rank, and each rank's columns of dA and rows of
dB; plus one all-reduce forward and one backward (the cost of the pair).

vocab_parallel_cross_entropy (2 and 4 ranks): the mean cross-entropy of
vocab-sharded logits (N, V_pad / tp), V_pad = V rounded up to a multiple of tp, with
what the lecture only described: targets equal to IGNORE_INDEX (-100, padding tokens)
take no part (the mean is over the other tokens, their gradient rows are 0), and
bfloat16 logits are upcast, the loss computed and returned in float32.
Cases: V divisible by tp, V not divisible (padding columns hold large garbage,
so a loss that reads them is wrong), V leaving the last rank only padding (4
ranks), logits of scale 100 (exp overflows in float32 without the max shift),
N = 1, ignored tokens, bfloat16 logits (with and without ignored tokens). Judged
against F.cross_entropy(..., ignore_index=-100) on the full (N, V) logits in float64:
the loss (float32) on every rank, and each rank's shard of the gradient (zero on
padding and on ignored rows; bfloat16 gradients within `forward(torch.bfloat16)`, their
own rounding); plus at most 4 N numbers all-reduced in all (the reference sends 3 N,
gathering the logits would send N * V_pad). The lecture's loss, which divides by N and
computes in the logits' dtype, loses every case with ignored tokens or bfloat16.

Tolerances, the course's (reasoned in reference/tolerance.py): `forward().at_scale(10)`
for Z, x.grad, dA, dB and the loss: the ranks' partial sums are added in another order
than one dense product, which moves float32 values of order 1 to 10 by a few ulps of
10, not of 1; `forward()` for the gradient of the loss (its entries are below 1 / N).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.tensor_parallel.comms import CopyToRegion as _CopyToRegion, ReduceFromRegion as _ReduceFromRegion
from reference.tensor_parallel.loss import VocabParallelCrossEntropy as _VocabParallelCrossEntropy
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.refuse import Refusal
from reference.course.homework.scoring import WARM_UP, Case, ExerciseSpec
from reference.tolerance import forward

__all__ = ["MLP", "CROSS_ENTROPY", "EXERCISES", "ONLY_ALL_REDUCE", "counted_all_reduce",
           "course_versions_refused"]

ONLY_ALL_REDUCE = tuple(c for c in COLLECTIVES if c != "all_reduce")
TOLERANCE = forward().at_scale(10)  # values of order 1 to 10 (the docstring)
GRAD_TOLERANCE = forward()  # the loss's gradient: entries below 1 / N
BF16_GRAD_TOLERANCE = forward(torch.bfloat16)  # a bfloat16 gradient's own rounding
IGNORE_INDEX = -100
# The backend's own method, taken when this module is imported: in a rank that is
# before any exercise rules replace it (the spec's unpickling imports this module).
_ALLREDUCE = dist.ProcessGroup.__dict__["allreduce"]


# ------------------------------------------------------------------ inside a rank

@contextlib.contextmanager
def counted_all_reduce():
    """While open, all-reduce works (the rules switch every process-group collective off)
    and each call appends its element count to the yielded list."""
    log: list[int] = []

    def allreduce(self, tensors, *args, **kwargs):
        log.append(sum(int(t.numel()) for t in tensors) if isinstance(tensors, (list, tuple))
                   else int(tensors.numel()))
        return _ALLREDUCE(self, tensors, *args, **kwargs)

    previous = dist.ProcessGroup.__dict__["allreduce"]
    dist.ProcessGroup.allreduce = allreduce
    try:
        yield log
    finally:
        dist.ProcessGroup.allreduce = previous


@contextlib.contextmanager
def course_versions_refused(exercise: str, functions):
    """While open, the course's autograd functions `functions` raise NotAllowedError when
    run, whoever calls them (`Refusal` watching every call: nothing is patched); the
    grader's own Refusal around the student's call records it, caught or not."""
    with Refusal(exercise, functions, course=False, student_only=False).watching(settle=False):
        yield


def _plain(value):
    return value.detach().clone() if type(value) is torch.Tensor else None


def _grad(t: torch.Tensor):
    return None if t.grad is None else t.grad.detach().clone()


def call_mlp(fn, inp: dict) -> dict:
    x, a, b = (inp[k].clone().requires_grad_() for k in ("x", "a", "b"))
    out = {"returned_type": None, "z": None, "forward_calls": 0, "backward_calls": 0}
    with course_versions_refused("tensor_parallel_mlp", (_CopyToRegion, _ReduceFromRegion)), \
            counted_all_reduce() as log:
        z = fn(x, a, b, dist.group.WORLD)
        out.update(returned_type=type(z).__name__, z=_plain(z), forward_calls=len(log))
        if out["z"] is None or z.shape != inp["grad_z"].shape or not z.requires_grad:
            out["requires_grad"] = out["z"] is not None and z.requires_grad
            return out
        z.backward(inp["grad_z"])
        out["backward_calls"] = len(log) - out["forward_calls"]
    out.update(requires_grad=True, grad_x=_grad(x), grad_a=_grad(a), grad_b=_grad(b))
    return out


def call_cross_entropy(fn, inp: dict) -> dict:
    logits = inp["logits"].clone().requires_grad_()
    out = {"returned_type": None, "loss": None, "all_reduced": 0}
    with course_versions_refused("vocab_parallel_cross_entropy", (_VocabParallelCrossEntropy,)), \
            counted_all_reduce() as log:
        loss = fn(logits, inp["targets"].clone(), inp["vocab_size"], dist.group.WORLD)
        out.update(returned_type=type(loss).__name__, loss=_plain(loss))
        ok = out["loss"] is not None and loss.dim() == 0 and loss.requires_grad
        out["requires_grad"] = out["loss"] is not None and loss.requires_grad
        if ok:
            loss.backward()
        out["all_reduced"] = sum(log)
    out["grad"] = _grad(logits)
    return out


# ------------------------------------------------------------------ cases (in the grader)

def make_mlp_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    tp = world_size
    plan = (((4, 6), 2 * tp, "H divides by tp"), ((2, 3, 5), 2 * tp + 1, "uneven shards"),
            ((3, 7), 3 * tp, "odd C"), ((1, 4), tp - 1, "H < tp, one empty shard"))
    cases = []
    for shape, hidden, what in plan:
        c = shape[-1]
        x = torch.randn(shape, generator=generator)
        a = torch.randn(c, hidden, generator=generator) / c ** 0.5  # (C, H)
        b = torch.randn(hidden, c, generator=generator) / max(hidden, 1) ** 0.5  # (H, C)
        grad_z = torch.randn(shape, generator=generator)
        cols = torch.arange(hidden).tensor_split(tp)  # widths differ by at most one
        inputs = [{"x": x, "a": a[:, k].contiguous(), "b": b[k].contiguous(), "grad_z": grad_z}
                  for k in cols]
        cases.append(Case(f"x {shape}, H={hidden} ({what})", inputs))
    return cases


def make_cross_entropy_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    tp = world_size
    f32, bf16 = torch.float32, torch.bfloat16
    # (N, V, scale, what, dtype, the tokens whose target is IGNORE_INDEX)
    plan = [(6, 4 * tp, 1.0, "V divides by tp", f32, ()),
            (5, 4 * tp - 1, 1.0, "padding", f32, ()),
            (4, 4 * tp - 3, 100.0, "padding, logits of scale 100", f32, ()),
            (1, 2 * tp + 1, 1.0, "N = 1", f32, ()),
            (6, 4 * tp - 1, 1.0, "3 tokens ignored", f32, (2, 3, 5)),
            (5, 4 * tp + 1, 1.0, "bfloat16 logits", bf16, ()),
            (7, 4 * tp - 1, 10.0, "bfloat16 logits of scale 10, 2 tokens ignored", bf16, (2, 6))]
    if tp == 4:  # V_pad 12: rank 3 [9, 12)
        plan.append((3, 9, 1.0, "the last rank holds only padding", f32, ()))
    cases = []
    for n, vocab, scale, what, dtype, ignored in plan:
        v_pad = -(-vocab // tp) * tp
        logits = torch.randn(n, v_pad, generator=generator) * scale
        logits[:, vocab:] = 10 * scale + 20  # garbage that would dominate any softmax
        logits = logits.to(dtype)
        targets = torch.randint(0, vocab, (n,), generator=generator)
        targets[0] = vocab - 1  # the last real column: next to the padding
        if n > 1:
            targets[1] = 0
        targets[list(ignored)] = IGNORE_INDEX
        inputs = [{"logits": shard.contiguous(), "targets": targets, "vocab_size": vocab}
                  for shard in logits.chunk(tp, dim=1)]
        cases.append(Case(f"N={n}, V={vocab} ({what})", inputs))
    return cases


# ------------------------------------------------------------------ expected (in the grader)

def expect_mlp(inputs: list) -> list:
    # float64: the truth, not another float32 rounding
    a = torch.cat([i["a"] for i in inputs], dim=1).double().requires_grad_()  # (C, H)
    b = torch.cat([i["b"] for i in inputs], dim=0).double().requires_grad_()  # (H, C)
    x = inputs[0]["x"].double().requires_grad_()
    z = F.gelu(x @ a) @ b
    z.backward(inputs[0]["grad_z"].double())
    widths = [i["a"].shape[1] for i in inputs]
    return [{"z": z.detach(), "grad_x": x.grad, "grad_a": ga, "grad_b": gb}
            for ga, gb in zip(a.grad.split(widths, dim=1), b.grad.split(widths, dim=0))]


def expect_cross_entropy(inputs: list) -> list:
    vocab = inputs[0]["vocab_size"]
    full = torch.cat([i["logits"] for i in inputs], dim=1).double()  # (N, V_pad)
    real = full[:, :vocab].clone().requires_grad_()
    loss = F.cross_entropy(real, inputs[0]["targets"], ignore_index=IGNORE_INDEX)
    loss.backward()
    grad = torch.zeros_like(full)
    grad[:, :vocab] = real.grad  # padding columns take no part: zero gradient
    return [{"loss": loss.detach(), "grad": g} for g in grad.chunk(len(inputs), dim=1)]


def _dense_only(_):
    raise TypeError("these exercises are checked against the dense computation in the "
                    "calling process (reference.course.checks.tensor_parallel), not per rank")


# ------------------------------------------------------------------ judges (in the grader)

def _error(got, want, tolerance) -> str:
    if got is None:
        return "it is None (no gradient reached it)"
    if got.shape != want.shape:
        return f"its shape is {tuple(got.shape)}, expected {tuple(want.shape)}"
    if tolerance.close(got, want):
        return ""
    return f"max abs error {(got.double() - want).abs().max().item():.3g}"


def _scaled(got, want, tp) -> str:
    """A hint when `got` is the right answer times tp or divided by it."""
    if got is None or got.shape != want.shape or not want.numel() or want.abs().max() < 1e-3:
        return ""
    for factor, text in ((tp, f"{tp} times too large"), (1 / tp, f"{tp} times too small")):
        if TOLERANCE.close(got, want * factor):
            return f" ({text})"
    return ""


def judge_mlp(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        if out["z"] is None:
            return f"rank {rank} returned {out['returned_type']}, not a tensor"
        if error := _error(out["z"], want["z"], TOLERANCE):
            return f"rank {rank}: wrong output Z: {error}{_scaled(out['z'], want['z'], world_size)}"
        if not out["requires_grad"]:
            return f"rank {rank}: Z does not require grad (the graph to x, a_shard, b_shard is cut)"
        for key, name in (("grad_x", "x.grad"), ("grad_a", "a_shard.grad"),
                          ("grad_b", "b_shard.grad")):
            if error := _error(out[key], want[key], TOLERANCE):
                return (f"rank {rank}: wrong {name}: {error}"
                        f"{_scaled(out[key], want[key], world_size)}")
    for rank, out in enumerate(outputs):
        for phase in ("forward", "backward"):
            if out[f"{phase}_calls"] != 1:
                return (f"rank {rank} called all_reduce {out[f'{phase}_calls']} times in {phase}; "
                        f"the column-row pair needs exactly one")
    return ""


def judge_cross_entropy(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    n = inputs[0]["targets"].numel()
    bf16 = inputs[0]["logits"].dtype == torch.bfloat16
    ignored = int((inputs[0]["targets"] == IGNORE_INDEX).sum())
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        loss = out["loss"]
        if loss is None:
            return f"rank {rank} returned {out['returned_type']}, not a tensor"
        if loss.dim() != 0:
            return (f"rank {rank} returned shape {tuple(loss.shape)}; expected the mean loss, "
                    f"a 0-dim tensor")
        if loss.dtype != torch.float32:
            return f"rank {rank}: the loss is {loss.dtype}; it is computed and returned in float32"
        if error := _error(loss, want["loss"], TOLERANCE):
            why = ""
            if ignored:
                why = (f" ({ignored} of the {n} tokens are ignored: they add nothing, and the "
                       f"mean is over the {n - ignored} others)")
            elif bf16:
                why = " (computed in bfloat16? its 8 bits of mantissa cannot hold the loss)"
            return (f"rank {rank}: wrong loss {loss.item():.6g}, expected "
                    f"{want['loss'].item():.6g}{why}")
        if not out["requires_grad"]:
            return f"rank {rank}: the loss does not require grad (no backward to the logits)"
        if error := _error(out["grad"], want["grad"], BF16_GRAD_TOLERANCE if bf16 else GRAD_TOLERANCE):
            pad_from = inputs[rank]["vocab_size"] - rank * want["grad"].shape[1]
            got = out["grad"]
            if (got is not None and got.shape == want["grad"].shape and pad_from < got.shape[1]
                    and got[:, max(pad_from, 0):].abs().max() > 0):
                return f"rank {rank}: the gradient of the padding columns is not zero"
            return (f"rank {rank}: wrong gradient of logits_shard: {error}"
                    f"{_scaled(got, want['grad'], world_size)}")
        if out["all_reduced"] > 4 * n:
            return (f"rank {rank} all-reduced {out['all_reduced']} numbers for N={n} tokens; "
                    f"the loss needs only a few per token (at most {4 * n}), never the logits")
    return ""


MLP = ExerciseSpec(
    id="tensor_parallel_mlp", title="column then row parallel linear with your own f and g",
    difficulty="★☆☆ warm-up", weight=WARM_UP, world_sizes=(2, 4), make_cases=make_mlp_cases,
    call=call_mlp,
    expect=expect_mlp, judge=judge_mlp, reference=_dense_only, forbidden=ONLY_ALL_REDUCE,
    banned=("reference.course.homework.tensor_parallel_transfer.course_tensor_parallel_mlp",
            "reference.tensor_parallel.comms", "reference.tensor_parallel.layers"))
CROSS_ENTROPY = ExerciseSpec(
    id="vocab_parallel_cross_entropy", title="vocabulary-parallel cross-entropy",
    difficulty="★★★ hard", bonus=True, world_sizes=(2, 4), make_cases=make_cross_entropy_cases,
    call=call_cross_entropy, expect=expect_cross_entropy, judge=judge_cross_entropy,
    reference=_dense_only, forbidden=ONLY_ALL_REDUCE,
    banned=("reference.course.homework.tensor_parallel_transfer.course_vocab_parallel_cross_entropy",
            "reference.tensor_parallel.loss"))
HOMEWORK_ID = "03_tensor_parallel"
# The warm-up, the lecture's loss written by hand (a bonus), two transfers (sequence parallelism in
# tensor_parallel_transfer, dropout in tensor_parallel_dropout) and the written question.
from reference.course.homework.tensor_parallel_dropout import TP_DROPOUT  # noqa: E402
from reference.course.homework.tensor_parallel_transfer import SEQUENCE_PARALLEL, TP_LAYER_BYTES  # noqa: E402

WRONG_KEEPS = 0.5  # failing any case keeps at most half (a loss without the max: its large logits)
EXERCISES = (MLP, CROSS_ENTROPY, SEQUENCE_PARALLEL, TP_DROPOUT, TP_LAYER_BYTES)
