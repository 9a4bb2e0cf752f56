"""The step's loss as one process has it: a mean over the step's counted tokens (`reference.loss`).

Batches of padded documents count a different number of tokens in every row, micro-batch
and rank (one row counting a single token). With ``loss_mean="tokens"`` (the default)
every parallelism and composition trains as one process computing ``F.cross_entropy``
over the whole batch; ``"mean_of_means"``, the average of the pieces' own means, does not,
and the difference is far outside the tolerance. The all-pairs sweep (`tests/sweep_run.py`)
trains every composition on such batches too.

Tolerances are the course's policy (`reference.tolerance`, through `sweep_run.compare`):
losses within rtol 1e-5, weights after 3 AdamW steps within `adamw_weights`.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reference.data import PAD, padded_documents
from reference.loss import IGNORE_INDEX, MeanOfMeans, TokenMean, counted_tokens, step_mean
from reference.model import lm_loss
from reference.parallel.config import ParallelConfig
from reference.runtime import launch
from sweep import SweepCase
from sweep_run import batches, compare, run_cases, single_process

V = 11


def _padded(B=6, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    for b, n in enumerate([8, 5, 1, 7, 2, 3][:B]):  # row 2 counts one token
        targets[b, n:] = IGNORE_INDEX
    return logits, targets


def test_token_mean_shares_add_up_to_one_process_whatever_the_cut():
    logits, targets = _padded()
    whole = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    mean = TokenMean(counted_tokens(targets))
    for chunks in (1, 2, 3, 6):
        total = sum(mean.share(lm_loss, lg, tg) for lg, tg in zip(logits.chunk(chunks), targets.chunk(chunks)))
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=0)  # float64: the order of the sums


def test_mean_of_means_is_wrong_when_the_counts_differ_and_right_when_they_do_not():
    logits, targets = _padded()
    whole = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    cut = MeanOfMeans(3)
    got = sum(cut.share(lm_loss, lg, tg) for lg, tg in zip(logits.chunk(3), targets.chunk(3)))
    assert abs(float(got - whole)) > 1e-3  # rows of 8 + 5, 1 + 7, 2 + 3 counted tokens
    full = torch.randint(0, V, targets.shape, generator=torch.Generator().manual_seed(1))
    got = sum(cut.share(lm_loss, lg, tg) for lg, tg in zip(logits.chunk(3), full.chunk(3)))
    torch.testing.assert_close(got, F.cross_entropy(logits.reshape(-1, V), full.reshape(-1)),
                               rtol=1e-12, atol=0)


def test_a_piece_with_no_counted_token_adds_nothing_and_a_step_with_none_is_refused():
    logits, targets = _padded()
    targets[:3] = IGNORE_INDEX
    logits.requires_grad_(True)
    share = TokenMean(counted_tokens(targets)).share(lm_loss, logits[:3], targets[:3])
    share.backward()
    assert float(share.detach()) == 0.0 and float(logits.grad.abs().max()) == 0.0
    with pytest.raises(ValueError, match="counts no token"):
        step_mean("tokens", torch.full((2, 4), IGNORE_INDEX), 1, 1)
    with pytest.raises(ValueError, match="loss_mean must be one of"):
        step_mean("mean", targets, 1, 1)
    with pytest.raises(ValueError, match="loss_mean must be one of"):
        ParallelConfig(loss_mean="sum").validate(1)


def test_padded_documents_count_what_they_say():
    data = torch.arange(1000) % 256
    x, y = padded_documents(data, 16, 12, step=3, seed=5)
    x2, y2 = padded_documents(data, 16, 12, step=3, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)            # a function of (seed, step)
    counts = (y != IGNORE_INDEX).sum(1)
    assert counts.min() >= 1 and counts.max() <= 12 and len(set(counts.tolist())) > 1
    for b, n in enumerate(counts.tolist()):
        assert torch.equal(y[b, : n - 1], x[b, 1:n])             # y is x shifted by one
        assert (x[b, n:] == PAD).all() and (y[b, :n] != IGNORE_INDEX).all()


# dp with micro-batches, tp + SP, cp, pp, experts (their balance loss keeps its own
# normalisation) and ZeRO-3 by blocks, which runs its micro-batches outside the pipeline.
TWO = [ParallelConfig(dp=2, microbatches=2), ParallelConfig(pp=2, microbatches=4),
       ParallelConfig(dp=2, ep=2, microbatches=2)]
FOUR = [ParallelConfig(dp=2, tp=2, sequence_parallel=True),
        ParallelConfig(dp=2, cp=2, cp_kind="ring"),
        ParallelConfig(dp=4, zero_stage=3, microbatches=2)]  # FSDP by blocks runs its own micro-batches


@pytest.mark.parametrize("configs", [TWO, FOUR], ids=["2 ranks", "4 ranks"])
def test_the_token_mean_trains_as_one_process_and_the_mean_of_means_does_not(configs):
    cases = [SweepCase(c, moe=c.ep > 1) for c in configs]
    wrong = SweepCase(configs[0].with_(loss_mean="mean_of_means"))
    ranks = launch(run_cases, configs[0].world_size, cases + [wrong])[0]
    idx, tgt = batches(1)[0]
    assert len(set((tgt != IGNORE_INDEX).sum(1).tolist())) > 1  # the rows do count differently
    for case, got in zip(cases, ranks):
        row = compare(case, got, single_process(case))
        assert row["ok"], row["why"]
    # the old average, against one process's token mean: far outside the loss tolerance; and
    # the option is what it says, one process averaging the same chunks' means
    row = compare(wrong, ranks[-1], single_process(SweepCase(configs[0])))
    assert not row["ok"] and row["loss_rel"] > 10 * 1e-5, row
    row = compare(wrong, ranks[-1], single_process(wrong))
    assert row["ok"], row["why"]
