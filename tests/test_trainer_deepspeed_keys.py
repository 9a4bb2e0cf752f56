"""The trainer's DeepSpeed keys mean what DeepSpeed's mean: fp16 hysteresis, the schedule on
skipped steps, the defaults, resuming from the JSON, the log, and a corrupt checkpoint."""
from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference.parallel.scaler import DynamicLossScaler

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------- fp16 hysteresis
def deepspeed_scales(pattern: str, hysteresis: int, consecutive: bool, window: int = 1000,
                     power: int = 16) -> list:
    """DeepSpeed's DynamicLossScaler.update_scale, written out from its documented rule
    (delayed_shift = hysteresis): the scale after each step of ``pattern`` (O overflow, G good)."""
    scale, cur_h, it, last = 2.0 ** power, hysteresis, 0, -1
    out = []
    for c in pattern:
        if c == "O":
            if hysteresis == 1 or cur_h == 1:
                scale = max(scale / 2, 1.0)
            else:
                cur_h -= 1
            last = it
        else:
            if consecutive:
                cur_h = hysteresis
            if (it - last) % window == 0:
                if not consecutive:
                    cur_h = hysteresis
                scale *= 2
        it += 1
        out.append(scale)
    return out


def ours(pattern: str, hysteresis: int, consecutive: bool, window: int = 1000) -> list:
    s = DynamicLossScaler(initial_scale_power=16, window=window, hysteresis=hysteresis,
                          consecutive_hysteresis=consecutive)
    out = []
    for c in pattern:
        s.update(c == "O")
        out.append(s.scale)
    return out


S = 2.0 ** 16


def test_hysteresis_follows_deepspeed_on_named_sequences():
    """Overflows on alternate steps halve the scale from the second overflow on (hysteresis
    2, DeepSpeed's default consecutive_hysteresis false); the old rule reset the count on
    every good step, so the scale never dropped. With consecutive_hysteresis true it does not."""
    assert ours("OGOGOG", 2, False) == [S, S, S / 2, S / 2, S / 4, S / 4]
    assert ours("OGOGOG", 2, True) == [S] * 6
    assert ours("OOOO", 2, False) == [S, S / 2, S / 4, S / 8]     # once spent, every overflow halves
    assert ours("OOOO", 3, True) == [S, S, S / 2, S / 4]
    assert ours("OGGO", 2, False, window=2) == [S, S, 2 * S, 2 * S]  # growth refilled the budget


def test_hysteresis_equals_deepspeed_on_every_short_sequence_and_random_long_ones():
    rng = random.Random(0)
    patterns = ["".join(p) for n in range(1, 9) for p in itertools.product("OG", repeat=n)]
    patterns += ["".join(rng.choice("OGGG") for _ in range(300)) for _ in range(20)]
    for pattern, h, consecutive, window in itertools.product(patterns[:600] + patterns[-20:],
                                                             (1, 2, 3), (False, True), (1, 3, 1000)):
        assert ours(pattern, h, consecutive, window) == deepspeed_scales(pattern, h, consecutive, window), \
            (pattern, h, consecutive, window)


def test_scaler_state_round_trips():
    a = DynamicLossScaler(hysteresis=3)
    for c in "OGO":
        a.update(c == "O")
    b = DynamicLossScaler(hysteresis=3)
    b.load_state_dict(a.state_dict())
    for c in "OOGO":
        a.update(c == "O")
        b.update(c == "O")
        assert a.scale == b.scale


# ---------------------------------------------------------------- the trainer
BASE = {
    "train_batch_size": 4, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "seq_len": 16, "seed": 0},
    "steps": 6, "seed": 0, "log": {"every": 1},
}


def _write(tmp_path, name="run.json", **changes) -> Path:
    raw = json.loads(json.dumps(BASE))
    raw.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def _run(config_path, world_size=1, resume=False):
    from reference.runtime import launch
    from reference.train.config import load_config
    from reference.train.loop import run_rank
    from reference.train.settings import settings

    plan = settings(load_config(config_path), world_size)
    return launch(run_rank, world_size, plan, world_size, resume, timeout=300)[0]


