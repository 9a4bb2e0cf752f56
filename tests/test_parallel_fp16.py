"""fp16 with dynamic loss scaling in the 3D step: overflowing steps are skipped on every rank,
the scale backs off and grows, and training tracks the fp32 run."""
import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.parallel.config import ParallelConfig
from reference.parallel.scaler import DynamicLossScaler
from reference.runtime import launch

CFG = GPTConfig.tiny(n_layer=2, block_size=16)


def _batches(k=6):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (k, 8, 17), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _run(config, power):
    from reference.parallel import parallelize, train_step

    torch.manual_seed(0)
    pm = parallelize(GPT(CFG), config.mesh().build_groups(), config)
    if pm.scaler is not None:
        pm.scaler = DynamicLossScaler(initial_scale_power=power, window=2, hysteresis=1)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    out = []
    for idx, tgt in _batches():
        before = [p.detach().clone() for p in pm.parameters()]
        r = train_step(pm, opt, idx, tgt, max_norm=1.0)
        moved = any(not torch.equal(a, p) for a, p in zip(before, pm.parameters()))
        out.append((float(r.loss), r.skipped, r.loss_scale, moved))
    return out


def test_overflow_is_skipped_everywhere_and_the_scale_backs_off():
    """Start at 2^21: the scaled gradients of the fp16 activations overflow (above 65504), so
    the first steps are skipped on every rank (the parameters do not move) and the scale
    halves each time; then steps run, and after `window` = 2 good steps it doubles."""
    config = ParallelConfig(dp=2, tp=2, precision="fp16")
    ranks = launch(_run, 4, config, 21, timeout=180)
    for r in ranks:
        assert r == ranks[0]  # every rank agrees on every skip and every scale
    steps = ranks[0]
    skipped = [s for _, s, _, _ in steps]
    assert skipped[0] and not skipped[-1]
    for loss, skip, scale, moved in steps:
        assert moved != skip
    scales = [sc for _, _, sc, _ in steps]
    first_good = skipped.index(False)
    assert first_good >= 1 and scales[:first_good + 1] == [2.0 ** (21 - i) for i in range(first_good + 1)]
    assert not skipped[first_good + 1] and scales[first_good + 2] == 2 * scales[first_good]


def test_fp16_tracks_fp32():
    """Tolerance 5e-3 relative on the loss: fp16 keeps 10 bits of mantissa (1e-3 relative per
    rounding); the loss of random tokens barely moves in 6 steps, so the runs stay close."""
    fp16 = launch(_run, 2, ParallelConfig(dp=2, precision="fp16"), 12, timeout=180)[0]
    fp32 = launch(_run, 2, ParallelConfig(dp=2), 12, timeout=180)[0]
    assert not any(s for _, s, _, _ in fp16)
    for (a, *_), (b, *_) in zip(fp16, fp32):
        assert a == pytest.approx(b, rel=5e-3)
    assert [a for a, *_ in fp16] != [b for b, *_ in fp32]  # fp16 really ran
