"""python -m reference.train: standalone, under torchrun as two "nodes", --check, plot, parity,
and bad input as one clear line."""
import json
import os
import shutil
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


def _in_process(*args, monkeypatch, capsys):
    """`python -m reference.train ARGS` in this process: its `__main__` and the same clear-error
    wrapper, from the repository as `_trainer` runs it. For input refused before any rank
    starts, without a fresh interpreter importing torch each time (about 4 s of CPU a run);
    `test_bad_input_on_the_command_line_is_one_clear_line` keeps the real command's start."""
    from reference.train.__main__ import _main_with_clear_errors

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["reference.train", *map(str, args)])
    capsys.readouterr()
    code = _main_with_clear_errors()
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


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


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """SMALL's run on 4 gloo ranks started by the trainer: (config, its log, the run), shared by
    the tests that compare with it."""
    folder = tmp_path_factory.mktemp("standalone")
    config, log = folder / "small.json", folder / "standalone.jsonl"
    config.write_text(json.dumps(SMALL))
    run = _trainer("--config", config, "--world-size", 4, "--log-file", log)
    assert run.returncode == 0, run.stderr[-3000:]
    return config, log, run


def test_standalone_equals_two_torchrun_nodes(standalone, tmp_path):
    """The same config: 4 gloo ranks started by the trainer, then two torchrun processes on
    127.0.0.1 acting as two nodes of 2 ranks each (c10d rendezvous on a free port). The
    losses are the same computation on the same ranks in the same order: equal to the bit."""
    small_config, standalone, run = standalone
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


