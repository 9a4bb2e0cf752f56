"""reference.runtime.launch: results, output, failures, hangs, interrupts, concurrency, torchrun."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from proc_helpers import gone

from reference import runtime
from reference.runtime import RankError, RankTimeoutError, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sum_of_ranks(scale):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "value": t * scale,
            "pid": os.getpid()}




@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_each_rank_result(world_size):
    results = launch(_sum_of_ranks, world_size, 2.0, quiet=True)
    expected = 2.0 * world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world"] == world_size for r in results)
    for r in results:
        torch.testing.assert_close(r["value"], torch.tensor([expected]), rtol=0, atol=0)
    assert gone([r["pid"] for r in results])


def test_closure_and_lambda_travel_by_value():
    offset = 10

    def closure():
        return dist.get_rank() + offset

    assert launch(closure, 2, quiet=True) == [10, 11]
    assert launch(lambda a, b: a * b + dist.get_rank(), 2, 3, 4, quiet=True) == [12, 13]


class _WithConfig:
    config = "a config"


def test_function_reading_an_attribute_named_like_a_torch_config_module():
    # `config` is also the name of torch.distributed.config, a ModuleType subclass.
    def read(obj):
        dist.get_rank()
        return obj.config

    assert launch(read, 2, _WithConfig(), quiet=True) == ["a config"] * 2


def test_output_is_prefixed_and_in_rank_order(capsys):
    def talk():
        r = dist.get_rank()
        # Higher ranks print first, so rank order in the output is the launcher's doing.
        time.sleep(0.2 * (3 - r))
        print(f"hello {r}")
        print(f"stderr {r}", file=sys.stderr)
        os.write(2, f"raw fd {r}\n".encode())  # what C++ code writes goes the same way

    launch(talk, 3)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("[rank")]
    expected = []
    for r in range(3):
        expected += [f"[rank {r}] hello {r}", f"[rank {r}] stderr {r}", f"[rank {r}] raw fd {r}"]
    assert lines == expected


def test_quiet_hides_output(capsys):
    launch(lambda: print("secret"), 2, quiet=True)
    assert "secret" not in capsys.readouterr().out


def test_a_raising_rank_stops_all_and_reports_its_traceback(tmp_path):
    def fail_on_one(pid_dir):
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        if dist.get_rank() == 1:
            raise ValueError("rank one is broken")
        dist.barrier()  # rank 0 and 2 wait for rank 1 here, then lose their connection
        time.sleep(60)

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fail_on_one, 3, str(tmp_path), quiet=True, timeout=120)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1
    assert "ValueError: rank one is broken" in str(err)
    assert "fail_on_one" in err.traceback
    # The frame points at this file and shows the failing line, though the function
    # travelled by value.
    assert 'raise ValueError("rank one is broken")' in err.traceback
    assert os.path.basename(__file__) in err.traceback
    # The peers' connection errors are listed as consequences, not as the cause.
    assert str(err).startswith("rank 1 of 3 failed")
    assert set(err.failures) >= {1}
    # Stopped long before the 60 s sleep or the 120 s timeout would have ended it.
    assert elapsed < 30, elapsed
    assert gone([int(p) for p in os.listdir(tmp_path)])


def test_a_rank_that_exits_silently_is_named():
    def vanish():
        if dist.get_rank() == 1:
            os._exit(3)
        dist.barrier()

    with pytest.raises(RankError) as info:
        launch(vanish, 2, quiet=True, timeout=60)
    assert info.value.rank == 1
    assert "exit code 3" in str(info.value)


def test_a_hang_ends_at_the_timeout_naming_the_unfinished_ranks(tmp_path):
    def skip_the_barrier(pid_dir):
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        if dist.get_rank() != 1:
            dist.barrier()  # rank 1 never joins: ranks 0 and 2 wait forever

    with pytest.raises(RankTimeoutError) as info:
        launch(skip_the_barrier, 3, str(tmp_path), quiet=True, timeout=4)
    err = info.value
    assert err.ranks == [0, 2]
    assert "ranks [0, 2] of 3 did not finish" in str(err)
    assert "finished: [1]" in str(err)
    assert "skip_the_barrier" in err.stacks[0]  # where rank 0 was waiting
    assert isinstance(err, TimeoutError)
    assert gone([int(p) for p in os.listdir(tmp_path)])


INTERRUPT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from reference.runtime import launch

    # Take Ctrl-C as a Jupyter kernel does, whatever this process inherited: a shell starts a
    # background job (`make test &`) with SIGINT ignored, and Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def sleeper(pid_dir):
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        time.sleep(600)

    if __name__ == "__main__":
        try:
            launch(sleeper, 3, sys.argv[1], timeout=600)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(7)
""")


