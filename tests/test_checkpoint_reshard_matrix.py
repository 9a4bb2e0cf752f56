"""Every checkpoint loads into every other layout, byte for byte: a matrix of layouts.

A checkpoint stores each tensor of the plain GPT whole (as boxes the ranks wrote), its
AdamW moments beside it, keyed by the plain model's names. So a checkpoint saved from
layout A, loaded into layout B and saved again from B must hold exactly the same
numbers: loading and saving only move bytes. For every ordered pair (A, B) of the
layouts below, dense and with experts, a run in A trains two AdamW steps and saves; a run
in B loads it and saves it again untouched; both folders are then read back whole in
this process (`torch.distributed.checkpoint`'s own reader) and compared with
`torch.equal`, every tensor: weights, both moments and the step counters (not the
saver's own record of its layout and random states).

The layouts cover each degree (dp, tp, pp, ep) and each kind of ZeRO shard, alone and
composed: ZeRO-1's flat shard (ZeRO-2 keeps the same one), ZeRO-3 by blocks (flat) and
per parameter (rows of a TP slice, of a pipeline stage, of an expert over its
expert-data-parallel group). 7 dense and 4 expert layouts of 1 to 4 ranks: 65 ordered
pairs, about a minute and a half on 2 cores (layouts of 8 ranks are left out for time).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.parallel import ParallelConfig
from reference.runtime import launch

pytestmark = pytest.mark.timeout(400)

CFG = GPTConfig.tiny(n_layer=4, block_size=16)
B, T = 8, 16
DENSE = [ParallelConfig(),
         ParallelConfig(dp=2, zero_stage=1),
         ParallelConfig(dp=2, zero_stage=3),                                   # FSDP by blocks
         ParallelConfig(tp=2, sequence_parallel=True),
         ParallelConfig(pp=2, microbatches=2),
         ParallelConfig(dp=2, tp=2, zero_stage=3),                             # rows of TP slices
         ParallelConfig(dp=2, pp=2, zero_stage=3, microbatches=2)]               # rows of a stage
EXPERTS = [ParallelConfig(),
           ParallelConfig(dp=2, ep=2),
           ParallelConfig(dp=4, ep=2, zero_stage=3),                           # rows over edp
           ParallelConfig(dp=2, tp=2, ep=2, zero_stage=3, sequence_parallel=True)]
FAMILIES = {"dense": DENSE, "experts": EXPERTS}


def _factory(family):
    from reference.expert_parallel import moe_factory

    return moe_factory(4, k=2, capacity_factor=2.0) if family == "experts" else None


def _build(config, family):
    from reference.parallel import parallelize

    torch.manual_seed(0)
    pm = parallelize(GPT(CFG, _factory(family)), config.mesh().build_groups(), config, batch=(B, T))
    return pm, pm.make_optimizer(torch.optim.AdamW, lr=1e-3, eps=1e-6)


def _save(jobs):
    """Each (family, index, config, folder): train two steps, save step 2 into the folder."""
    from reference.parallel import train_step
    from reference.train.checkpoint import save_checkpoint

    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, CFG.vocab_size, (2, B, T + 1), generator=g)
    for family, _, config, folder in jobs:
        pm, opt = _build(config, family)
        for d in data:
            train_step(pm, opt, d[:, :-1], d[:, 1:])
        save_checkpoint(folder, 2, pm, opt)


def _load_and_save(jobs):
    """Each (family, config, source folder, target folder): load, save again untouched."""
    from reference.train.checkpoint import load_checkpoint, save_checkpoint

    for family, config, source, target in jobs:
        pm, opt = _build(config, family)
        load_checkpoint(source, pm, opt)
        save_checkpoint(target, 2, pm, opt)


def _read(folder: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(folder / "step_000002", out)
    return torch.load(out, weights_only=False)


def _flat(tree, prefix=""):
    """(key, value) of every leaf; the "meta" entry (which layout saved it, its RNG states) is
    the saver's own and left out."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if not (prefix == "" and str(k).split("/")[0] == "meta"):
                yield from _flat(v, f"{prefix}/{k}" if prefix else str(k))
    else:
        yield prefix, tree


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    layouts = [(f, i, c) for f, cs in FAMILIES.items() for i, c in enumerate(cs)]
    saved = {(f, i): root / f"{f}{i}" for f, i, _ in layouts}
    resaved = {}
    for world in sorted({c.world_size for _, _, c in layouts}):
        jobs = [(f, i, c, saved[f, i]) for f, i, c in layouts if c.world_size == world]
        launch(_save, world, jobs, timeout=300)
    for world in sorted({c.world_size for _, _, c in layouts}):
        jobs = []
        for f, j, c in layouts:
            if c.world_size != world:
                continue
            for i in range(len(FAMILIES[f])):
                resaved[f, i, j] = root / f"{f}{i}_into_{j}"
                jobs.append((f, c, saved[f, i], resaved[f, i, j]))
        launch(_load_and_save, world, jobs, timeout=300)
    return saved, resaved


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_layout_loads_every_other_byte_for_byte(folders, family):
    saved, resaved = folders
    configs = FAMILIES[family]
    originals = {i: dict(_flat(_read(saved[family, i]))) for i in range(len(configs))}
    first = originals[0]
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in first), sorted(first)[:8]
    for i, want in originals.items():
        assert set(want) == set(first), f"{configs[i]} saved other keys than {configs[0]}"
    bad = []
    for i, j in ((i, j) for i in range(len(configs)) for j in range(len(configs))):
        got = dict(_flat(_read(resaved[family, i, j])))
        want = originals[i]
        if set(got) != set(want):
            bad.append(f"{configs[i]} -> {configs[j]}: keys {sorted(set(got) ^ set(want))[:4]}")
            continue
        for k, v in want.items():
            same = torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
            if not same:
                bad.append(f"{configs[i]} -> {configs[j]}: {k} differs")
                break
    assert not bad, "\n".join(bad)
