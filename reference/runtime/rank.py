"""What runs inside each rank that `reference.runtime.launch` starts.

The rank sends its output to its own log, prepares its device and generators and
unpickles the function (`load_payload`), joins the process group through a FileStore
in the launch's folder, runs the function, and leaves a result file or an error record
for the caller, then waits for the caller's release (`reference.runtime.launcher`).
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback

import cloudpickle
import torch
import torch.distributed as dist

from reference.runtime.seeds import seed_rank

# Environment variable set inside ranks started by `launch` (never by torchrun).
RANK_MARKER = "COURSE_LAUNCH_RANK"
# Messages of errors that only report a lost peer: the consequences of a failure elsewhere.
_COMM_PATTERNS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe",
    "remote worker crashing", "Socket Timeout", "Timed out waiting", "timed out",
    "ECONNRESET", "NCCL communicator was aborted", "Connection refused",
)


def process_group_backend(backend: str) -> str:
    """The backend string handed to init_process_group: under NCCL, CPU tensors still go through gloo
    ("cpu:gloo,cuda:nccl"), so a notebook whose ranks build small CPU tensors runs on a GPU node."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def is_comm_error(exc: BaseException) -> bool:
    dist_errors = tuple(getattr(dist, n) for n in ("DistNetworkError", "DistStoreError")
                        if hasattr(dist, n))
    return isinstance(exc, dist_errors) or any(p in str(exc) for p in _COMM_PATTERNS)


def load_payload(rank, payload, backend, seed):
    """This rank's device and random state, then its function and arguments: the GPU is set first,
    since the payload's CUDA tensors are created on the current device (`reference.runtime.payload`)."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    seed_rank(seed, rank)  # fresh entropy, or rank_seed(seed, rank)
    return cloudpickle.loads(payload)


def rank_main(rank, world_size, payload, context, workdir, backend, threads, timeout,
               lifeline, safe_results, seed=None):
    """Entry point of one rank (runs in the child process)."""
    # Every byte the rank writes, Python or C++, goes to its own log file.
    log = os.open(os.path.join(workdir, f"rank{rank}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    # On SIGUSR1 the rank writes where its main thread is (the caller asks when it hangs).
    stack_file = open(os.path.join(workdir, f"stack{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)

    released = threading.Event()

    def watch_caller():
        # The caller sends "release" once every rank has finished; end of file means
        # the caller is gone, and a rank must never outlive it.
        try:
            if lifeline.recv() == "release":
                released.set()
                return
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch_caller, daemon=True).start()

    try:
        env, cwd, path = context
        os.environ.clear()
        os.environ.update(env)  # the caller's environment as it is now
        os.environ.update({RANK_MARKER: str(rank), "RANK": str(rank), "LOCAL_RANK": str(rank),
                           "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                           "OMP_NUM_THREADS": str(threads)})
        for entry in reversed(path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        os.chdir(cwd)
        torch.set_num_threads(threads)
        # After sys.path is the caller's: functions of importable modules travel by name.
        fn, args = load_payload(rank, payload, backend, seed)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        # The group's own timeout is longer than the caller's, so a hang is reported
        # by the caller (naming the unfinished ranks), not by a collective's timeout.
        dist.init_process_group(process_group_backend(backend), store=store, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout + 60))
        if not callable(fn):
            raise TypeError(f"launch needs a callable, got {type(fn).__name__}")
        _write_result(workdir, rank, fn(*args), safe_results)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
        _write_error(workdir, rank, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Keep the connections open until every rank is done (see `reference.runtime.launcher`).
    released.wait()
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _write_result(workdir, rank, result, safe_results):
    final = os.path.join(workdir, f"result{rank}.pt")
    tmp = final + ".tmp"
    if safe_results:
        torch.save(result, tmp)
    else:
        with open(tmp, "wb") as f:
            cloudpickle.dump(result, f)
    os.replace(tmp, final)  # the caller sees a whole file or none


def _write_error(workdir, rank, exc):
    record = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc),
              "traceback": "".join(traceback.format_exception(exc)), "comm": is_comm_error(exc)}
    final = os.path.join(workdir, f"error{rank}.json")
    with open(final + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(final + ".tmp", final)