@pytest.mark.parametrize("whom", ["group", "caller"])
def test_interrupt_leaves_no_process_behind(tmp_path, whom):
    """Jupyter's interrupt signals the kernel's process group; a plain Ctrl-C may reach
    only the caller. Either way the ranks must go."""
    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPT_SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(pid_dir)], cwd=ROOT,
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(pid_dir)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p) for p in os.listdir(pid_dir)]
        assert len(pids) == 3, "ranks did not start"
        if whom == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 7 and "interrupted" in out
    assert gone(pids)


def test_eight_concurrent_launches_do_not_collide():
    results, errors = {}, []

    def one(i):
        try:
            results[i] = launch(_sum_of_ranks, 2, float(i), quiet=True, timeout=120)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(8):
        assert [r["value"].item() for r in results[i]] == [3.0 * i, 3.0 * i]


def test_more_ranks_than_cores_get_one_thread_each():
    world = 2 * runtime.default_threads(1) + 1
    assert runtime.default_threads(world) == 1
    assert launch(torch.get_num_threads, world, quiet=True) == [1] * world
    assert launch(torch.get_num_threads, 2, threads=2, quiet=True) == [2, 2]


def test_backend_choice(monkeypatch):
    assert runtime.resolve_backend("auto", 2) == ("nccl" if torch.cuda.device_count() >= 2
                                                  else "gloo")
    assert launch(lambda: dist.get_backend(), 2, backend="gloo", quiet=True) == ["gloo"] * 2
    assert launch(lambda: str(runtime.device()), 1, backend="gloo", quiet=True) == ["cpu"]
    with pytest.raises(ValueError, match="backend must be"):
        runtime.resolve_backend("mpi", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="one GPU per rank: world_size=2 but 0 GPU"):
        runtime.resolve_backend("nccl", 2)
    # With four GPUs visible but CUDA already initialised here, a forked rank could not use it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert runtime.resolve_backend("auto", 4) == "nccl"
    assert runtime.resolve_backend("auto", 8) == "gloo"
    with pytest.raises(RuntimeError, match="CUDA is already initialised"):
        runtime.resolve_backend("auto", 4, start_method="fork")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(print, 0)
    with pytest.raises(ValueError, match="timeout must be"):
        launch(print, 2, timeout=0)
    with pytest.raises(ValueError, match="start_method"):
        launch(print, 2, start_method="thread")
    with pytest.raises(RankError, match="needs a callable"):
        launch(42, 2, quiet=True)
    with pytest.raises(RankError, match="launch was called inside a rank"):
        launch(lambda: launch(print, 2), 1, quiet=True)


class _Opaque:
    pass


def test_safe_results_refuses_objects():
    assert launch(lambda: {"t": torch.ones(2), "n": [1, 2.5, "x"]}, 2, safe_results=True,
                  quiet=True)[1]["n"] == [1, 2.5, "x"]
    with pytest.raises(RankError, match="safe_results=True does not accept"):
        launch(_Opaque, 1, safe_results=True, quiet=True)


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from reference.runtime import launch

    def work():
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return t.item()

    if __name__ == "__main__":
        results = launch(work, 2)
        # One file per rank: torchrun interleaves the ranks' stdout.
        with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.txt"), "w") as f:
            f.write(repr(results))