def test_schedule_does_not_advance_on_skipped_fp16_steps(tmp_path):
    """DeepSpeed does not step the scheduler on an overflow: a warm-up is not used up by
    skipped steps. The loss scale starts at 2^22, so the first steps overflow and are skipped;
    the lr logged at the first applied step is the schedule's value at step 0."""
    path = _write(tmp_path, fp16={"enabled": True, "initial_scale_power": 22, "hysteresis": 1}, steps=10,
                  scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                             "warmup_num_steps": 4,
                                                             "warmup_type": "linear"}})
    records = _run(path)["records"]
    skipped = [r["skipped"] for r in records]
    assert skipped[0] and not skipped[-1], skipped
    applied = [r["lr"] for r in records if not r["skipped"]]
    assert applied[:3] == pytest.approx([0.0, 2.5e-4, 5e-4])  # s / W with W = 4, from s = 0
    assert all(r["lr"] == 0.0 for r in records if r["skipped"])


def test_warmup_max_lr_and_weight_decay_default_to_deepspeeds(tmp_path):
    from reference.train.config import load_config
    from reference.train.lr_schedules import make_scheduler

    path = _write(tmp_path, optimizer={"type": "AdamW", "params": {"lr": 5e-4}},
                  scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
    config = load_config(path)
    assert config.optimizer.kwargs()["weight_decay"] == 0.0          # not torch's 0.01
    opt = config.optimizer.torch_class()([torch.nn.Parameter(torch.zeros(1))], **config.optimizer.kwargs())
    sched = make_scheduler(opt, config)
    for _ in range(3):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)           # DeepSpeed's 0.001, not 5e-4
    from reference.train.config import describe

    assert "warmup_max_lr unset: DeepSpeed's default 0.001 is the peak lr" in describe(config, 1)


def test_resume_from_the_json_and_the_log_keeps_each_step_once(tmp_path):
    """checkpoint.resume: true in the JSON resumes (it was ignored: only --resume did); a
    rerun keeps the earlier log (it was deleted); after a resume the killed run's lines past
    the checkpoint are not in the log twice."""
    log = tmp_path / "run.jsonl"
    ckpt = tmp_path / "ckpt"
    full = _write(tmp_path, "full.json", checkpoint={"dir": str(ckpt), "every": 3},
                  log={"path": str(log), "every": 1})
    whole = _run(full)["records"]
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    # the run "was killed" after step 5: its checkpoint of step 6 never happened
    import shutil

    shutil.rmtree(ckpt / "step_000006")
    lines = log.read_text().splitlines()[:5]
    log.write_text("\n".join(lines) + "\n")
    again = _write(tmp_path, "again.json", checkpoint={"dir": str(ckpt), "every": 3, "resume": True},
                   log={"path": str(log), "every": 1})
    result = _run(again)
    assert result["start"] == 3
    steps = [json.loads(x)["step"] for x in log.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in result["records"]] == [r["loss"] for r in whole[3:]]
    # a fresh run (no resume) keeps the earlier log beside the new one
    from reference.train.loop import prepare_log

    before = log.read_text()
    moved = prepare_log(log)
    assert moved == tmp_path / "run.jsonl.1" and moved.read_text() == before and log.read_text() == ""


