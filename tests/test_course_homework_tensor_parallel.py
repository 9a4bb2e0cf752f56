"""Homework 03's hidden checks take points from wrong answers, each for the right reason.

The answers below are graded the way the grader does it (`score_exercise`), as
functions pickled by value like a notebook's. Each wrong one makes a classic
mistake: f left out, an all-reduce in g's backward, a GeLU on the summed output,
padding read as vocabulary, no max-shift, the logits gathered through an
all-reduce, a forbidden collective, or the course's own operators called.
"""
import dataclasses

import cloudpickle
import pytest

from reference.course.checks.tensor_parallel import run_dense_check
from reference.course.homework import HOMEWORK, score_exercise
from reference.course.homework.tensor_parallel import CROSS_ENTROPY, MLP, course_versions_refused
from reference.tensor_parallel.comms import CopyToRegion

CHECK_TIMEOUT = 60  # s per launch (a few s needed); only a hanging answer would wait

STUDENT = r'''
import torch
import torch.distributed as dist
import torch.nn.functional as F


class F_(torch.autograd.Function):  # f: identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class G(torch.autograd.Function):  # g: all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class G_reduces_backward(G):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad, None


def mlp(x, a, b, group=None):
    return G.apply(F.gelu(F_.apply(x, group) @ a) @ b, group)


def mlp_no_f(x, a, b, group=None):
    return G.apply(F.gelu(x @ a) @ b, group)


def mlp_g_reduces_backward(x, a, b, group=None):
    return G_reduces_backward.apply(F.gelu(F_.apply(x, group) @ a) @ b, group)


def mlp_gelu_after_g(x, a, b, group=None):
    return F.gelu(G.apply(F_.apply(x, group) @ a @ b, group))


def mlp_extra_all_reduce(x, a, b, group=None):
    dist.all_reduce(torch.zeros(1), group=group)  # right values, one all-reduce too many
    return mlp(x, a, b, group)


def mlp_course(x, a, b, group=None):
    from reference.tensor_parallel.comms import f, g
    return g(F.gelu(f(x, group) @ a) @ b, group)


class CE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group, mask, shift, lecture=False):
        n, v = logits.shape
        start = dist.get_rank(group) * v
        z = logits.clone() if lecture else logits.float().clone()  # the lecture: no upcast
        counts = torch.ones_like(targets, dtype=torch.bool) if lecture else targets != -100
        if mask:
            z[:, max(0, vocab_size - start):] = float("-inf")
        m = z.max(dim=1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        if shift:
            z -= m.unsqueeze(1)
        mine = counts & (targets >= start) & (targets < start + v)
        local = (targets - start).masked_fill(~mine, 0)
        zt = z.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        dist.all_reduce(zt, group=group)
        e = z.exp()
        s = e.sum(dim=1)
        dist.all_reduce(s, group=group)
        ctx.save_for_backward(e / s.unsqueeze(1), counts, mine, local)
        return ((s.log() - zt) * counts).sum() / counts.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        p, counts, mine, local = ctx.saved_tensors
        grad = p * counts.unsqueeze(1)
        grad[torch.arange(grad.shape[0])[mine], local[mine]] -= 1.0
        return grad * (grad_loss / counts.sum()), None, None, None, None, None, None


def ce(logits, targets, vocab_size, group=None):
    return CE.apply(logits, targets, vocab_size, group, True, True)


def ce_no_padding_mask(logits, targets, vocab_size, group=None):
    return CE.apply(logits, targets, vocab_size, group, False, True)


def ce_no_max_shift(logits, targets, vocab_size, group=None):
    return CE.apply(logits, targets, vocab_size, group, True, False)


def ce_lecture(logits, targets, vocab_size, group=None):  # every token counts, no upcast
    return CE.apply(logits, targets, vocab_size, group, True, True, True)


def ce_sum_not_mean(logits, targets, vocab_size, group=None):
    return ce(logits, targets, vocab_size, group) * targets.numel()


def ce_gathered_by_all_reduce(logits, targets, vocab_size, group=None):
    # Right values, wrong cost: every rank's shard placed in a zero (N, V_pad) buffer and
    # summed, i.e. the logits gathered; the gradient flows through this rank's own block.
    p, r = dist.get_world_size(group), dist.get_rank(group)
    n, v = logits.shape
    full = logits.new_zeros(n, p * v)
    full[:, r * v:(r + 1) * v] = logits.detach()
    dist.all_reduce(full, group=group)
    mine = torch.zeros_like(full)
    mine[:, r * v:(r + 1) * v] = 1.0
    whole = full * (1 - mine) + F.pad(logits, (r * v, (p - r - 1) * v))
    return F.cross_entropy(whole[:, :vocab_size].float(), targets)


def ce_all_gather(logits, targets, vocab_size, group=None):
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.detach(), group=group)
    return F.cross_entropy(torch.cat(parts, 1)[:, :vocab_size], targets)


def ce_course(logits, targets, vocab_size, group=None):
    from reference.tensor_parallel.loss import vocab_parallel_cross_entropy
    return vocab_parallel_cross_entropy(logits, targets, group, vocab_size)
'''


def _student(name):
    namespace = {"__name__": "student"}  # not importable: pickled by value, like a notebook's
    exec(STUDENT, namespace)
    return cloudpickle.dumps(namespace[name])


