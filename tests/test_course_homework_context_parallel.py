"""Homework 08 (long sequences): right answers earn every point, the usual mistakes lose
the cases they should, and the course's own code is refused."""
import dataclasses
import math

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from reference.context_parallel import merge_block, sequence_positions
from reference.course.homework import homework
from reference.course.homework.context_parallel import (
    CAUSAL_RING_ATTENTION, MERGE_ATTENTION_BLOCKS, RING_FORWARD_BYTES, ZIGZAG_MASK,
    course_merge_attention_blocks, course_zigzag_mask, ring_forward_bytes_formula,
)
from reference.course.homework.context_parallel_ring import course_causal_ring_attention
from reference.course.homework.scoring import score_exercise
from reference.runtime import launch
from reference.tolerance import forward


def _graded(spec):
    """The spec as the grader has it (with the homework's WRONG_KEEPS)."""
    return next(s for s in homework("08_context_parallel") if s.id == spec.id)


def _score(spec, fn, seed=5):
    return score_exercise(spec, cloudpickle.dumps(fn), seed=seed, timeout=60)


# ------------------------------------------------------------------ answers written here

def merge(outs, lses):
    """k blocks folded one at a time into a running (out, lse), each step shifted by the
    larger lse; a row that no block has met yet stays at (0, -inf)."""
    out, lse = torch.zeros_like(outs[0]), torch.full_like(lses[0], -math.inf)
    for o, l in zip(outs, lses):
        new = torch.logaddexp(lse, l)
        safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
        out = out * torch.exp(lse - safe).unsqueeze(-1) + o * torch.exp(l - safe).unsqueeze(-1)
        lse = new
    return out, lse


def pairwise_merge(outs, lses):
    """The lecture's two-block merge folded pair by pair: NaN on a row no block met."""
    out, lse = outs[0], lses[0]
    for o, l in zip(outs[1:], lses[1:]):
        new = torch.logaddexp(lse, l)
        out = out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(l - new).unsqueeze(-1)
        lse = new
    return out, lse


def naive_merge(outs, lses):
    """e^lse formed directly: overflows near +1000, underflows to 0/0 near -1000."""
    weights = [torch.exp(l) for l in lses]
    total = sum(weights)
    return sum(o * (w / total).unsqueeze(-1) for o, w in zip(outs, weights)), torch.log(total)


def mask(T, cp, i, j, contiguous=False, strict=False, refuse=True):
    if refuse and T % (2 * cp):
        raise ValueError(f"T={T}, cp={cp}")
    n = T // cp
    if contiguous:
        pos = lambda r: torch.arange(r * n, (r + 1) * n)  # noqa: E731
    else:
        c = T // (2 * cp)
        pos = lambda r: torch.cat([torch.arange(r * c, (r + 1) * c),  # noqa: E731
                                   torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
    return pos(i)[:, None] > pos(j)[None, :] if strict else pos(i)[:, None] >= pos(j)[None, :]


def ring(q, k, v, group, causal=True, contiguous=False, gather_all=False, to_everyone=False,
         group_ranks=False, send_q=False, in_place=False):
    """Causal ring attention; the flags make the usual mistakes."""
    cp, i = dist.get_world_size(group), dist.get_rank(group)
    n, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    nxt, prev = (i + 1) % cp, (i - 1) % cp
    if not group_ranks:   # the lecture's whole-world ring sends to group ranks as global ones
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    if in_place:          # the scale folded into q where it lies
        q = q.mul_(scale)
        scale = 1.0
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    kv, held = torch.stack([q, k, v] if send_q else [k, v]), []
    for s in range(cp):
        j = (i - s) % cp
        held.append((j, kv))
        if to_everyone and s == 0:   # every block straight to every rank: not a ring
            got = {}
            works = []
            for r in range(cp):
                if r != i:
                    got[r] = torch.empty_like(kv)
                    peer = dist.get_global_rank(group, r)
                    works += dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, peer),
                                                     dist.P2POp(dist.irecv, got[r], peer)])
            for w in works:
                w.wait()
            held += [(r, t) for r, t in got.items()]
            break
        if s < cp - 1:
            incoming = torch.empty_like(kv)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt),
                                             dist.P2POp(dist.irecv, incoming, prev)]):
                w.wait()
            kv = incoming
    if gather_all:   # every rank's keys and values, then the (T/cp, T) scores at once
        held.sort(key=lambda x: x[0])
        keys = torch.cat([t[-2] for _, t in held], dim=-2)
        values = torch.cat([t[-1] for _, t in held], dim=-2)
        allowed = torch.cat([mask(n * cp, cp, i, j) for j, _ in held], dim=-1)
        scores = (q @ keys.transpose(-2, -1) * scale).masked_fill(~allowed, -math.inf)
        return torch.softmax(scores, dim=-1) @ values
    for j, kv in held:
        scores = q @ kv[-2].transpose(-2, -1) * scale
        if causal:
            scores = scores.masked_fill(~mask(n * cp, cp, i, j, contiguous=contiguous), -math.inf)
        block_lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - block_lse.unsqueeze(-1)).nan_to_num(0.0)
        out, lse = merge([out, p @ kv[-1]], [lse, block_lse])
    return out


