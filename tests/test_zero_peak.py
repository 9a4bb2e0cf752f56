"""ZeRO-2's peak gradient memory, measured through backward and step, against the formula.

`ZeroOptimizer(stage=2)` reduce-scatters the gradients bucket by bucket from hooks
during backward, so a rank never holds more gradient than its shard (S numbers) and
one bucket (B) at once: `memory.zero_peak_grad_bytes` = 4 (S + B) in fp32. Reducing
everything once in `step()` would hold every module gradient, a flat copy of them
and the shard together: 4 (2P + S).

`memory.PeakMemory` watches every tensor created during backward and step. Besides
what the optimizer holds, it sees autograd's own working memory: the gradient just
computed for one parameter, before the hook copies it into the bucket, and the
activations' gradients. The model here makes those small and known: a stack of
Linear(64, 64) layers on one example, so an activation's gradient is 64 numbers and
the largest parameter gradient 64 * 64.

Also here: gradient accumulation over several backwards (into the shard), a
parameter that gets no gradient (its bucket is reduced at the end of backward),
gradients set by hand (reduced by `step()`), and the bucket layout itself.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms, memory
from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.zero import ZeroOptimizer
from reference.tolerance import adamw_weights, sgd_weights
from reference.zero.shard import FlatLayout
from reference.train.single import accumulated_step

WIDTH, LAYERS = 64, 8
LAYER = WIDTH * WIDTH + WIDTH                  # numbers per Linear layer: 4160
PSI = LAYERS * LAYER                           # 33,280: divisible by 2 and 4, no padding
# Two layers per bucket, in MiB as the optimizer takes it: 2 * 4160 * 4 bytes = 130 / 2**12
# MiB, a binary fraction, so the cap is exactly 8,320 numbers.
TWO_LAYERS_MB = 2 * LAYER * 4 / 2**20
# Autograd's own memory at the peak, on top of what the optimizer holds: the weight
# gradient just computed (64 * 64 fp32 = 16 KiB) and a few activation gradients of
# (1, 64) fp32 = 256 B each (three, and the loss's scalar, measured); 2 KiB covers eight.
AUTOGRAD_SLACK = 4 * WIDTH * WIDTH + 2048
TIMEOUT = 120.0


def _stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _peak_body(stage, bucket_cap_mb):
    model = _stack()
    kwargs = {} if bucket_cap_mb is None else dict(bucket_cap_mb=bucket_cap_mb)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1, **kwargs)
    x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {}
    for step in range(2):  # the second step starts from zero_grad's state, as training does
        loss = model(x).square().mean()
        held_before = memory.measure(model, opt).grads
        with memory.PeakMemory() as total:
            with memory.PeakMemory() as backward:
                loss.backward()
            opt.step()
        opt.zero_grad()
        out[step] = dict(held_before=held_before, total=total.peak_bytes, backward=backward.peak_bytes)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bucket_cap_mb, bucket_numel", [(None, None), (TWO_LAYERS_MB, 2 * LAYER)],
                         ids=["one-bucket", "two-layer-buckets"])
def test_stage2_peak_is_shard_plus_one_bucket(world, bucket_cap_mb, bucket_numel):
    results = launch(_peak_body, world, 2, bucket_cap_mb, timeout=TIMEOUT, quiet=True)
    S = PSI // world
    want = memory.zero_peak_grad_bytes(PSI, world, 2, bucket_numel=bucket_numel)
    for rank, res in enumerate(results):
        for step, got in res.items():
            assert got["held_before"] == 0  # stage 2 holds no gradient between steps after zero_grad
            # Through backward and step: the backward's peak, or, in step, the shard's
            # gradient (S) beside the copy of the updated shard that the all-gather
            # sends (S, parameter bytes). step() makes no gradient of its own.
            assert got["total"] == max(got["backward"], 4 * 2 * S), (rank, step, got)
            # Backward. Lower bound: the shard and one bucket really are alive together.
            # Upper bound: plus autograd's own memory (AUTOGRAD_SLACK), never a second
            # bucket nor a full-size gradient.
            assert want <= got["backward"] <= want + AUTOGRAD_SLACK, (rank, step, got["backward"], want)
    old_way = 4 * (2 * PSI + S)  # every gradient, a flat copy of them and the shard
    assert want + AUTOGRAD_SLACK < old_way


def test_stage1_peak_is_its_full_buffer():
    results = launch(_peak_body, 2, 1, None, timeout=TIMEOUT, quiet=True)
    S = PSI // 2
    want = memory.zero_peak_grad_bytes(PSI, 2, 1)
    for res in results:
        for got in res.values():
            assert got["held_before"] == 4 * PSI  # the buffer is kept (zeroed) between steps
            # backward accumulates into the buffer in place: only autograd's own memory
            assert got["backward"] <= AUTOGRAD_SLACK
            # step: the reduce-scatter's output (S), freed before the all-gather's input copy (S)
            assert got["total"] == max(got["backward"], 4 * S)
            assert got["held_before"] + 4 * S == want


def test_stage2_saves_at_the_peak_of_a_step_only_with_small_buckets():
    """Notebook 02: the peak of a whole step (gradients held at its start plus the peak of
    what backward and step() create). ZeRO-1 peaks at 4 (P + S). ZeRO-2 with one bucket
    saves nothing there (its backward fills a bucket as large as ZeRO-1's buffer, with
    autograd's own memory on top); with two layers a bucket its peak falls to the 8 S
    of step() (the gradient shard beside the copy of the updated shard it all-gathers)."""
    S = PSI // 2

    def step_peak(stage, cap_mb):
        res = launch(_peak_body, 2, stage, cap_mb, timeout=TIMEOUT, quiet=True)[0][1]  # rank 0, second step
        return res["held_before"] + res["total"]

    zero1 = step_peak(1, None)
    one_bucket, two_layers = step_peak(2, None), step_peak(2, TWO_LAYERS_MB)
    assert zero1 == memory.zero_peak_grad_bytes(PSI, 2, 1)
    assert one_bucket >= zero1
    assert two_layers == 4 * 2 * S < zero1


# ---------------------------------------------------------------------------
# Gradient accumulation and unused parameters (GPT, uneven sizes, small buckets)
# ---------------------------------------------------------------------------
CONFIG = GPTConfig.tiny(n_embd=9, n_head=3)  # units divisible by neither 2 nor 4: padded
BATCH, MICRO, STEPS, LR = 8, 2, 2, 1e-3
SMALL_MB = 1024 * 4 / 2**20                  # buckets of at most 1024 numbers: several per model


def _batch(step):
    return synthetic_batch(BATCH, CONFIG.block_size, seed=3, step=step)


def _one_process():
    model = GPT.from_config_seed(CONFIG, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        accumulated_step(model, opt, *_batch(step))
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _accumulate_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT.from_config_seed(CONFIG, 0)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=LR, bucket_cap_mb=SMALL_MB)
    rows = BATCH // world // MICRO
    for step in range(STEPS):
        x, y = _batch(step)
        mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        with comms.meter() as m:
            for k in range(MICRO):  # micro-batches of this rank's rows, each backward on its own
                part = slice(k * rows, (k + 1) * rows)
                _, loss = model(x[mine][part], y[mine][part])
                (loss / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return dict(params={k: v.detach().clone() for k, v in model.named_parameters()},
                buckets=len(opt.buckets), reduce_scatters=m.calls("reduce_scatter"),
                sent=m.sent_bytes("reduce_scatter"), shard_numel=opt.layout.shard_numel)


def test_stage2_gradient_accumulation_matches_one_process():
    want = _one_process()
    results = launch(_accumulate_body, 2, timeout=TIMEOUT, quiet=True)
    for res in results:
        assert res["buckets"] > 2
        # every backward reduce-scatters every bucket once: (N-1)/N * 4P per backward
        assert res["reduce_scatters"] == MICRO * res["buckets"]
        assert res["sent"] == MICRO * 4 * (2 - 1) * res["shard_numel"]
        # the course's policy (reference.tolerance): weights after STEPS AdamW steps
        adamw_weights(STEPS, LR).assert_weights(res["params"], want, "ZeRO-2, accumulated")


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, 3)    # no gradient, ever: its bucket closes at the end

    def forward(self, x):
        return self.used(x)


def _unused_body(zero):
    model = _WithUnused()
    opt = (ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1, bucket_cap_mb=LAYER * 4 / 2**20)
           if zero else torch.optim.SGD(model.parameters(), lr=0.1))
    rank, world = (dist.get_rank(), dist.get_world_size()) if zero else (0, 1)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        model(x[rank * 4 // world:(rank + 1) * 4 // world]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_stage2_parameter_without_gradient():
    want = _unused_body(False)
    for got in launch(_unused_body, 2, True, timeout=TIMEOUT, quiet=True):
        # SGD without momentum (a zero gradient moves nothing): 2 steps, gradients over 2 ranks
        for k, v in want.items():
            sgd_weights(2, 0.1, n=2).assert_close(got[k], v, k)


def _by_hand_body():
    model = _stack()
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1, bucket_cap_mb=TWO_LAYERS_MB)
    for p in model.parameters():  # no backward: no hook sees these; step() reduces them
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_stage2_reduces_gradients_set_by_hand():
    start = dict(_stack().named_parameters())
    for got in launch(_by_hand_body, 2, timeout=TIMEOUT, quiet=True):
        for k, v in start.items():  # the mean of 1 and 2 is 1.5; SGD moves by 0.1 * 1.5
            sgd_weights(1, 0.1, n=2).assert_close(got[k], v.detach() - 0.15, k)


def test_buckets_cover_the_flat_buffer_from_the_end():
    layout = FlatLayout([5, 3, 2, 7], 4)         # 17 numbers, P = 20, S = 5
    buckets = layout.buckets(8)
    assert [(b.start, b.end, b.tensors) for b in buckets] == [(10, 20, (3,)), (5, 10, (1, 2)), (0, 5, (0,))]
    # bucket 0 holds the padding and is larger than the cap: tensor 3 is never cut
    assert layout.pieces(buckets[1]) == [(5, 5), (5, 10), (10, 10), (10, 10)]
    assert layout.pieces(buckets[0]) == [(10, 10), (10, 10), (10, 15), (15, 20)]
    with pytest.raises(ValueError, match="cap_numel must be a positive int"):
        layout.buckets(0)