def _score(spec, name, world_sizes=None):
    spec = {s.id: s for s in HOMEWORK["03_tensor_parallel"]}[spec.id]  # as graded: WRONG_KEEPS
    if world_sizes:
        spec = dataclasses.replace(spec, world_sizes=world_sizes)
    return score_exercise(spec, _student(name), seed=11, timeout=CHECK_TIMEOUT)


def test_the_right_answers_score_full_marks():
    for spec, name in ((MLP, "mlp"), (CROSS_ENTROPY, "ce")):
        score = _score(spec, name)
        assert score.max >= 8 and score.points == score.max, score.failures


@pytest.mark.parametrize("name, reason", [
    ("mlp_no_f", "wrong x.grad"),
    ("mlp_gelu_after_g", "wrong output Z"),
    ("mlp_extra_all_reduce", "called all_reduce 2 times in forward"),
])
def test_mlp_mistakes_lose_every_point_on_two_ranks(name, reason):
    score = _score(MLP, name, world_sizes=(2,))
    assert score.points == 0 and score.max == 4 and score.weighted() == 0
    assert all(reason in line for line in score.failures), score.failures


def test_an_all_reduce_in_g_backward_is_caught_as_tp_times_too_large():
    score = _score(MLP, "mlp_g_reduces_backward")
    assert score.points == 0
    assert any("wrong x.grad" in line and "2 times too large" in line for line in score.failures)
    assert any("4 times too large" in line for line in score.failures)


def test_padding_and_overflow_mistakes_lose_exactly_their_cases():
    no_mask = _score(CROSS_ENTROPY, "ce_no_padding_mask")
    # Only "V divides by tp" has no padding column, on 2 and on 4 ranks.
    assert no_mask.points == 2, no_mask.failures
    assert all("wrong loss" in line and "V divides by tp" not in line for line in no_mask.failures)
    no_shift = _score(CROSS_ENTROPY, "ce_no_max_shift")
    assert no_shift.max - no_shift.points == 2, no_shift.failures
    assert all("scale 100" in line and "wrong loss" in line for line in no_shift.failures)
    summed = _score(CROSS_ENTROPY, "ce_sum_not_mean", world_sizes=(2,))
    assert summed.points == 1 and "N=1" not in " ".join(summed.failures)  # one token: sum = mean
    # each wrong in principle, each keeps at most half (the max-shift alone fails 2 cases of 10)
    for wrong in (no_mask, no_shift, summed):
        assert 0 < wrong.weighted() <= wrong.weight / 2, wrong.as_dict()


def test_the_lecture_loss_loses_the_ignored_tokens_and_bfloat16_cases():
    lecture = _score(CROSS_ENTROPY, "ce_lecture", world_sizes=(2,))
    lost = {line.split(", ", 1)[1].split(":")[0] for line in lecture.failures}
    assert lost == {"N=6, V=7 (3 tokens ignored)", "N=5, V=9 (bfloat16 logits)",
                    "N=7, V=7 (bfloat16 logits of scale 10, 2 tokens ignored)"}, lecture.failures
    assert any("the mean is over the" in line for line in lecture.failures)
    assert any("float32" in line for line in lecture.failures)
    assert lecture.weighted() <= lecture.weight / 2, lecture.as_dict()


def test_gathering_the_logits_is_refused_whichever_collective_does_it():
    by_all_reduce = _score(CROSS_ENTROPY, "ce_gathered_by_all_reduce", world_sizes=(2,))
    assert by_all_reduce.points == 0
    assert all("never the logits" in line for line in by_all_reduce.failures)
    by_all_gather = _score(CROSS_ENTROPY, "ce_all_gather", world_sizes=(2,))
    assert by_all_gather.points == 0 and "all_gather is not allowed" in by_all_gather.reason


@pytest.mark.parametrize("spec, name, what", [
    (MLP, "mlp_course", "CopyToRegion"),
    (CROSS_ENTROPY, "ce_course", "VocabParallelCrossEntropy"),
])
def test_the_course_versions_are_refused(spec, name, what):
    score = _score(spec, name, world_sizes=(2,))
    # The first course function the answer reaches is refused (f, g, or the loss itself).
    assert score.points == 0, score.failures
    assert "calls the course's reference implementation reference.tensor_parallel" in score.reason


def test_refusing_the_course_versions_leaves_them_as_they_were():
    before = CopyToRegion.apply
    with course_versions_refused("x", (CopyToRegion,)):
        with pytest.raises(RuntimeError, match="not allowed"):
            CopyToRegion.apply(None, None)
    assert "apply" not in CopyToRegion.__dict__ and CopyToRegion.apply == before


def test_visible_check_prints_pass_or_fail_with_a_hint(capsys):
    namespace = {"__name__": "student"}
    exec(STUDENT, namespace)
    assert run_dense_check(MLP, namespace["mlp"], world_sizes=(2,)) is True
    assert run_dense_check(MLP, namespace["mlp_no_f"], world_sizes=(2,)) is False
    out = capsys.readouterr().out
    assert "PASS tensor_parallel_mlp" in out
    assert "FAIL tensor_parallel_mlp: on 2 ranks" in out and "hint: f is the identity" in out
    assert run_dense_check(CROSS_ENTROPY, namespace["ce"], skip=True) is None
