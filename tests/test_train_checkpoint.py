"""Checkpoints of the 3D GPT (`reference.train.checkpoint`): exact resume, resharding,
atomic publish under kill -9, and clear errors.

Every run trains the tiny GPT (4 blocks, T = 16) on the same global batches (8, 16) with
AdamW and a LambdaLR schedule, from the weights of seed 0, as `tests/test_parallel_parity.py`.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.parallel import ParallelConfig
from reference.runtime import launch

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTConfig.tiny(n_layer=4, block_size=16)
B, T = 8, 16
LR, EPS = 1e-3, 1e-6


def batches(k: int = 5, vocab: int = CFG.vocab_size):
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, vocab, (k, B, T + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def decay(step: int) -> float:
    """LambdaLR's factor: lr = base / (1 + step). Its closed form reads `last_epoch`, so a
    scheduler not restored would set lr = base / (1 + 1) after the first resumed step."""
    return 1.0 / (1 + step)


def build(config, cfg=CFG, ffn_factory=None):
    from reference.parallel import parallelize

    torch.manual_seed(0)  # the same plain GPT on every rank
    pm = parallelize(GPT(cfg, ffn_factory), config.mesh().build_groups(), config, batch=(B, T))
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    return pm, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, decay)


def train(pm, optimizer, scheduler, steps):
    from reference.parallel import train_step

    losses = []
    for idx, tgt in steps:
        losses.append(float(train_step(pm, optimizer, idx, tgt).loss))
        scheduler.step()
    return losses


class Scale:
    """Stands for a loss scaler: anything with state_dict / load_state_dict is saved."""

    def __init__(self, scale: float):
        self.scale = scale

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state):
        self.scale = state["scale"]


def rng_now():
    """Every default stream's state, without drawing from any."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def weights(pm):
    """This rank's parameters (its shards under ZeRO-3), copied."""
    return [p.detach().clone() for p in pm.parameters()]


# ---------------------------------------------------------------------- 1. exact resume
# 255 tokens on tp 2: the vocabulary padded to 256 rows, the last one padding; untied head
ODD = GPTConfig.tiny(n_layer=4, block_size=16, vocab_size=255, tie_weights=False)
RESUME = [
    (ParallelConfig(dp=2, tp=2), CFG),
    (ParallelConfig(dp=2, tp=2, zero_stage=1), CFG),
    (ParallelConfig(dp=2, tp=2, zero_stage=2), CFG),
    (ParallelConfig(tp=2, pp=2, sequence_parallel=True, microbatches=2), CFG),
    (ParallelConfig(dp=2, pp=2, zero_stage=1, microbatches=2), CFG),
    (ParallelConfig(dp=4, zero_stage=3), CFG),
    (ParallelConfig(tp=2, pp=2, microbatches=2), ODD),
    # ZeRO-3 per parameter: dim-0 rows of TP slices (ODD: 255-row vocabulary, rows padded)
    (ParallelConfig(dp=2, tp=2, zero_stage=3, sequence_parallel=True), ODD),
    (ParallelConfig(dp=2, pp=2, zero_stage=3, microbatches=2), CFG),
]


def _uninterrupted(configs, root):
    from reference.train.checkpoint import save_checkpoint

    rank = torch.distributed.get_rank()
    out = []
    for i, (config, cfg) in enumerate(configs):
        pm, opt, sched = build(config, cfg)
        torch.randn(rank + 1)  # each rank's streams somewhere of its own
        np.random.rand(rank + 1)
        for _ in range(rank + 1):
            random.random()
        data = batches(vocab=cfg.vocab_size)
        losses = train(pm, opt, sched, data[:3])
        save_checkpoint(root / str(i), 3, pm, opt, scheduler=sched, scaler=Scale(2.0 ** 12),
                        extra={"next_batch": 3})
        rng = rng_now()  # the save drew nothing: these are the saved states
        losses += train(pm, opt, sched, data[3:])
        out.append((losses, rng, weights(pm)))
    return out


