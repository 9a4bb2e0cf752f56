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

Then with the optimizer and the schedule as the trainer builds them: AdamW with weight decay
in the trainer's two groups (matrices decayed, biases and LayerNorm gains not), which a plain
optimizer and per-parameter ZeRO-3 keep as two groups, ZeRO-1 as one inner group, and an
embedding stage's ranks as one; a WarmupDecayLR schedule whose lr moves every step; clipping.
Each layout (FSDP by blocks left out: it refuses weight decay) trains two steps, saves and
trains two more; every layout loads each checkpoint and trains the same two steps: the
learning rates equal the uninterrupted run's exactly, the losses within `tolerance.loss()`.
6 dense layouts and the embedding stage (pp 4), 4 with experts: 65 ordered pairs.

One load serves both: each of those loads saves the checkpoint again untouched before it
trains, and that copy is the byte-for-byte comparison's; the plain matrix loads only the pairs
with FSDP by blocks (13 of its 49 dense pairs; every expert pair is in the weight-decay one).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.parallel import ParallelConfig
from reference.runtime import launch
from reference.tolerance import loss as loss_tolerance
from reference.train.lr_schedules import SchedulerConfig, SchedulerParams

pytestmark = pytest.mark.timeout(600)

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
# with weight decay: FSDP by blocks refuses it (its flat shards mix decayed and exempt tensors);
# an embedding stage's ranks hold matrices only (one group), the other stages' ranks two
DECAYED = {"dense": [c for c in DENSE if not c.zero3_by_blocks]
           + [ParallelConfig(pp=4, embedding_stage=True, microbatches=4)],
           "experts": [c for c in EXPERTS if not c.zero3_by_blocks]}
WD, CLIP = 0.1, 1.0
# lr 1e-4, 1e-3, 1e-3, 7.5e-4 at steps 1-4: a schedule not restored would run step 3 at 1e-4
SCHEDULE = SchedulerConfig("WarmupDecayLR", SchedulerParams(
    warmup_min_lr=1e-4, warmup_max_lr=1e-3, warmup_num_steps=2, total_num_steps=6))


def _factory(family):
    from reference.expert_parallel import moe_factory

    return moe_factory(4, k=2, capacity_factor=2.0) if family == "experts" else None


def _build(config, family):
    from reference.parallel import parallelize

    torch.manual_seed(0)
    pm = parallelize(GPT(CFG, _factory(family)), config.mesh().build_groups(), config, batch=(B, T))
    return pm, pm.make_optimizer(torch.optim.AdamW, lr=1e-3, eps=1e-6)


def _build_decayed(config, family):
    """The model, the optimizer and the schedule as the trainer builds them (`run_rank`)."""
    from reference.parallel import parallelize
    from reference.train.lr_schedules import make_scheduler

    torch.manual_seed(0)
    pm = parallelize(GPT(CFG, _factory(family)), config.mesh().build_groups(), config, batch=(B, T))
    opt = pm.make_optimizer(torch.optim.AdamW, weight_decay=WD, lr=1e-3, eps=1e-6)
    return pm, opt, make_scheduler(opt, SCHEDULE)


def _data(steps):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, CFG.vocab_size, (steps, B, T + 1), generator=g)


def _continue(pm, opt, sched, data):
    """(losses, learning rates) of the trainer's steps on ``data``: clipped, then the schedule."""
    from reference.parallel import train_step

    losses, lrs = [], []
    for d in data:
        lrs.append(opt.param_groups[0]["lr"])
        losses.append(float(train_step(pm, opt, d[:, :-1], d[:, 1:], max_norm=CLIP).loss))
        sched.step()
    return losses, lrs


def _save(jobs, decayed=()):
    """Each (family, index, config, folder): train two steps, save step 2 into the folder.
    Each of ``decayed`` the same with weight decay and a schedule, then two steps more:
    returns their (losses, lrs), the uninterrupted run's."""
    from reference.parallel import train_step
    from reference.train.checkpoint import save_checkpoint

    data = _data(4)
    for family, _, config, folder in jobs:
        pm, opt = _build(config, family)
        for d in data[:2]:
            train_step(pm, opt, d[:, :-1], d[:, 1:])
        save_checkpoint(folder, 2, pm, opt)
    out = []
    for family, _, config, folder in decayed:
        pm, opt, sched = _build_decayed(config, family)
        _continue(pm, opt, sched, data[:2])
        save_checkpoint(folder, 2, pm, opt, scheduler=sched)
        out.append(_continue(pm, opt, sched, data[2:]))
    return out


def _load_and_save(jobs, decayed=()):
    """Each (family, config, source folder, target folder): load, save again untouched.
    Each of ``decayed`` the same with the schedule, then train steps 3 and 4; returns their
    (losses, lrs). An error names the pair (the launch stops every rank
    at the first one: a rank that went on alone would hang its peers)."""
    from reference.train.checkpoint import load_checkpoint, save_checkpoint

    for family, config, source, target in jobs:
        pm, opt = _build(config, family)
        load_checkpoint(source, pm, opt)
        save_checkpoint(target, 2, pm, opt)
    out = []
    for family, config, source, target in decayed:
        pm, opt, sched = _build_decayed(config, family)
        try:
            load_checkpoint(source, pm, opt, scheduler=sched)
            save_checkpoint(target, 2, pm, opt, scheduler=sched)
            out.append(_continue(pm, opt, sched, _data(4)[2:]))
        except Exception as err:
            raise RuntimeError(f"{source.name} loaded into {config}: {type(err).__name__}: {err}") from err
    return out


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


