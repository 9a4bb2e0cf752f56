"""reference.data_parallel.compression: bf16-compressed DDP sends exactly half the bytes and
equals PyTorch's DDP with bf16_compress_hook; PowerSGD's bytes per step equal the formula;
the tiny GPT's loss after 30 steps with each compression against uncompressed DDP.

All distributed bodies run in one `launch` of 2 ranks (the `runs` fixture); the tests
read its results. Training: the tiny GPT, AdamW, 30 steps of 8 sequences of 32 bytes
of the arithmetic text (each rank its 4 rows), then the loss of an unseen 31st batch.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from reference import comms
from reference.data_parallel import DDP, CompressedDDP, metered_comm_hook, powersgd_bytes
from reference.model import GPT, GPTConfig
from reference.parallel.golden import debug_batches
from reference.runtime import launch
from reference.tolerance import exact

CFG = GPTConfig.tiny()  # 2 layers, C = 32: every numel divides by 2, so ring bytes are exact
STEPS, BATCH, LR = 30, (8, 32), 3e-3
PARITY_STEPS = 3  # steps whose gradients are compared element by element
POWERSGD_RANKS = (1, 4)
START = 2  # PowerSGD's plain all-reduce steps: the least PyTorch allows with error feedback
WORLD = 2
U = 2.0**-8  # bf16's unit roundoff: 8 significant bits, round to nearest


def _shapes():
    return [tuple(p.shape) for p in GPT.from_config_seed(CFG, 0).parameters()]  # the tied weight once


# ------------------------------------------------------------------- the ranks' work
def _train(wrap, steps=STEPS):
    """Train the wrapped tiny GPT; per step: all-reduce (calls, payload, sent) and the mean gradients."""
    batches = debug_batches(steps + 1, BATCH)
    n, r = dist.get_world_size(), dist.get_rank()
    model = GPT.from_config_seed(CFG, 0)
    ddp = wrap(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0)
    per_step, grads = [], []
    for step, (x, y) in enumerate(batches[:steps]):
        with comms.meter() as m:
            ddp(x.chunk(n)[r], y.chunk(n)[r])[1].backward()
        per_step.append((m.calls("all_reduce"), m.payload_bytes("all_reduce"), m.sent_bytes("all_reduce")))
        if step < PARITY_STEPS:
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        final = float(model(*batches[steps])[1])
    return dict(per_step=per_step, grads=grads, final_loss=final)


def _torch_ddp(hook=None, state=None):
    def wrap(model):
        ddp = nn.parallel.DistributedDataParallel(model)
        if hook is not None:
            ddp.register_comm_hook(state, metered_comm_hook(hook))
        return ddp
    return wrap


def _local_gradients():
    """This rank's own gradient of step 0, before any averaging (for the bf16 error bound)."""
    x, y = debug_batches(1, BATCH)[0]
    n, r = dist.get_world_size(), dist.get_rank()
    model = GPT.from_config_seed(CFG, 0)
    model(x.chunk(n)[r], y.chunk(n)[r])[1].backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _all_runs():
    torch.set_num_threads(1)  # tiny models: one thread each is fastest, and steady on a busy machine
    out = dict(local=_local_gradients(),
               fp32=_train(lambda m: DDP(m)),
               bf16=_train(lambda m: CompressedDDP(m)),
               torch_bf16=_train(_torch_ddp(bf16_compress_hook)))
    for rank in POWERSGD_RANKS:
        state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START)
        out[f"powersgd{rank}"] = _train(_torch_ddp(powerSGD_hook, state))
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_all_runs, WORLD, backend="gloo", timeout=120.0)