# ------------------------------------------------------------------ the homework's shape

def test_homework_08_has_a_warm_up_two_transfers_and_a_question():
    assert [s.id for s in homework("08_context_parallel")] == [
        "merge_attention_blocks", "zigzag_mask", "causal_ring_attention", "ring_forward_bytes"]
    for spec in homework("08_context_parallel"):
        assert spec.banned and spec.banned[0].endswith(("course_" + spec.id, spec.id + "_formula"))


def test_course_answers_agree_with_the_package():
    """The grader's expected answers against reference.context_parallel, independently written."""
    for T, cp in ((8, 2), (12, 3), (16, 4), (4, 1)):
        for i in range(cp):
            for j in range(cp):
                want = sequence_positions(T, cp, i)[:, None] >= sequence_positions(T, cp, j)[None, :]
                assert torch.equal(course_zigzag_mask(T, cp, i, j), want)
    with pytest.raises(ValueError):
        course_zigzag_mask(6, 2, 0, 0)
    g = torch.Generator().manual_seed(0)
    out_a, out_b = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    lse_a, lse_b = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    out, lse = course_merge_attention_blocks([out_a, out_b], [lse_a, lse_b])
    running_out, running_lse = out_a.clone(), lse_a.clone()
    merge_block(running_out, running_lse, out_b, lse_b)
    # fp32: the same formula in another order of operations (the course's forward bound)
    forward().assert_close(out, running_out, "merged output")
    forward().assert_close(lse, running_lse, "merged lse")


def _course_ring_matches():
    q, k, v = (torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(s)) for s in range(3))
    group = dist.group.WORLD
    return forward().excess(course_causal_ring_attention(q, k, v, group), ring(q, k, v, group))


def test_course_ring_equals_the_test_ring():
    # fp32: blocks merged in the same order, different code: a few ulps of values of order 1,
    # within the course's forward bound (excess <= 0)
    for cp in (2, 3):
        assert max(launch(_course_ring_matches, cp, quiet=True)) <= 0


# ------------------------------------------------------------------ merge_attention_blocks

def test_merge_right_answer_scores_full_marks():
    s = _score(MERGE_ATTENTION_BLOCKS, merge)
    assert s.points == s.max == 10, s.failures