def _loaded_with_weight_decay(family, i, j) -> bool:
    """Whether the plain pair (i, j) is loaded in the weight-decay matrix instead (whose load
    saves again untouched for the byte-for-byte comparison): both layouts take weight decay."""
    configs = FAMILIES[family]
    return not (configs[i].zero3_by_blocks or configs[j].zero3_by_blocks)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Both matrices, in one launch per world size for the saves and one for the loads:
    (saved, resaved) of the byte-for-byte one, and of the weight-decay one {(family, i):
    the uninterrupted (losses, lrs)} and {(family, i, j): layout j's after loading i's}."""
    root = tmp_path_factory.mktemp("matrix")
    layouts = [(f, i, c) for f, cs in FAMILIES.items() for i, c in enumerate(cs)]
    decayed = [(f, i, c) for f, cs in DECAYED.items() for i, c in enumerate(cs)]
    saved = {(f, i): root / f"{f}{i}" for f, i, _ in layouts}
    saved_wd = {(f, i): root / f"wd_{f}{i}" for f, i, _ in decayed}
    saved.update({("wd_" + f, i): folder for (f, i), folder in saved_wd.items()})
    resaved, want, got = {}, {}, {}
    worlds = sorted({c.world_size for _, _, c in layouts + decayed})
    for world in worlds:
        jobs = [(f, i, c, saved[f, i]) for f, i, c in layouts if c.world_size == world]
        mine = [(f, i) for f, i, c in decayed if c.world_size == world]
        wd_jobs = [(f, i, DECAYED[f][i], saved_wd[f, i]) for f, i in mine]
        out = launch(_save, world, jobs, wd_jobs, timeout=300)[0]
        want.update(zip(mine, out))
    for world in worlds:
        jobs = []
        for f, j, c in layouts:
            if c.world_size != world:
                continue
            for i in range(len(FAMILIES[f])):
                if _loaded_with_weight_decay(f, i, j):
                    continue
                resaved[f, i, j] = root / f"{f}{i}_into_{j}"
                jobs.append((f, c, saved[f, i], resaved[f, i, j]))
        pairs = [(f, i, j) for f, j, c in decayed if c.world_size == world
                 for i in range(len(DECAYED[f]))]
        wd_jobs = []
        for f, i, j in pairs:
            resaved["wd_" + f, i, j] = root / f"wd_{f}{i}_into_{j}"
            wd_jobs.append((f, DECAYED[f][j], saved_wd[f, i], resaved["wd_" + f, i, j]))
        out = launch(_load_and_save, world, jobs, wd_jobs, timeout=300)[0]
        got.update(zip(pairs, out))
    return saved, resaved, want, got


@pytest.mark.parametrize("family", list(FAMILIES) + ["wd_" + f for f in DECAYED])
def test_every_layout_loads_every_other_byte_for_byte(folders, family):
    """Saved from layout i, loaded into j, saved again: every stored tensor equal. The plain
    checkpoints between FSDP by blocks and any layout, the weight-decay ones ("wd_") between
    all the others (the same pairs, their groups and schedule stored too)."""
    saved, resaved, _, _ = folders
    configs = DECAYED[family[3:]] if family.startswith("wd_") else FAMILIES[family]
    pairs = [(i, j) for i in range(len(configs)) for j in range(len(configs)) if (family, i, j) in resaved]
    if family in FAMILIES:  # the pairs not loaded here are loaded in the weight-decay matrix
        others = [(i, j) for i in range(len(configs)) for j in range(len(configs)) if (i, j) not in pairs]
        assert all(configs[i] in DECAYED[family] and configs[j] in DECAYED[family] for i, j in others)
    else:
        assert len(pairs) == len(configs) ** 2
    originals = {i: dict(_flat(_read(saved[family, i]))) for i in range(len(configs))}
    first = originals[0]
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in first), sorted(first)[:8]
    for i, want in originals.items():
        assert set(want) == set(first), f"{configs[i]} saved other keys than {configs[0]}"
    bad = []
    for i, j in pairs:
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


@pytest.mark.parametrize("family", list(DECAYED))
def test_weight_decay_and_schedule_continue_in_every_layout(folders, family):
    """A checkpoint with the trainer's weight-decay groups and schedule, loaded into every
    layout (two groups, ZeRO-1's one, an embedding stage's one beside two), continues as the
    run that never stopped: the same learning rates, bit for bit, and losses within
    `tolerance.loss()` (the same sums added in another order)."""
    _, _, want, got = folders
    configs, tol = DECAYED[family], loss_tolerance()
    bad = []
    for i, j in ((i, j) for i in range(len(configs)) for j in range(len(configs))):
        result, (losses, lrs) = got[family, i, j], want[family, i]
        pair = f"{configs[i]} -> {configs[j]}"
        if result[1] != lrs:
            bad.append(f"{pair}: learning rates {result[1]}, the uninterrupted run's {lrs}")
        try:
            tol.assert_losses(result[0], losses, pair)
        except AssertionError as err:
            bad.append(str(err))
    assert not bad, f"{len(bad)} of {len(configs) ** 2} pairs:\n" + "\n".join(bad)
