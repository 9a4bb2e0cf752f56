"""Homework 03's transfer exercises and written question: right answers earn every point,
the usual mistakes lose the cases they should, for the reason they should, and the
course's own answers (to every exercise of the homework) refuse to run.

The answers are graded as the grader does it (`score_exercise`), as functions pickled by
value like a notebook's (defined in a namespace no process can import)."""
import dataclasses

import cloudpickle
import pytest

from reference.course.homework import homework
from reference.course.homework.scoring import score_exercise
from reference.course.homework.tensor_parallel import CROSS_ENTROPY, MLP
from reference.course.homework.tensor_parallel_dropout import TP_DROPOUT
from reference.course.homework.tensor_parallel_transfer import (
    SEQUENCE_PARALLEL, TP_LAYER_BYTES, tp_layer_bytes_formula,
)

TIMEOUT = 60  # s per launch (a few s needed); only a hanging answer would wait
REFUSED = "calls the course's reference implementation"

STUDENT = r'''
import torch
import torch.distributed as dist
import torch.nn.functional as F


def lengths(seq_len, n):
    return [len(c) for c in torch.arange(seq_len).tensor_split(n)]


def gather(x, seq_len, group, pad=True, by_all_reduce=False):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = lengths(seq_len, n)
    if by_all_reduce:  # right values, wrong collective: every shard placed in a zero buffer
        full = x.new_zeros(x.shape[0], seq_len, x.shape[2])
        start = sum(sizes[:rank])
        full[:, start:start + x.shape[1]] = x
        dist.all_reduce(full, group=group)
        return full
    padded = F.pad(x, (0, 0, 0, sizes[0] - x.shape[1])).contiguous() if pad else x.contiguous()
    out = padded.new_empty(n * padded.numel())
    dist.all_gather_into_tensor(out, padded.reshape(-1), group=group)
    parts = out.view(n, *padded.shape)
    return torch.cat([parts[r][:, :sizes[r]] for r in range(n)], dim=1)


def reduce_scatter(x, seq_len, group):
    pieces = [p.contiguous() for p in x.split(lengths(seq_len, dist.get_world_size(group)), dim=1)]
    out = torch.empty_like(pieces[dist.get_rank(group)])
    dist.reduce_scatter(out, pieces, group=group)
    return out


def split(x, seq_len, group):  # this rank's tokens, no communication
    return x.split(lengths(seq_len, dist.get_world_size(group)), dim=1)[dist.get_rank(group)]


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_len, group, pad, by_all_reduce, split_backward):
        ctx.seq_len, ctx.group, ctx.split_backward = seq_len, group, split_backward
        return gather(x, seq_len, group, pad, by_all_reduce)

    @staticmethod
    def backward(ctx, grad):
        if ctx.split_backward:  # forgets that every rank used this rank's tokens
            return split(grad, ctx.seq_len, ctx.group).contiguous(), None, None, None, None, None
        return reduce_scatter(grad, ctx.seq_len, ctx.group), None, None, None, None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_len, group):
        ctx.seq_len, ctx.group = seq_len, group
        return reduce_scatter(x, seq_len, group)

    @staticmethod
    def backward(ctx, grad):
        return gather(grad, ctx.seq_len, ctx.group), None, None


class SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, group):
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sp(x, w, b, a, bm, seq_len, group=None, sync=True, pad=True, by_all_reduce=False,
       split_backward=False):
    if sync:
        w, b = SumGrad.apply(w, group), SumGrad.apply(b, group)
    h = F.layer_norm(x, x.shape[-1:], w, b)
    full = AllGather.apply(h, seq_len, group, pad, by_all_reduce, split_backward)
    return x + ReduceScatter.apply(F.gelu(full @ a) @ bm, seq_len, group)


def sp_right(x, w, b, a, bm, seq_len, group=None):
    return sp(x, w, b, a, bm, seq_len, group)


def sp_no_layernorm_sync(x, w, b, a, bm, seq_len, group=None):
    return sp(x, w, b, a, bm, seq_len, group, sync=False)


def sp_no_padding(x, w, b, a, bm, seq_len, group=None):
    return sp(x, w, b, a, bm, seq_len, group, pad=False)


def sp_gathers_by_all_reduce(x, w, b, a, bm, seq_len, group=None):
    return sp(x, w, b, a, bm, seq_len, group, by_all_reduce=True)


def sp_split_backward(x, w, b, a, bm, seq_len, group=None):
    return sp(x, w, b, a, bm, seq_len, group, split_backward=True)


def sp_course(x, w, b, a, bm, seq_len, group=None):
    from reference.course.homework.tensor_parallel_transfer import course_sequence_parallel_mlp
    return course_sequence_parallel_mlp(x, w, b, a, bm, seq_len, group)


def sp_package_operators(x, w, b, a, bm, seq_len, group=None):
    from reference.tensor_parallel.comms import (gather_from_sequence_parallel_region,
                                                 reduce_scatter_to_sequence_parallel_region)
    h = F.layer_norm(x, x.shape[-1:], w, b)
    full = gather_from_sequence_parallel_region(h, group)
    return x + reduce_scatter_to_sequence_parallel_region(F.gelu(full @ a) @ bm, group)


def make_dropout(seed, tp_group, restart=False, default_stream=False, reseed=False, scale=True):
    rank = dist.get_rank(tp_group)
    generator = torch.Generator().manual_seed(seed + 2718 + rank)

    def dropout(x, p, sharded):
        nonlocal generator
        if not sharded or default_stream:
            return F.dropout(x, p, training=True)
        if reseed:  # the default generator reseeded per rank: the copies stop being copies
            torch.manual_seed(seed + 2718 + rank)
            return F.dropout(x, p, training=True)
        if restart:
            generator = torch.Generator().manual_seed(seed + 2718 + rank)
        keep = torch.rand(x.shape, generator=generator) >= p
        return x * keep / (1 - p) if scale else x * keep
    return dropout


def dropout_right(seed, tp_group):
    return make_dropout(seed, tp_group)


def dropout_one_stream(seed, tp_group):
    return make_dropout(seed, tp_group, default_stream=True)


def dropout_reseeds_the_default(seed, tp_group):
    return make_dropout(seed, tp_group, reseed=True)


def dropout_restarts(seed, tp_group):
    return make_dropout(seed, tp_group, restart=True)


def dropout_unscaled(seed, tp_group):
    return make_dropout(seed, tp_group, scale=False)


def dropout_course(seed, tp_group):
    from reference.tensor_parallel.rng import TensorParallelRNG
    rng = TensorParallelRNG(seed, dist.get_rank(tp_group))

    def dropout(x, p, sharded):
        if not sharded:
            return F.dropout(x, p, training=True)
        with rng.fork():
            return F.dropout(x, p, training=True)
    return dropout


def layer_bytes(b, s, h, tp, bytes_per_element, mode):
    n = b * s * h
    sent = {"tp": 8 * n, "sp": 8 * n + 12 * h, "sp_regather": 10 * n + 12 * h}[mode]
    return (tp - 1) * sent * bytes_per_element // tp


def layer_bytes_no_layernorm(b, s, h, tp, bytes_per_element, mode):
    n = b * s * h
    return (tp - 1) * (10 if mode == "sp_regather" else 8) * n * bytes_per_element // tp


def mlp_course(x, a, b, group=None):
    from reference.course.homework.tensor_parallel_transfer import course_tensor_parallel_mlp
    return course_tensor_parallel_mlp(x, a, b, group)


def mlp_layers(x, a, b, group=None):
    import reference.tensor_parallel.layers as layers
    return layers.row_shard(b.T, 0, 1)  # any call into the layers module is refused


def ce_course(logits, targets, vocab_size, group=None):
    from reference.course.homework.tensor_parallel_transfer import course_vocab_parallel_cross_entropy
    return course_vocab_parallel_cross_entropy(logits, targets, vocab_size, group)
'''