def test_merge_mistakes_lose_their_cases():
    naive = _score(MERGE_ATTENTION_BLOCKS, naive_merge)
    # e^lse overflows near +1000 (float32 and float64) and underflows to 0/0 near -1000;
    # and 0/0 on the rows no block met
    assert naive.max - naive.points == 4, naive.failures
    assert all("NaN" in f for f in naive.failures), naive.failures
    # The lecture's merge folded pair by pair: right but on the rows no block met.
    pairwise = _score(MERGE_ATTENTION_BLOCKS, pairwise_merge)
    assert pairwise.max - pairwise.points == 1, pairwise.failures
    assert "rows no block met" in pairwise.reason and "NaN" in pairwise.reason

    def average(outs, lses):        # the blocks weighted equally
        return sum(outs) / len(outs), torch.logsumexp(torch.stack(lses), dim=0)
    assert _score(MERGE_ATTENTION_BLOCKS, average).points == 1  # right for a single block

    def in_place(outs, lses):
        out, lse = merge(outs, lses)
        outs[0].zero_()
        return out, lse
    s = _score(MERGE_ATTENTION_BLOCKS, in_place)
    assert s.points == 0 and "changed its inputs" in s.reason, s.failures


def test_merge_calling_the_package_is_refused():
    def borrowed(outs, lses):
        from reference.context_parallel import merge_block as m
        out, lse = outs[0].clone(), lses[0].clone()
        for o, l in zip(outs[1:], lses[1:]):
            m(out, lse, o, l)
        return out, lse
    s = _score(MERGE_ATTENTION_BLOCKS, borrowed)
    assert s.points == 0 and "calls the course's reference implementation" in s.reason


# ------------------------------------------------------------------ zigzag_mask

def test_zigzag_mask_right_answer_scores_full_marks():
    s = _score(ZIGZAG_MASK, mask)
    assert s.points == s.max == 10, s.failures


@pytest.mark.parametrize("mistake, lost", [
    (dict(contiguous=True), 6),   # right only for cp = 1 (and it still refuses uneven T)
    (dict(strict=True), 7),       # a query may attend to itself: every valid case wrong
    (dict(refuse=False), 3),      # the three uneven lengths are not refused
])
def test_zigzag_mask_mistakes_lose_their_cases(mistake, lost):
    s = _score(ZIGZAG_MASK, lambda T, cp, i, j: mask(T, cp, i, j, **mistake))
    assert s.max - s.points == lost, s.failures


# ------------------------------------------------------------------ causal_ring_attention

def test_causal_ring_right_answer_scores_full_marks():
    s = _score(CAUSAL_RING_ATTENTION, ring)
    # 3 cases on 2 ranks; 4 on 3 and on 4 ranks, one of them a ring on the subgroup 1 .. w - 1
    assert s.points == s.max == 11, s.failures


@pytest.mark.parametrize("mistake, lost, words", [
    (dict(causal=False), 4, "wrong output"),
    (dict(contiguous=True), 4, "wrong output"),
    # right values, but the (T/cp, T) scores of every key at once: caught where T/cp = 8, D = 2
    (dict(gather_all=True), 1, "created a tensor"),
    # on the subgroup of cp = 2 the only other rank is the next one: a ring there
    (dict(to_everyone=True), 3, "not a ring"),
    # q travels with k and v: 3/2 of the elements the ring may send
    (dict(send_q=True), 4, "elements; the ring needs at most"),
    (dict(in_place=True), 4, "changed q, k or v"),
])
def test_causal_ring_mistakes_lose_their_cases(mistake, lost, words):
    on_three = dataclasses.replace(_graded(CAUSAL_RING_ATTENTION), world_sizes=(3,))  # one launch: 4 cases
    s = _score(on_three, lambda q, k, v, group: ring(q, k, v, group, **mistake))
    assert s.max - s.points == lost, s.failures
    assert all(words in f for f in s.failures), s.failures
    # each rule the text states, broken alone, costs at least half the exercise
    assert s.weighted() <= s.weight / 2, s.failures


def test_causal_ring_with_group_ranks_as_peers_fails_on_a_subgroup():
    """The lecture's whole-world ring, (i +- 1) % cp as peers: right on the whole world, wrong
    on the subgroup of ranks 1, 2, where group rank i is global rank i + 1."""
    on_three = dataclasses.replace(_graded(CAUSAL_RING_ATTENTION), world_sizes=(3,))
    s = _score(on_three, lambda q, k, v, group: ring(q, k, v, group, group_ranks=True))
    assert s.max - s.points == 1, s.failures
    assert "subgroup of global ranks [1, 2]" in s.failures[0], s.failures
    assert s.weighted() <= s.weight / 2, s.failures


