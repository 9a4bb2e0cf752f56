"""Notebook 02: ZeRO-3's peak inside a step, stated completely and measured.

At the peak of a step of `reference.zero.FSDP` a rank holds its shards (parameters
and AdamW state; the gradient shards only come at the end of backward), the units
whole at that moment, and the tensors the step created. The last are exactly what
one process creates for the same slice of the batch: ZeRO does not shard
activations. For the tiny 4-block GPT on 2 ranks the peak falls at the start of
backward, with the root unit and the prefetched last block whole.
"""
import torch
import torch.distributed as dist

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
    return held, peak.peak_bytes, peak.peak_parts, [4 * u.layout.padded_numel for u in fsdp.units]


def test_zero3_peak_is_shards_plus_whole_units_plus_unsharded_activations():
    world = 2
    results = launch(_zero3_peak, world, timeout=120, quiet=True)
    psi = GPT.from_config_seed(CFG, 0).num_parameters()
    for rank, (held, peak, (created, gathered), units) in enumerate(results):
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
