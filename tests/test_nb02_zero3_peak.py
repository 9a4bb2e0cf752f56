"""Notebook 02: ZeRO-3's peak inside a step, stated completely and measured.

At the peak of a step of `reference.zero.FSDP` a rank holds its shards (parameters
and AdamW state; the gradient shards only come at the end of backward), the units
whole at that moment, and the tensors the step created. The last are exactly what
one process creates for the same slice of the batch: ZeRO does not shard
activations. For the tiny 4-block GPT on 2 ranks the peak falls at the start of
backward, with the root unit and the prefetched last block whole.

A unit's full-size gradient lives from its backward until its reduce-scatter is
done. FSDP keeps one reduce-scatter in flight (as FSDP2 does): the previous
unit's is finished, and its full gradient freed, before the next one starts, so
backward holds the gradient shards plus at most two units' full gradients, not
every unit's (4 bytes a parameter, more than 16 Psi / N once N > 4) until its end.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from reference import memory
from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.zero import FSDP

CFG = GPTConfig.tiny(n_layer=4)
BATCH = 8


def _batch(rank, world):
    x, y = synthetic_batch(BATCH, CFG.block_size, seed=7, step=0)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return x[rows], y[rows]


def _gradient_peak(n_units=8, width=64):
    """Backward of a stack of Linear units on one row: the tensors it creates are gradients."""
    torch.manual_seed(0)
    stack = nn.Sequential(*[nn.Linear(width, width) for _ in range(n_units)])
    fsdp = FSDP(stack, units=list(stack))
    loss = fsdp(torch.randn(1, width)).sum()
    with memory.PeakMemory() as peak:
        loss.backward()
    return peak.peak_bytes, peak.live_bytes, [u.layout.padded_numel for u in fsdp.units], \
        [u.layout.shard_numel for u in fsdp.units]


def _zero3_peak():
    fsdp = FSDP(GPT.from_config_seed(CFG, 0))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    batch = _batch(dist.get_rank(), dist.get_world_size())
    whole = lambda: sum(u.full.untyped_storage().nbytes() for u in fsdp.units)
    for _ in range(2):
        held = memory.measure(fsdp, opt)
        with memory.PeakMemory(also=whole) as peak:
            _, loss = fsdp(*batch)
            loss.backward()
        opt.step()
        opt.zero_grad()
    return (held, peak.peak_bytes, peak.peak_parts, [4 * u.layout.padded_numel for u in fsdp.units],
            _gradient_peak())


@pytest.fixture(scope="module")
def results():
    return launch(_zero3_peak, 2, timeout=120, quiet=True)


def test_zero3_peak_is_shards_plus_whole_units_plus_unsharded_activations(results):
    world = 2
    psi = GPT.from_config_seed(CFG, 0).num_parameters()
    for rank, (held, peak, (created, gathered), units, _) in enumerate(results):
        model = GPT.from_config_seed(CFG, 0)
        batch = _batch(rank, world)
        with memory.PeakMemory() as alone:
            _, loss = model(*batch)
            loss.backward()
        assert (held.params, held.grads, held.optimizer_state) == (4 * psi // world, 0, 8 * psi // world)
        assert gathered == units[0] + units[-1]          # root and the prefetched last block
        assert created == alone.peak_bytes               # activations: one process's, unsharded
        assert peak == gathered + created
        assert units[0] < units[1]                       # tiny vocabulary: the root is smaller than a block


def test_backward_holds_at_most_two_full_unit_gradients(results):
    for *_, (peak, left, padded, shard) in results:
        unit = 4 * padded[0]                   # one unit's full fp32 gradient, padded
        assert left == 4 * sum(shard)          # after backward: the gradient shards, 4 Psi / N
        # Through backward: the shards plus at most two full gradients (the unit in flight
        # and the one being reduced), where keeping all eight would add 4 Psi.
        assert left + unit < peak <= left + 2 * unit
        assert left + 2 * unit < left + len(padded) * unit


def test_peak_memory_adds_also_at_every_sample():
    extra = [0]
    with memory.PeakMemory(also=lambda: extra[0]) as peak:
        a = torch.ones(256)              # 1 KiB
        extra[0] = 4096
        b = a + 1                        # sampled: 2 KiB new + 4 KiB
        del a, b
        extra[0] = 0
        c = torch.ones(16)
    assert peak.peak_bytes == 2048 + 4096 and peak.peak_parts == (2048, 4096)
    assert peak.live_bytes == 64
    del c