def _resumed(configs, root):
    from reference.train.checkpoint import load_checkpoint

    out = []
    for i, (config, cfg) in enumerate(configs):
        pm, opt, sched = build(config, cfg)
        scaler = Scale(1.0)
        info = load_checkpoint(root / str(i) / "step_000003", pm, opt, scheduler=sched, scaler=scaler)
        assert scaler.scale == 2.0 ** 12
        rng, lr = rng_now(), opt.param_groups[0]["lr"]
        losses = train(pm, opt, sched, batches(vocab=cfg.vocab_size)[info["extra"]["next_batch"]:])
        out.append((info, sched.last_epoch - 2, lr, losses, rng, weights(pm)))
    return out


def test_resume_continues_bit_for_bit(tmp_path):
    """Fresh processes that load step 3 train steps 4 and 5 exactly as the run that never
    stopped: losses, weights and every rank's RNG streams equal to the bit, for ZeRO 0-3,
    tensor, pipeline and sequence parallelism, a padded vocabulary and an untied head, with
    the LR schedule restored."""
    before = launch(_uninterrupted, 4, RESUME, tmp_path, timeout=240)
    after = launch(_resumed, 4, RESUME, tmp_path, timeout=240)
    for i, (config, _) in enumerate(RESUME):
        for rank in range(4):
            losses, rng, params = before[rank][i]
            info, epoch, lr, resumed, rng_after, params_after = after[rank][i]
            assert info == {"step": 3, "extra": {"next_batch": 3}}, config
            assert epoch == 3 and lr == LR * decay(3), f"{config}: schedule at {epoch}, lr {lr}"
            assert resumed == losses[3:], f"{config} rank {rank}: {resumed} != {losses[3:]}"
            assert all(map(torch.equal, params_after, params)), f"{config} rank {rank}: weights differ"
            assert torch.equal(rng_after[0], rng[0]), f"{config} rank {rank}: torch RNG"
            assert rng_after[1] == rng[1], f"{config} rank {rank}: random's state"
            assert np.array_equal(rng_after[2], rng[2]), f"{config} rank {rank}: numpy's state"


# ---------------------------------------------------------------------- 2. resharding
SOURCE = ParallelConfig(dp=2, tp=2, pp=2, sequence_parallel=True, microbatches=2, zero_stage=1)


def _save_3d(root):
    from reference.train.checkpoint import save_checkpoint

    pm, opt, sched = build(SOURCE)
    data = batches()
    train(pm, opt, sched, data[:3])
    save_checkpoint(root, 3, pm, opt, scheduler=sched)
    return train(pm, opt, sched, data[3:])  # the uninterrupted run's 4th and 5th losses


def _load_elsewhere(configs, root):
    from reference.train.checkpoint import load_checkpoint

    out = []
    for config in configs:
        pm, opt, sched = build(config)
        rng = torch.get_rng_state()
        assert load_checkpoint(root, pm, opt, scheduler=sched)["step"] == 3
        kept = torch.equal(torch.get_rng_state(), rng)  # another layout: the RNG is not restored
        out.append((train(pm, opt, sched, batches()[3:]), kept))
    return out


