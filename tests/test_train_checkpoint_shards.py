"""Checkpoints saved as shards (`reference.train.checkpoint_shards`): each rank hands DCP only
the boxes it holds and reads only the parts it needs; the boxes tile every tensor exactly.

Resuming bit for bit and loading into other layouts are tested in
`tests/test_train_checkpoint.py`, on checkpoints written this way."""
from __future__ import annotations

import math
import random

import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.parallel import ParallelConfig
from reference.runtime import launch

pytestmark = pytest.mark.timeout(120)

# n_embd 64: the tensor-parallel matrices dominate; wpe, LayerNorms and row biases replicated
CFG = GPTConfig.tiny(n_layer=2, n_embd=64, block_size=16)


def test_flat_ranges_become_contiguous_boxes():
    """Numbers [a, b) of a flattened tensor are cut into boxes that cover them exactly, each
    box contiguous in the flat buffer (so a view of a ZeRO flat shard), in order."""
    from reference.train.checkpoint_shards import _flat_boxes

    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        seen = []
        for offsets, sizes, first in _flat_boxes(shape, a, b):
            box = torch.arange(n).view(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert box.flatten().tolist() == list(range(first, first + box.numel())), (shape, a, b)
            seen += box.flatten().tolist()
        assert seen == list(range(a, b)), (shape, a, b)


def _save_and_load(root):
    import torch.distributed.checkpoint as dcp
    from reference.parallel import parallelize, train_step
    from reference.train import checkpoint

    config = ParallelConfig(tp=4)

    def build():
        torch.manual_seed(0)
        pm = parallelize(GPT(CFG), config.mesh().build_groups(), config, batch=(4, 16))
        return pm, pm.make_optimizer(torch.optim.AdamW, lr=1e-3)

    pm, opt = build()
    idx = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    train_step(pm, opt, idx[:, :-1], idx[:, 1:])
    path = checkpoint.save_checkpoint(root, 1, pm, opt)
    saved = dict(checkpoint.last_bytes)
    fresh, fresh_opt = build()
    checkpoint.load_checkpoint(path, fresh, fresh_opt)
    loaded = dict(checkpoint.last_bytes)
    mine = sum(p.nbytes for p in pm.parameters())  # this rank's weights: its shard
    same = all(torch.equal(a, b) for a, b in zip(pm.parameters(), fresh.parameters()))
    states = [(opt.state[p], fresh_opt.state[q]) for p, q in zip(pm.parameters(), fresh.parameters())]
    same = same and all(torch.equal(s[k], t[k]) for s, t in states for k in s)
    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return saved, loaded, mine, same, md


def test_each_rank_writes_and_reads_its_shard(tmp_path, capsys):
    """tp 4: a rank hands DCP views of its weights and AdamW moments only (3 x its weights'
    bytes, no copy), every box is written once (the ranks' bytes add up to the checkpoint's),
    and loading into tp 4 reads 3 x its shard and allocates the two moments only. Before,
    every rank gathered the whole model and its moments: 3 x the whole model."""
    ranks = launch(_save_and_load, 4, tmp_path, timeout=90)
    md = ranks[0][4]
    total = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in md.values()
                if hasattr(m, "chunks"))
    model = sum(math.prod(m.size) * m.properties.dtype.itemsize for k, m in md.items()
                if k.startswith("model/"))
    attn = md["model/h.0.attn.c_attn.weight"]  # (3 C, C): q|k|v, each cut in 4 row blocks
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in attn.chunks) == \
        [((16 * i, 0), (16, 64)) for i in range(12)]
    assert len(md["model/h.0.ln_1.weight"].chunks) == 1  # replicated over tp: written once
    assert sum(r[0]["written"] for r in ranks) == total
    with capsys.disabled():
        print(f"\n  whole model {model} B, with AdamW's moments {3 * model} B (what every rank "
              f"gathered before); tp 4, per rank:")
    for rank, (saved, loaded, mine, same, _) in enumerate(ranks):
        assert same, f"rank {rank}: the loaded weights or moments differ"
        assert saved["handed"] == 3 * mine and loaded["read"] == 3 * mine
        assert loaded["allocated"] == 2 * mine
        assert 3 * mine < 0.3 * 3 * model  # a quarter of the model, and the replicated tensors
        assert saved["written"] < 0.3 * total
        with capsys.disabled():
            print(f"  rank {rank}: handed to DCP {saved['handed']} B ({saved['handed'] / (3 * model):.3f}"
                  f" of 3 x the model), wrote {saved['written']} B, read {loaded['read']} B, "
                  f"allocated {loaded['allocated']} B")