""")


def test_launch_from_python_c_without_a_main_file():
    """Ranks do not re-import the caller's main module, which here is no file at all."""
    code = ("import torch.distributed as dist\n"
            "from reference.runtime import launch\n"
            "print('RESULTS', launch(lambda: dist.get_rank() * 10, 2, quiet=True))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULTS [0, 10]" in out.stdout


def test_same_call_under_torchrun(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(script), str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "[3.0, 3.0]"


def test_function_defined_in_a_notebook_cell(tmp_path):
    """Under papermill, a function defined in a cell runs on the ranks."""
    nbformat = pytest.importorskip("nbformat")
    papermill = pytest.importorskip("papermill")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import torch, torch.distributed as dist\n"
                                  "from reference.runtime import launch\n"
                                  "x = torch.randn(256, 256); _ = x @ x  # the kernel uses OpenMP"),
        nbformat.v4.new_code_cell("def cell_fn(k):\n"
                                  "    y = torch.randn(128, 128) @ torch.randn(128, 128)\n"
                                  "    t = torch.tensor([float(dist.get_rank())])\n"
                                  "    dist.all_reduce(t)\n"
                                  "    return t.item() * k\n"
                                  "result = launch(cell_fn, 2, 10, threads=2)\n"
                                  "assert result == [10.0, 10.0], result\n"
                                  "print('cell ok', result)"),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src, dst = tmp_path / "cell.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nb, src)
    papermill.execute_notebook(str(src), str(dst), cwd=str(tmp_path), progress_bar=False,
                               kernel_name="python3", execution_timeout=120)
    out = nbformat.read(dst, as_version=4)
    text = "".join(o.get("text", "") for o in out.cells[1].outputs)
    assert "cell ok [10.0, 10.0]" in text


# ----------------------------------------------------------------------------- the NCCL path, without a GPU

def test_results_are_read_onto_the_cpu(monkeypatch):
    """A rank's CUDA result must not start CUDA in the caller: every load maps to the CPU."""
    calls, real_load = [], torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)  # in the caller only: the ranks are forked elsewhere
    for safe in (False, True):
        calls.clear()
        results = launch(lambda: {"t": torch.ones(2)}, 2, safe_results=safe, quiet=True)
        assert [r["t"].tolist() for r in results] == [[1.0, 1.0]] * 2
        assert calls and all(c == "cpu" for c in calls), (safe, calls)


def _note(path, what):
    with open(path, "a") as f:
        f.write(what + "\n")


class _NotedWhenUnpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return _note, (self.path, "unpickled")


def test_the_rank_sets_its_gpu_before_unpickling(tmp_path, monkeypatch):
    """Unpickling a CUDA tensor before set_device would put it, and a CUDA context, on cuda:0."""
    import multiprocessing as mp

    import cloudpickle

    from reference.runtime.rank import rank_main

    order = str(tmp_path / "order.txt")
    # Forked from here, the rank keeps this fake set_device (the real one needs a GPU).
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: _note(order, f"set_device {d}"))
    payload = cloudpickle.dumps((len, ([_NotedWhenUnpickled(order)],)))
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    context = (dict(os.environ), os.getcwd(), list(sys.path))
    proc = ctx.Process(target=rank_main, args=(0, 1, payload, context, str(tmp_path), "nccl", 1,
                                               5.0, reader, False))
    proc.start()
    reader.close()
    try:
        # Only the order matters; the rank may then fail to start NCCL without a GPU.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not os.path.exists(order)
                                               or len(open(order).read().splitlines()) < 2):
            time.sleep(0.05)
    finally:
        writer.close()  # a rank waiting for the release sees end of file and exits
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert open(order).read().splitlines() == ["set_device 0", "unpickled"]


def test_cuda_tensors_travel_to_the_rank_device(monkeypatch):
    """A CUDA argument is sent as a CPU copy and rebuilt on the rank's current device."""
    import cloudpickle

    from reference.runtime import payload

    rebuilt = []
    layer, buffer = torch.nn.Linear(2, 3), torch.arange(3.0)
    # No GPU here: these three tensors play CUDA tensors, and "the rank's device" is the CPU.
    monkeypatch.setattr(payload, "_on_gpu", lambda obj: any(obj is t for t in (*layer.parameters(),
                                                                               buffer)))
    monkeypatch.setattr(payload, "_rank_device", lambda: rebuilt.append(1) or torch.device("cpu"))
    fn, (got_layer, got_buffer) = cloudpickle.loads(payload.dumps((print, (layer, buffer))))
    assert len(rebuilt) == 3  # weight, bias and the buffer, each rebuilt by on_rank_device
    assert isinstance(got_layer.weight, torch.nn.Parameter) and got_layer.weight.requires_grad
    assert not got_buffer.requires_grad
    torch.testing.assert_close(got_layer.weight, layer.weight, rtol=0, atol=0)  # a copy: exact
    torch.testing.assert_close(got_buffer, buffer, rtol=0, atol=0)


def test_fork_does_not_ask_cuda_before_forking(monkeypatch):
    """torch.cuda.is_available() starts CUDA here, and forked ranks then cannot use it."""
    def refuse():
        raise AssertionError("CUDA was queried before forking")

    monkeypatch.setattr(torch.cuda, "is_available", refuse)
    monkeypatch.setattr(torch.cuda, "device_count", refuse)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert runtime.resolve_backend("auto", 2, start_method="fork") == "gloo"
    with pytest.raises(RuntimeError, match="backend='nccl' cannot start ranks with "
                                           "start_method='fork'"):
        runtime.resolve_backend("nccl", 2, start_method="fork")
    assert launch(lambda: dist.get_rank(), 2, start_method="fork", threads=1,
                  quiet=True) == [0, 1]