def test_reshard_into_other_layouts(tmp_path):
    """A (dp 2, tp 2, pp 2) ZeRO-1 checkpoint loads into one process, into tp 2, into FSDP
    over dp 2, into (dp 2, pp 2) ZeRO-1 and into ZeRO-3 x TP (dp 2, tp 2); the next two losses are the 8-rank run's (the
    4th reads the weights, the 5th the AdamW moments and the schedule as well).

    Tolerance rtol 1e-5: the weights and AdamW moments are restored exactly; the step's
    reductions (the micro-batch and dp means, tp's partial sums) add the same numbers in
    another order, ~1e-7 relative each, and `tests/test_parallel_parity.py` measures at most
    5e-7 between these layouts over 5 steps (here 0 to 1e-7)."""
    want = launch(_save_3d, 8, tmp_path, timeout=240)[0]
    targets = {1: [ParallelConfig()],
               2: [ParallelConfig(tp=2), ParallelConfig(dp=2, zero_stage=3)],
               4: [ParallelConfig(dp=2, pp=2, zero_stage=1, microbatches=2),
                   ParallelConfig(dp=2, tp=2, zero_stage=3)]}
    for world, configs in targets.items():
        ranks = launch(_load_elsewhere, world, configs, tmp_path, timeout=240)
        for i, config in enumerate(configs):
            for got, kept in (r[i] for r in ranks):
                assert kept, f"{config}: loading into another layout changed the RNG state"
                assert got == pytest.approx(want, rel=1e-5, abs=0), f"{config}: {got} vs {want}"


def _experts():
    from reference.expert_parallel import moe_factory

    # capacity per sequence: every micro-batch holds whole sequences, so routing and the
    # balance loss per chunk are the same on one process and on the ranks
    return moe_factory(4, k=2, capacity_factor=2.0)


def _experts_run(config, root, save):
    from reference.train.checkpoint import load_checkpoint, save_checkpoint

    pm, opt, sched = build(config, ffn_factory=_experts())
    data = batches()
    if save:
        train(pm, opt, sched, data[:3])
        save_checkpoint(root, 3, pm, opt, scheduler=sched)
    else:
        load_checkpoint(root, pm, opt, scheduler=sched)
    return train(pm, opt, sched, data[3:])


def test_experts_reshard_by_global_id(tmp_path):
    """Experts saved from dp 2 x ep 2 (experts 0-1 on ep rank 0, 2-3 on ep rank 1) load by
    global id into one process holding all four; the next two losses match (rtol 1e-5 as
    above: the same numbers reduced in another order). One process runs the 2 micro-batches
    the 2 dp ranks ran, so that the balance loss is taken over the same chunks."""
    want = launch(_experts_run, 2, ParallelConfig(dp=2, ep=2), tmp_path, True, timeout=120)[0]
    got = launch(_experts_run, 1, ParallelConfig(microbatches=2), tmp_path, False, timeout=120)[0]
    assert got == pytest.approx(want, rel=1e-5, abs=0), f"{got} vs {want}"


# ---------------------------------------------------------------------- 3. kill -9 while saving
KILLED_SAVE = r"""
import sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
root = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=0, world_size=1)
from reference.model import GPT, GPTConfig
from reference.parallel import ParallelConfig, parallelize, train_step
from reference.parallel.gather import full_state_dict
from reference.train.checkpoint import save_checkpoint
torch.manual_seed(0)
config = ParallelConfig()
pm = parallelize(GPT(GPTConfig.tiny(n_layer=4, block_size=16)), config.mesh().build_groups(), config)
opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
idx = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
train_step(pm, opt, idx[:, :-1], idx[:, 1:])
save_checkpoint(root / "ckpt", 1, pm, opt)
torch.save(full_state_dict(pm), root / "weights_1.pt")
train_step(pm, opt, idx[:, :-1], idx[:, 1:])
write_data = FileSystemWriter.write_data
def slow_write(self, plan, planner):  # the data files are written, then the rank is stuck
    done = write_data(self, plan, planner)
    (root / "writing").touch()
    time.sleep(120)
    return done
FileSystemWriter.write_data = slow_write
save_checkpoint(root / "ckpt", 2, pm, opt)
"""