def test_parity_and_plot_of_a_run(standalone, tmp_path):
    small_config, log, _ = standalone
    parity = _trainer("parity", log, "--config", small_config, "--world-size", 4)
    assert parity.returncode == 0 and "largest relative loss difference" in parity.stdout, parity.stderr
    # a step-2 loss 1e-3 off (a reduction gone wrong shows there): refused
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    lines[1]["loss"] *= 1.001
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps(x) + "\n" for x in lines))
    refused = _trainer("parity", wrong, "--config", small_config, "--world-size", 4)
    assert refused.returncode == 1 and "over the first 2 steps" in refused.stdout, refused.stdout
    plot = _trainer("plot", log, "--out", tmp_path / "run.png")
    assert plot.returncode == 0 and (tmp_path / "run.png").stat().st_size > 1000, plot.stderr
    record = json.loads(log.read_text().splitlines()[-1])
    for key in ("loss", "tokens", "grad_norm", "lr", "tokens_per_s", "sent_bytes_rank0", "peak_memory_bytes"):
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
def test_bad_input_is_one_clear_line(args, expected, small_config, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps": 3,,}')
    args = [str(a).format(small=small_config, bad=bad, tmp=tmp_path) for a in args]
    run = _in_process(*args, monkeypatch=monkeypatch, capsys=capsys)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.startswith("error: ") and expected in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_bad_input_on_the_command_line_is_one_clear_line():
    """The real command, started afresh: nothing but the one line on stderr (no warning printed
    while it imports), exit status 2."""
    run = _trainer("--config", "nowhere.json", "--world-size", 1, timeout=120)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.strip().splitlines() == ["error: no configuration file at 'nowhere.json'"], run.stderr


def test_resume_continues_the_run_exactly(standalone, tmp_path):
    """2 steps and a checkpoint, then --resume to step 4: steps 3-4 equal those of the
    uninterrupted 4-step run to the bit (weights, AdamW moments, random states and the data
    position all come back)."""
    small_config, whole, _ = standalone
    parts, ckpt = tmp_path / "parts.jsonl", tmp_path / "ckpt"
    args = ["--config", small_config, "--world-size", 4]
    first = _trainer(*args, "--steps", 2, "--log-file", parts, "--checkpoint-dir", ckpt)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (ckpt / "step_000002").is_dir()
    second = _trainer(*args, "--steps", 4, "--log-file", parts, "--checkpoint-dir", ckpt, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert _losses(parts) == _losses(whole) and len(_losses(whole)) == SMALL["steps"] == 4


def _config(tmp_path, name, **changes) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({**SMALL, **changes}))
    return path


def test_zero3_checkpoint_resumes_as_zero1_and_in_one_process(tmp_path):
    """ZeRO-3 on dp 2 x tp 2 x pp 2 (8 ranks; AdamW with weight decay 0.01, so two param
    groups, matrices decayed and the rest not; clipping; the trainer's constant schedule)
    checkpoints every 2 steps. Its step_000002, copied into a ZeRO-1 run on tp 2 (4 ranks,
    whose optimizer has one inner group) and into one process (two groups), resumes in both:
    steps 3-4 at the 8-rank run's learning rate and within `tolerance.loss()` of its losses."""
    from reference.tolerance import loss

    config = _config(tmp_path, "zero3.json", train_batch_size=8, gradient_accumulation_steps=2,
                     optimizer={"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
                     zero_optimization={"stage": 3}, parallelism={"tensor": 2, "pipeline": 2},
                     steps=4, checkpoint={"dir": str(tmp_path / "zero3"), "every": 2})
    whole = tmp_path / "zero3.jsonl"
    run = _trainer("--config", config, "--world-size", 8, "--log-file", whole, "--set", "log.sample_tokens=0")
    assert run.returncode == 0, run.stderr[-3000:]
    want = [json.loads(line) for line in whole.read_text().splitlines()][2:]
    for name, world, flags in (("zero1", 4, ["--set", "zero_optimization.stage=1", "--pipeline", 1]),
                               ("one", 1, ["--set", "zero_optimization.stage=0", "--tensor", 1,
                                           "--pipeline", 1])):
        (tmp_path / name).mkdir()
        shutil.copytree(tmp_path / "zero3" / "step_000002", tmp_path / name / "step_000002")
        log = tmp_path / f"{name}.jsonl"
        run = _trainer("--config", config, "--world-size", world, "--resume", "--checkpoint-dir",
                       tmp_path / name, "--log-file", log, "--set", "log.sample_tokens=0", *flags)
        assert run.returncode == 0, f"{name}: {run.stderr[-3000:]}"
        got = [json.loads(line) for line in log.read_text().splitlines()]
        assert [r["step"] for r in got] == [3, 4], name
        assert [r["lr"] for r in got] == [r["lr"] for r in want], name
        loss().assert_losses([r["loss"] for r in got], [r["loss"] for r in want], name)


def _refused(run, folder, why):
    """Exit 2 and one line on stderr naming ``folder`` and saying ``why``, before any rank ran."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr[-3000:]
    assert str(folder) in lines[0] and why in lines[0], lines[0]


def test_checkpoint_dir_under_a_file_is_refused_before_any_rank(small_config, tmp_path, monkeypatch, capsys):
    """checkpoint.dir inside a regular file cannot be created: said in one line, exit 2, before
    any rank starts (no log, no progress bar), not at the first save after training."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder\n")
    log = tmp_path / "run.jsonl"
    for folder in (blocker, blocker / "checkpoints"):
        run = _in_process("--config", small_config, "--world-size", 4, "--checkpoint-dir", folder,
                          "--log-file", log, monkeypatch=monkeypatch, capsys=capsys)
        _refused(run, folder, "is a file, not a folder")
        assert not log.exists()


def test_checkpoint_dir_without_write_permission_is_refused(small_config, tmp_path, monkeypatch, capsys):
    """A checkpoint.dir this user may not write (a read-only folder, or a missing one inside
    it) is refused as a folder under a file is: one line, exit 2, before any rank starts."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user writes into a read-only folder (root, or CAP_DAC_OVERRIDE): "
                        "permission bits stop nothing here, so there is no refusal to show")
        log = tmp_path / "run.jsonl"
        for folder in (locked, locked / "checkpoints"):
            run = _in_process("--config", small_config, "--world-size", 4, "--checkpoint-dir", folder,
                              "--log-file", log, monkeypatch=monkeypatch, capsys=capsys)
            _refused(run, folder, "no permission to write")
            assert not log.exists()
    finally:
        locked.chmod(0o755)