def _student(name):
    namespace = {"__name__": "student"}  # not importable: pickled by value, like a notebook's
    exec(STUDENT, namespace)
    return namespace[name]


def _score(spec, name, world_sizes=None, seed=11):
    spec = {s.id: s for s in homework("03_tensor_parallel")}[spec.id]  # as graded: WRONG_KEEPS
    if world_sizes:
        spec = dataclasses.replace(spec, world_sizes=world_sizes)
    return score_exercise(spec, cloudpickle.dumps(_student(name)), seed=seed, timeout=TIMEOUT)


def test_homework_03_has_its_warm_up_two_transfers_and_a_question():
    specs = homework("03_tensor_parallel")
    assert [s.id for s in specs] == ["tensor_parallel_mlp", "vocab_parallel_cross_entropy",
                                     "sequence_parallel_mlp", "make_tp_dropout", "tp_layer_bytes"]
    for spec in specs:  # the course's own answer, with the student's signature, named first
        assert spec.banned[0].startswith("reference.course.homework.tensor_parallel")
        assert spec.banned[0].rpartition(".")[2].startswith(("course_", spec.id))


# ------------------------------------------------------------------ sequence parallelism

def test_sequence_parallel_right_answer_scores_full_marks():
    score = _score(SEQUENCE_PARALLEL, "sp_right")
    assert score.points == score.max == 8, score.failures  # 4 cases on 2 and on 3 ranks


@pytest.mark.parametrize("name, lost, reason", [
    # The LayerNorm's gradients left partial: wrong in every case, and said so.
    ("sp_no_layernorm_sync", 4, "part only; sum it over the group"),
    # Unpadded shards: all_gather_into_tensor refuses uneven sizes (3 cases of 4 are uneven).
    ("sp_no_padding", 3, "raised"),
    # Right values through an all-reduce of a zero-padded buffer: the wrong collective.
    ("sp_gathers_by_all_reduce", 4, "forward all-reduces"),
    # The all-gather's backward as a plain split: x's gradient misses the other ranks' terms
    # (where the other rank's shard of A is empty, only the LayerNorm's gradient shows it).
    ("sp_split_backward", 4, "grad"),
])
def test_sequence_parallel_mistakes_lose_their_cases(name, lost, reason):
    score = _score(SEQUENCE_PARALLEL, name, world_sizes=(2,))
    assert score.max - score.points == lost, score.failures
    assert all(reason in line for line in score.failures), score.failures
    assert score.weighted() <= score.weight / 2  # each stated rule, broken alone: half lost