def _load_after_kill(directory):
    from reference.parallel.gather import full_state_dict
    from reference.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    pm, opt, _ = build(ParallelConfig())
    info = load_checkpoint(latest_checkpoint(directory), pm, opt)
    weights = full_state_dict(pm)
    again = save_checkpoint(directory, 2, pm, opt)  # the killed save's partial folder is cleared
    return info["step"], weights, again.name, latest_checkpoint(directory).name


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    """A process SIGKILLed after writing step 2's data, before the publish: step 2 exists only
    as a partial folder, latest_checkpoint is step 1, and step 1 loads the weights saved."""
    from reference.train.checkpoint import latest_checkpoint

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "writing").exists():
            assert proc.poll() is None, f"the saving process exited early ({proc.returncode})"
            assert time.monotonic() < deadline, "the save never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # kill -9
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    directory = tmp_path / "ckpt"
    partial = directory / ".step_000002.partial"
    assert any(partial.glob("*.distcp")), "the kill should have come while step 2 was on disk"
    assert latest_checkpoint(directory) == directory / "step_000001"
    step, weights, again, latest = launch(_load_after_kill, 1, directory, timeout=120)[0]
    assert step == 1
    saved = torch.load(tmp_path / "weights_1.pt")
    for name, value in saved.items():
        assert torch.equal(weights[name], value), name
    assert (again, latest) == ("step_000002", "step_000002") and not partial.exists()


# ---------------------------------------------------------------------- 4. clear errors
def test_no_checkpoint_is_a_clear_error(tmp_path):
    from reference.train.checkpoint import latest_checkpoint, load_checkpoint

    (tmp_path / "empty" / ".step_000004.partial").mkdir(parents=True)  # only a killed save
    for folder in (tmp_path / "absent", tmp_path / "empty"):
        assert latest_checkpoint(folder) is None
        with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint in {folder}")):
            load_checkpoint(folder, None, None)  # refused before the model is touched


def _errors(root):
    from reference.train.checkpoint import CorruptCheckpointError, load_checkpoint, save_checkpoint

    config = ParallelConfig()
    messages = {}
    pm, opt, _ = build(config)  # n_embd 32
    for step in (1, 2, 3):
        save_checkpoint(root, step, pm, opt)
    narrow, narrow_opt, _ = build(config, GPTConfig.tiny(n_layer=4, block_size=16, n_embd=16))
    with pytest.raises(ValueError) as err:
        load_checkpoint(root, narrow, narrow_opt)
    messages["shape"] = str(err.value)
    with pytest.raises(ValueError) as err:
        load_checkpoint(root, pm, opt, scaler=Scale(1.0))
    messages["scaler"] = str(err.value)

    def corrupt(key, path):
        with pytest.raises(CorruptCheckpointError) as err:
            load_checkpoint(path, pm, opt)
        messages[key] = str(err.value)

    data = root / "step_000003" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])     # cut short
    corrupt("cut", root / "step_000003")
    (root / "step_000002" / "__0_0.distcp").unlink()                      # deleted
    corrupt("deleted", root / "step_000002")
    corrupt("latest", root)                                               # step 3, cut short
    data = root / "step_000001" / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))                          # overwritten, same size
    corrupt("overwritten", root / "step_000001")
    return messages


def test_shape_mismatch_and_corruption_are_named(tmp_path):
    """Loading into a narrower model names the tensor and both shapes; asking for a scaler a
    checkpoint does not hold says so; a checkpoint with a
    data file cut short, deleted or overwritten is called corrupt, with the most recent
    earlier checkpoint that still loads (or none)."""
    m = launch(_errors, 1, tmp_path, timeout=120)[0]
    assert "h.0.attn.c_attn.weight: (96, 32) in the checkpoint, (48, 16) in this model" in m["shape"]
    assert "wte.weight: (256, 32) in the checkpoint, (256, 16) in this model" in m["shape"]
    assert f"a scaler was given, but checkpoint {tmp_path / 'step_000003'} was saved without" in m["scaler"]
    assert f"checkpoint {tmp_path / 'step_000003'} is corrupt" in m["cut"]
    assert "__0_0.distcp holds" in m["cut"]
    assert f"earlier checkpoint that loads is {tmp_path / 'step_000002'}" in m["cut"]
    assert "its data file __0_0.distcp is missing" in m["deleted"]
    assert f"earlier checkpoint that loads is {tmp_path / 'step_000001'}" in m["deleted"]
    assert f"checkpoint {tmp_path / 'step_000003'} is corrupt" in m["latest"]  # step 2 skipped:
    assert f"earlier checkpoint that loads is {tmp_path / 'step_000001'}" in m["latest"]
    assert "reading it failed" in m["overwritten"]
    assert f"there is no earlier checkpoint in {tmp_path} that loads" in m["overwritten"]