def test_corrupt_latest_checkpoint_is_one_line_and_exit_2(tmp_path):
    """--resume onto a corrupt checkpoint exited 1 with every rank's error; now it is the one
    line and exit status 2 of the other bad inputs, naming the earlier checkpoint that loads."""
    ckpt = tmp_path / "ckpt"
    path = _write(tmp_path, "c.json", checkpoint={"dir": str(ckpt), "every": 2}, steps=4)
    _run(path)
    data = sorted((ckpt / "step_000004").glob("*.distcp"))
    data[0].write_bytes(data[0].read_bytes()[:10])  # cut short
    run = subprocess.run([sys.executable, "-m", "reference.train", "--config", str(path),
                          "--world-size", "2", "--resume"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint "), run.stderr
    assert "is corrupt" in lines[0] and "step_000002" in lines[0]


def test_weight_decay_with_zero3_is_refused_before_any_rank_starts(tmp_path):
    """Weight decay exempts biases and LayerNorms in every trainer and every ZeRO stage but 3,
    whose flat shards hold one group: refused in the configuration (and said by --check),
    not on every rank once the optimizer is made."""
    from reference.train.config import describe, load_config

    path = _write(tmp_path, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
                  zero_optimization={"stage": 3})
    config = load_config(path)
    with pytest.raises(ValueError, match="weight_decay=0.1 with zero_optimization.stage 3 at dp=2"):
        config.parallel_config(2)
    assert "weight_decay=0.1 with zero_optimization.stage 3" in describe(config, 2)
    config.parallel_config(1)  # dp 1: nothing is sharded, the groups work


def test_zero_with_experts_check_says_what_runs_and_where_deepspeed_differs(tmp_path):
    """Expert parallelism 2 inside dp 4: ZeRO-3 shards each expert over its expert-data-parallel
    group and runs (weight decay included: the per-parameter shards keep their groups);
    ZeRO-1/2 are refused, and --check says DeepSpeed partitions experts in groups of their own."""
    from reference.train.config import describe, load_config

    moe = json.loads((ROOT / "configs" / "moe_4d.json").read_text())
    changes = dict(parallelism={"expert": 2}, model=moe["model"],
                   optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}})
    config = load_config(_write(tmp_path, "z3.json", zero_optimization={"stage": 3}, **changes))
    pc = config.parallel_config(4)
    assert (pc.dp, pc.ep, pc.zero_stage, pc.zero3_by_blocks) == (4, 2, 3, False)
    assert "DeepSpeed partitions expert" not in describe(config, 4)
    for stage in (1, 2):
        config = load_config(_write(tmp_path, f"z{stage}.json", zero_optimization={"stage": stage},
                                    **changes))
        with pytest.raises(ValueError, match=f"zero_stage={stage} with ep=2"):
            config.parallel_config(4)
        said = describe(config, 4)
        assert f"ZeRO-{stage} with expert parallelism: DeepSpeed partitions expert parameters" in said


def test_reshard_after_forward_reaches_the_run_and_check_says_what_it_trades(tmp_path):
    """parallelism.reshard_after_forward: false unless set (PyTorch's fully_shard defaults to
    None, true but for the root, and --check says so when it is on); accepted with composed ZeRO-3, refused otherwise
    with ParallelConfig's reason."""
    from reference.train.config import describe, load_config

    M2 = dict(gradient_accumulation_steps=2)  # 2 micro-batches: 1F1B over pipeline 2
    config = load_config(_write(tmp_path, "off.json", zero_optimization={"stage": 3},
                                parallelism={"pipeline": 2}, **M2))
    assert config.parallel_config(4).reshard_after_forward is False
    assert "reshard_after_forward: each block" not in describe(config, 4)
    config = load_config(_write(tmp_path, "on.json", zero_optimization={"stage": 3},
                                parallelism={"pipeline": 2, "reshard_after_forward": True}, **M2))
    pc = config.parallel_config(4)
    assert (pc.dp, pc.pp, pc.zero_stage, pc.reshard_after_forward) == (2, 2, 3, True)
    said = describe(config, 4)
    assert "reshard_after_forward: each block gathered for its forward" in said
    assert "PyTorch's fully_shard's None: true for every module but the root" in said
    config = load_config(_write(tmp_path, "z1.json", zero_optimization={"stage": 1},
                                parallelism={"pipeline": 2, "reshard_after_forward": True}, **M2))
    with pytest.raises(ValueError, match="reshard_after_forward"):
        config.parallel_config(4)