# ----------------------------------------------------------------------------- bf16
def test_bf16_buckets_send_exactly_half_the_bytes(runs):
    for rank, out in enumerate(runs):
        for (c32, p32, s32), (c16, p16, s16), (ct, pt, st) in zip(
                out["fp32"]["per_step"], out["bf16"]["per_step"], out["torch_bf16"]["per_step"], strict=True):
            # One all-reduce per bucket, as before; each number travels in 2 bytes, not 4.
            assert c16 == c32 and 2 * p16 == p32 and 2 * s16 == s32, f"rank {rank}"
            # PyTorch's hook sends the same bytes (counted by metered_comm_hook).
            assert (pt, st) == (p16, s16), f"rank {rank}"
        # The formula: 2 bytes per parameter, 2(N-1)/N of them sent per rank.
        psi = sum(torch.Size(s).numel() for s in _shapes())
        assert out["bf16"]["per_step"][0][1:] == (2 * psi, 2 * psi * 2 * (WORLD - 1) // WORLD)


def test_bf16_ddp_equals_pytorch_ddp_with_bf16_compress_hook(runs):
    for rank, out in enumerate(runs):
        for step, (ours, theirs) in enumerate(zip(out["bf16"]["grads"], out["torch_bf16"]["grads"], strict=True)):
            for name in ours:
                # Both round the same numbers: PyTorch rounds g to bf16 then divides
                # by N = 2, we divide then round, which is the same bf16 number for a
                # power of two; the sum of two bf16 numbers is rounded once by gloo, in
                # either order the same. So the same arithmetic: bit for bit.
                exact().assert_close(ours[name], theirs[name], f"rank {rank} step {step} {name}")


def test_bf16_gradient_is_within_the_rounding_bound_of_the_fp32_mean(runs):
    local = [out["local"] for out in runs]  # each rank's own step-0 gradient, a and b
    for rank, out in enumerate(runs):
        compressed, fp32 = out["bf16"]["grads"][0], out["fp32"]["grads"][0]
        differs = False
        for name, g in compressed.items():
            a, b = local[0][name], local[1][name]
            # bf16(bf16(a/2) + bf16(b/2)): two inputs rounded by U of themselves, the sum by U
            # of itself, so |error| <= U (|a| + |b|) / 2 + U (|a + b| / 2 + U (|a| + |b|) / 2)
            # <= U (1 + U) (|a| + |b|); fp32's own rounding (1e-7 of it) is in the margin of 2x.
            bound = 2 * U * (1 + U) * (a.abs() + b.abs())
            assert bool(((g - fp32[name]).abs() <= bound + 1e-12).all()), f"rank {rank} {name}"
            # fp32 DDP: the mean of two numbers, halved (exactly) and added once: bit for bit
            exact().assert_close(fp32[name], (a + b) / 2, f"rank {rank} fp32 mean of {name}")
            differs |= not torch.equal(g, fp32[name])
        assert differs  # the compression really rounded something


# -------------------------------------------------------------------------- PowerSGD
def test_powersgd_bytes_formula_by_hand():
    # (96, 32): compressed, (96 + 32) * 1 * 2 = 256 < 3072; a vector never is;
    # (4, 4): 8 * 2 = 16 is not < 16, sent whole; (8, 3, 3, 3) is viewed as (8, 27).
    got = powersgd_bytes([(96, 32), (32,), (4, 4), (8, 3, 3, 3)], rank=1)
    assert (got.p, got.q, got.uncompressed) == (4 * (96 + 8), 4 * (32 + 27), 4 * (32 + 16))
    assert got.dense == 4 * (96 * 32 + 32 + 16 + 8 * 27) and got.total == got.p + got.q + got.uncompressed
    # r is capped at min(n, m) = 4: (4 + 4) * 4 * 0.5 = 16 is not < 16, * 0.25 is.
    assert powersgd_bytes([(4, 4)], rank=8, min_compression_rate=0.5).p == 0
    assert powersgd_bytes([(4, 4)], rank=8, min_compression_rate=0.25).p == 4 * (4 * 4)
    with pytest.raises(ValueError, match="rank must be a positive int.*0"):
        powersgd_bytes([(4, 4)], rank=0)
    with pytest.raises(ValueError, match="0-d tensor"):
        powersgd_bytes([()], rank=1)


def test_powersgd_all_reduces_the_formulas_bytes(runs):
    psi4 = 4 * sum(torch.Size(s).numel() for s in _shapes())
    for rank in POWERSGD_RANKS:
        want = powersgd_bytes(_shapes(), rank)
        assert want.dense == psi4
        for r, out in enumerate(runs):
            payload = [p for _, p, _ in out[f"powersgd{rank}"]["per_step"]]
            # The first START steps are plain all-reduces of every gradient; then each
            # step sends the uncompressed tensors, the P and the Q matrices (3 calls).
            assert payload == [psi4] * START + [want.total] * (STEPS - START), f"rank {r}, r={rank}"
            assert [c for c, _, _ in out[f"powersgd{rank}"]["per_step"]][START:] == [3] * (STEPS - START)
    # The tiny GPT, per step: 15x fewer bytes at r = 1 (9,088 against 138,752), 5.4x at r = 4.
    assert powersgd_bytes(_shapes(), 1).ratio > 15 and powersgd_bytes(_shapes(), 4).ratio > 5


def test_powersgd_changes_the_gradient(runs):
    for out in runs:
        fp32, compressed = out["fp32"]["grads"], out["powersgd1"]["grads"]
        for name in fp32[0]:  # the plain steps are the exact mean: two numbers, halved and added
            exact().assert_close(compressed[0][name], fp32[0][name], f"PowerSGD's plain step, {name}")
        flat = lambda g: torch.cat([t.flatten() for t in g.values()])  # noqa: E731
        # Step START, the first compressed one: rank 1 misses a part of the gradient
        # (measured 16% of its norm): compression costs accuracy per step.
        err = (flat(compressed[START]) - flat(fp32[START])).norm() / flat(fp32[START]).norm()
        assert 0.05 < float(err) < 0.5


# ----------------------------------------------------------------- loss after training
def test_compressed_training_reaches_the_uncompressed_loss(runs):
    """Final losses after 30 steps, measured (same on both ranks): fp32 2.5797, bf16 2.5797,
    PowerSGD r = 1 2.5810 (+0.05%), r = 4 2.5794 (-0.01%)."""
    fp32 = runs[0]["fp32"]["final_loss"]
    assert fp32 < 3.0  # from ln 256 = 5.55: the runs really trained
    for out in runs:
        assert out["fp32"]["final_loss"] == fp32  # replicas: one model on every rank
        # bf16 compression rounds each gradient by 2^-8 of itself: the loss moves by
        # about the same relative amount at most (measured 6e-6).
        assert out["bf16"]["final_loss"] == pytest.approx(fp32, rel=U)
        assert out["torch_bf16"]["final_loss"] == out["bf16"]["final_loss"]  # equal gradients, equal runs
        # PowerSGD: 1% of the final loss is under 1% of the 2.95 nats the loss falls.
        # Error feedback resends what each step's approximation missed, and AdamW
        # normalises each step, so the loss follows the uncompressed run closely here.
        for rank in POWERSGD_RANKS:
            assert out[f"powersgd{rank}"]["final_loss"] == pytest.approx(fp32, rel=0.01)


def test_bad_dtype_is_named():
    with pytest.raises(ValueError, match=r"dtype must be one of .*torch.float32"):
        CompressedDDP(GPT.from_config_seed(CFG, 0), dtype=torch.float32)
