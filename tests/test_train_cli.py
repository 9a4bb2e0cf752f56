"""python -m reference.train: standalone, under torchrun as two "nodes", --check, plot, parity,
and bad input as one clear line."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)

SMALL = {
    "_about": "4 ranks: dp 2 x tp 2, the debug model, a few steps",
    "train_batch_size": 8, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "gradient_clipping": 1.0,
    "parallelism": {"tensor": 2, "sequence_parallel": True},
    "model": {"preset": "debug"},
    "data": {"source": "arithmetic", "seq_len": 32, "seed": 0},
    "steps": 4, "seed": 0,
    "log": {"every": 1, "sample_tokens": 8},
}


def _trainer(*args, env=None, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, "-m", "reference.train", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _losses(log: Path) -> list:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def small_config(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    return path


def test_standalone_equals_two_torchrun_nodes(small_config, tmp_path):
    """The same config: 4 gloo ranks started by the trainer, then two torchrun processes on
    127.0.0.1 acting as two nodes of 2 ranks each (c10d rendezvous on a free port). The
    losses are the same computation on the same ranks in the same order: equal to the bit."""
    standalone = tmp_path / "standalone.jsonl"
    run = _trainer("--config", small_config, "--world-size", 4, "--log-file", standalone)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sample:" in run.stdout

    port, nodes = _free_port(), tmp_path / "nodes.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "course",
           "-m", "reference.train", "--config", str(small_config), "--log-file", str(nodes)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert _losses(nodes) == _losses(standalone) and len(_losses(nodes)) == SMALL["steps"]


def test_check_explains_the_article_configuration():
    run = _trainer("--config", "configs/article_ds_config.json", "--check", "--world-size", 8,
                   "--tensor", 2, "--pipeline", 4)
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "dp is 1, so ZeRO-3 shards nothing" in text
    assert "micro-batch of 512 sequences" in text
    assert "pipeline engine refuses ZeRO-2 and 3" in text


def test_parity_and_plot_of_a_run(small_config, tmp_path):
    log = tmp_path / "run.jsonl"
    assert _trainer("--config", small_config, "--world-size", 4, "--log-file", log).returncode == 0
    parity = _trainer("parity", log, "--config", small_config, "--world-size", 4)
    assert parity.returncode == 0 and "largest relative loss difference" in parity.stdout, parity.stderr
    plot = _trainer("plot", log, "--out", tmp_path / "run.png")
    assert plot.returncode == 0 and (tmp_path / "run.png").stat().st_size > 1000, plot.stderr
    record = json.loads(log.read_text().splitlines()[-1])
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "sent_bytes_rank0", "peak_memory_bytes"):
        assert key in record
    assert len(record["peak_memory_bytes"]) == 4 and set(record["sent_bytes_rank0"]) >= {"tp", "dp"}


@pytest.mark.parametrize("args, expected", [
    (["--config", "nowhere.json", "--world-size", 1], "nowhere.json"),
    (["--config", "{bad}", "--world-size", 1], "line 1, column"),
    (["--config", "{small}", "--world-size", 3], "world_size=3"),
    (["--config", "{small}", "--world-size", 4, "--resume", "--checkpoint-dir", "{tmp}/none"],
     "--resume: no checkpoint in"),
    (["--config", "{small}", "--world-size", 4, "--set", "optimizer.parms.lr=1"], "params"),
])
def test_bad_input_is_one_clear_line(args, expected, small_config, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps": 3,,}')
    args = [str(a).format(small=small_config, bad=bad, tmp=tmp_path) for a in args]
    run = _trainer(*args, timeout=120)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.startswith("error: ") and expected in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_resume_continues_the_run_exactly(small_config, tmp_path):
    """3 steps and a checkpoint, then --resume to step 6: steps 4-6 equal those of an
    uninterrupted 6-step run to the bit (weights, AdamW moments, random states and the data
    position all come back)."""
    whole, parts, ckpt = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl", tmp_path / "ckpt"
    args = ["--config", small_config, "--world-size", 4]
    assert _trainer(*args, "--steps", 6, "--log-file", whole).returncode == 0
    first = _trainer(*args, "--steps", 3, "--log-file", parts, "--checkpoint-dir", ckpt)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (ckpt / "step_000003").is_dir()
    second = _trainer(*args, "--steps", 6, "--log-file", parts, "--checkpoint-dir", ckpt, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert _losses(parts) == _losses(whole) and len(_losses(whole)) == 6