@pytest.mark.parametrize("name", ["sp_course", "sp_package_operators"])
def test_sequence_parallel_refuses_the_course_answers(name):
    score = _score(SEQUENCE_PARALLEL, name, world_sizes=(2,))
    assert score.points == 0 and REFUSED in score.reason


# ------------------------------------------------------------------ dropout

def test_dropout_right_answer_scores_full_marks():
    score = _score(TP_DROPOUT, "dropout_right")
    assert score.points == score.max == 8, score.failures  # 4 cases on 2 and on 3 ranks


@pytest.mark.parametrize("name, lost, reason", [
    # One stream for everything: the sharded draws move the default generator (p = 0 draws
    # nothing and passes).
    ("dropout_one_stream", 3, "moved the default generator"),
    # Reseeding the default generator per rank: the next copies differ across ranks (the
    # p = 0 case has no mask to differ, but the generator moved all the same).
    ("dropout_reseeds_the_default", 4, "rank"),
    # A generator made anew at every call: each sharded call repeats the first mask.
    ("dropout_restarts", 3, "agrees with sharded call"),
    # Kept elements not scaled by 1 / (1 - p): invalid wherever p > 0.
    ("dropout_unscaled", 3, "neither 0 nor x / (1 - p)"),
])
def test_dropout_mistakes_lose_their_cases(name, lost, reason):
    score = _score(TP_DROPOUT, name, world_sizes=(2,))
    assert score.max - score.points == lost, score.failures
    assert all(reason in line for line in score.failures), score.failures
    assert score.weighted() <= score.weight / 2  # each stated rule, broken alone: half lost


def test_dropout_refuses_the_course_rng():
    score = _score(TP_DROPOUT, "dropout_course", world_sizes=(2,))
    assert score.points == 0 and REFUSED in score.reason and "TensorParallelRNG" in score.reason


# ------------------------------------------------------------------ the written question

def test_tp_layer_bytes_formula_counts_the_lecture_collectives():
    b, s, h, t, e = 2, 16, 32, 4, 4
    activation = b * s * h * e                          # S, as notebook 03 counts it
    assert tp_layer_bytes_formula(b, s, h, t, e, "tp") == 2 * 4 * (t - 1) * activation // t
    # Sequence parallelism: the same activation bytes, plus one all-reduce of the 6 h
    # LayerNorm and row-bias gradients; regathering adds two all-gathers of S in backward.
    ln = 2 * (t - 1) * 6 * h * e // t
    assert tp_layer_bytes_formula(b, s, h, t, e, "sp") == tp_layer_bytes_formula(b, s, h, t, e, "tp") + ln
    assert (tp_layer_bytes_formula(b, s, h, t, e, "sp_regather")
            == tp_layer_bytes_formula(b, s, h, t, e, "sp") + 2 * (t - 1) * activation // t)
    assert tp_layer_bytes_formula(b, s, h, 1, e, "sp_regather") == 0
    assert tp_layer_bytes_formula(1, 6, 12, 3, 2, "sp") == 960   # the fixed case divides exactly


def test_tp_layer_bytes_is_graded_exactly():
    right = _score(TP_LAYER_BYTES, "layer_bytes")
    assert right.points == right.max == 8, right.failures
    # Forgetting the LayerNorm gradients' all-reduce is wrong in every "sp" case with tp > 1,
    # among them the two fixed ones.
    wrong = _score(TP_LAYER_BYTES, "layer_bytes_no_layernorm")
    assert right.max - wrong.points >= 2, wrong.failures
    assert all("mode=sp" in line and "wrong number" in line for line in wrong.failures)


# ------------------------------------------------------------------ the first two exercises

@pytest.mark.parametrize("spec, name", [(MLP, "mlp_course"), (MLP, "mlp_layers"),
                                        (CROSS_ENTROPY, "ce_course")])
def test_the_course_answers_to_the_first_exercises_are_refused(spec, name):
    score = _score(spec, name, world_sizes=(2,))
    assert score.points == 0 and REFUSED in score.reason, score.failures


def test_visible_checks_print_pass_and_fail(capsys):
    from reference.course.checks.tensor_parallel import (
        check_make_tp_dropout, check_sequence_parallel_mlp, check_tp_layer_bytes)
    check_sequence_parallel_mlp(_student("sp_no_layernorm_sync"), world_sizes=(2,))
    check_make_tp_dropout(_student("dropout_right"), world_sizes=(2,))
    check_make_tp_dropout(_student("dropout_restarts"), world_sizes=(2,))
    check_tp_layer_bytes(lambda **kw: 1.5)
    out = capsys.readouterr().out
    assert "FAIL sequence_parallel_mlp" in out and "Megatron's f" in out
    assert "PASS make_tp_dropout" in out
    assert "FAIL make_tp_dropout" in out and "continues its stream" in out
    assert "FAIL tp_layer_bytes" in out and "whole number" in out