# ---------------------------------------------------------------------- 5. param groups
def _two_learning_rates(root, save):
    """dp 2: a plain optimizer whose two weight-decay groups run at different learning rates
    saves; ZeRO-1 (one inner group for its whole shard) loads. Returns the error message."""
    from reference.train.checkpoint import load_checkpoint, save_checkpoint

    config = ParallelConfig(dp=2, zero_stage=0 if save else 1)
    torch.manual_seed(0)
    pm = parallelize_tiny(config)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.1)
    if save:
        opt.param_groups[1]["lr"] = LR / 2  # the biases and gains at half the rate
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    if save:
        save_checkpoint(root, 1, pm, opt, scheduler=sched)
        return None
    try:
        load_checkpoint(root, pm, opt, scheduler=sched)
    except ValueError as err:
        return str(err)
    return None


def parallelize_tiny(config):
    from reference.parallel import parallelize

    return parallelize(GPT(CFG), config.mesh().build_groups(), config, batch=(B, T))


def test_groups_one_zero_shard_cannot_take_are_refused_on_every_rank(tmp_path):
    """The optimizer's hyper-parameters are stored by parameter: a checkpoint whose groups
    differ in more than weight decay (two learning rates) cannot go into ZeRO-1's one inner
    group. Both ranks refuse it with the same message, naming the parameters and the keys
    that differ, before any tensor is read (no rank left waiting in a collective)."""
    launch(_two_learning_rates, 2, tmp_path, True, timeout=120)
    messages = launch(_two_learning_rates, 2, tmp_path, False, timeout=120)
    assert messages[0] == messages[1] and messages[0] is not None, messages
    assert "rank 0: param group 0 of this optimizer updates" in messages[0], messages[0]
    assert "hyper.lr" in messages[0] and "hyper.initial_lr" in messages[0], messages[0]
    assert "scheduler.base_lrs" in messages[0], messages[0]


def test_the_earlier_list_of_groups_loads_by_position_or_shared():
    """Checkpoints saved before the groups were stored by parameter hold the saving
    optimizer's groups as a list and the scheduler's state whole: they load by position into
    as many groups, and into another number when the groups differ in weight_decay only."""
    from reference.train.checkpoint_groups import resolve_groups

    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    two = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1},
                             {"params": [b], "weight_decay": 0.0}], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(two, decay)
    for _ in range(3):
        two.step()
        sched.step()
    saved = [{k: v for k, v in g.items() if k != "params"} for g in two.param_groups]
    one = torch.optim.AdamW([w, b], lr=LR, weight_decay=0.0)
    one_sched = torch.optim.lr_scheduler.LambdaLR(one, decay)
    hyper, state = resolve_groups(None, one, saved, sched.state_dict())
    assert len(hyper) == 1 and hyper[0]["lr"] == LR * decay(3) and hyper[0]["weight_decay"] == 0.0
    one_sched.load_state_dict(state)
    one.param_groups[0].update(hyper[0])
    one_sched.step()  # one entry per group: no zip() error
    assert one_sched.last_epoch == 4 and one.param_groups[0]["lr"] == LR * decay(4)
    hyper, state = resolve_groups(None, two, saved, sched.state_dict())
    assert [h["weight_decay"] for h in hyper] == [0.1, 0.0] and state["base_lrs"] == [LR, LR]
    saved[1]["lr"] = LR / 2
    with pytest.raises(ValueError, match="differ in more than weight_decay"):
        resolve_groups(None, one, saved, sched.state_dict())