def test_causal_ring_with_a_contiguous_mask_loses_over_half_the_exercise():
    """The lecture's ring with the contiguous causal mask, on every world size the grader uses."""
    s = _score(CAUSAL_RING_ATTENTION, lambda q, k, v, group: ring(q, k, v, group, contiguous=True))
    assert s.weighted() <= s.weight / 2, s.failures
    assert all("wrong output" in f for f in s.failures), s.failures


def test_causal_ring_may_not_use_collectives_or_the_package():
    def gathered(q, k, v, group):
        keys = [torch.empty_like(k) for _ in range(dist.get_world_size(group))]
        dist.all_gather(keys, k, group=group)
        return q
    on_two = dataclasses.replace(CAUSAL_RING_ATTENTION, world_sizes=(2,))
    s = _score(on_two, gathered)
    assert s.points == 0 and "not allowed" in s.reason

    def borrowed(q, k, v, group):
        import importlib
        module = importlib.import_module("reference.context_parallel")
        return getattr(module, "ring_attention")(q, k, v, group)
    s = _score(on_two, borrowed)
    assert s.points == 0 and "calls the course's reference implementation" in s.reason


# ------------------------------------------------------------------ the written question

def test_ring_forward_bytes_is_graded_exactly():
    # 2 K/V blocks of 1 x 4 heads x 32 tokens x 16 wide x 4 bytes, cp - 1 = 2 steps
    assert ring_forward_bytes_formula(2, 96, 12, 4, 16, 3, 4) == 2 * 2 * (2 * 4 * 32 * 16 * 4)

    def right(B, T, n_heads, n_kv_heads, head_dim, cp, bytes_per_element):
        per_block = B * n_kv_heads * (T // cp) * head_dim * bytes_per_element
        return (cp - 1) * 2 * per_block
    s = _score(RING_FORWARD_BYTES, right)
    assert s.points == s.max == 8, s.failures
    s = _score(RING_FORWARD_BYTES, ring_forward_bytes_formula)  # the grader's own formula
    assert s.points == 0 and "calls the course's reference implementation" in s.reason

    def query_heads(B, T, n_heads, n_kv_heads, head_dim, cp, bytes_per_element):
        return 2 * (cp - 1) * B * n_heads * (T // cp) * head_dim * bytes_per_element
    assert _score(RING_FORWARD_BYTES, query_heads).points < 8

    def every_step(B, T, n_heads, n_kv_heads, head_dim, cp, bytes_per_element):
        return 2 * cp * B * n_kv_heads * (T // cp) * head_dim * bytes_per_element
    assert _score(RING_FORWARD_BYTES, every_step).points == 0


# ------------------------------------------------------------------ the visible checks

def test_visible_checks_print_pass_and_fail(capsys):
    from reference.course.checks.context_parallel import (
        check_causal_ring_attention, check_merge_attention_blocks, check_zigzag_mask,
    )
    check_merge_attention_blocks(naive_merge)
    check_zigzag_mask(mask)
    check_causal_ring_attention(lambda q, k, v, group: ring(q, k, v, group, causal=False),
                                world_sizes=(2,))
    out = capsys.readouterr().out
    assert "FAIL merge_attention_blocks" in out and "never form e^lse itself" in out
    assert "PASS zigzag_mask" in out
    assert "FAIL causal_ring_attention" in out and "zigzag_mask" in out


def test_visible_question_check_wants_an_int(capsys):
    from reference.course.checks.context_parallel import check_ring_forward_bytes

    def right(B, T, n_heads, n_kv_heads, head_dim, cp, bytes_per_element):
        return 2 * (cp - 1) * B * n_kv_heads * (T // cp) * head_dim * bytes_per_element
    check_ring_forward_bytes(right)
    check_ring_forward_bytes(lambda **kw: 1.5)
    out = capsys.readouterr().out
    assert "PASS ring_forward_bytes" in out
    assert "FAIL ring_forward_bytes" in out and "whole number" in out
