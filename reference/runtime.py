"""Start N ranks from a notebook cell, a test or a script.

    results = launch(fn, 4, x)        # fn(x) on 4 processes, torch.distributed ready

`launch` gives every rank a process group (gloo on CPU, NCCL with one GPU per rank
when there are enough GPUs), runs `fn(*args)` on each, and returns the list of
per-rank return values. Under `torchrun` the same call runs `fn` on the ranks
torchrun started, so one notebook or script serves a laptop and a GPU node.

How the ranks are started, and why (figures from `python bench/launch_methods.py`
on a 2-core CPU machine; see that script for the whole table):

* `spawn` starts a fresh interpreter per rank. It cannot unpickle a function
  defined in a notebook cell (pickle looks it up by name in `__main__`, which the
  new interpreter does not have), and each rank re-imports torch: about 2-3 s
  per launch.
* `fork` copies the kernel. If the kernel already ran an OpenMP parallel region
  (any sizeable torch op), a forked rank that runs more than one intra-op thread
  deadlocks in the OpenMP runtime, and a forked rank cannot use CUDA once the
  kernel initialised it.
* `forkserver` (chosen) forks each rank from a small clean server process that
  has imported torch but never run an op or touched CUDA: neither problem can
  occur, and after the first launch a rank starts in a fraction of a second.
  The function travels as a cloudpickle payload, which serialises functions
  defined in `__main__` (a notebook cell) by value.

Rendezvous uses a `FileStore` in a fresh temporary folder per launch, so launches
running side by side never share a port or a store. Each rank's stdout and
stderr (C++ logs included: the file descriptors are redirected) go to a file and
are printed by the caller after the run, rank by rank, each line prefixed with
`[rank r]`, so notebook output never interleaves at random.

Failure handling. A rank that raises writes its traceback and exits; the caller
stops every other rank within a second and raises one `RankError` showing the
first failure that is not a communication error (a peer's "connection closed"
is a consequence, not a cause). A rank that finishes waits for the caller's
release before tearing down its connections, so a rank that skips a collective
leaves its peers hanging there instead of failing them; at `timeout` the caller
dumps every unfinished rank's Python stack, kills it and raises
`RankTimeoutError` naming the ranks that did not finish. Ranks stay in the
caller's process group (Jupyter's interrupt signals the whole group) and are
killed in a `finally`, so an interrupted kernel leaves nothing behind.
"""
from __future__ import annotations

import datetime
import faulthandler
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

import cloudpickle
import torch
import torch.distributed as dist

__all__ = [
    "launch", "RankError", "RankTimeoutError", "device", "resolve_backend",
    "init_from_env", "under_torchrun", "default_threads",
]

# Environment variable set inside ranks started by `launch` (never by torchrun).
_RANK_MARKER = "COURSE_LAUNCH_RANK"
# Messages of errors that only report a lost peer: the consequences of a failure elsewhere.
_COMM_PATTERNS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe",
    "remote worker crashing", "Socket Timeout", "Timed out waiting", "timed out",
    "ECONNRESET", "NCCL communicator was aborted", "Connection refused",
)


class RankError(RuntimeError):
    """One or more ranks failed. `.rank` is the rank whose failure is the cause,
    `.traceback` its traceback text, `.failures` maps every failed rank to its summary."""

    def __init__(self, message, rank=None, traceback_text="", failures=None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback_text
        self.failures = failures or {}


class RankTimeoutError(RankError, TimeoutError):
    """Ranks did not finish within the timeout. `.ranks` lists them."""

    def __init__(self, message, ranks, stacks=None):
        super().__init__(message, rank=ranks[0] if ranks else None)
        self.ranks = list(ranks)
        self.stacks = stacks or {}


# ----------------------------------------------------------------------------- helpers

def default_threads(world_size: int) -> int:
    """Intra-op threads per rank: the cores shared out, at least one.

    With more ranks than cores every rank gets one thread (as torchrun does);
    more would only oversubscribe the cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def resolve_backend(backend: str, world_size: int, start_method: str = "forkserver") -> str:
    """"auto" -> NCCL with one GPU per rank when there are at least `world_size` GPUs, else gloo."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    # device_count() asks the driver without initialising CUDA in this process.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl":
        if gpus < world_size:
            raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} "
                             f"but {gpus} GPU(s) visible")
        if start_method == "fork" and torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA is already initialised in this process, and a forked rank cannot use it. "
                "Use start_method='forkserver' (the default) or restart the kernel and launch "
                "before touching CUDA.")
    return backend


def device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, the CPU under gloo."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets the env:// variables)."""
    env = os.environ
    return (_RANK_MARKER not in env and "RANK" in env and "WORLD_SIZE" in env
            and "MASTER_ADDR" in env)


def init_from_env(backend: str = "auto") -> tuple[int, int]:
    """Join the process group torchrun describes in the environment; returns (rank, world_size).

    Under NCCL each process takes the GPU LOCAL_RANK. Idempotent."""
    if not dist.is_initialized():
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


def _is_comm_error(exc: BaseException) -> bool:
    dist_errors = tuple(getattr(dist, n) for n in ("DistNetworkError", "DistStoreError")
                        if hasattr(dist, n))
    if dist_errors and isinstance(exc, dist_errors):
        return True
    text = str(exc)
    return any(p in text for p in _COMM_PATTERNS)


# ----------------------------------------------------------------------------- inside a rank

def _rank_main(rank, world_size, payload, context, workdir, backend, threads, timeout,
               lifeline, safe_results):
    """Entry point of one rank (runs in the child process)."""
    # Every byte the rank writes, Python or C++, goes to its own log file.
    log = os.open(os.path.join(workdir, f"rank{rank}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
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
        os.environ.update({_RANK_MARKER: str(rank), "RANK": str(rank), "LOCAL_RANK": str(rank),
                           "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                           "OMP_NUM_THREADS": str(threads)})
        for entry in reversed(path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        os.chdir(cwd)
        # After sys.path is the caller's: functions of importable modules travel by name.
        fn, args = cloudpickle.loads(payload)
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        # The group's own timeout is longer than the caller's, so a hang is reported
        # by the caller (naming the unfinished ranks), not by a collective's timeout.
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout + 60))
        if callable(fn):
            result = fn(*args)
        else:
            raise TypeError(f"launch needs a callable, got {type(fn).__name__}")
        _write_result(workdir, rank, result, safe_results)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
        _write_error(workdir, rank, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Keep the connections open until every rank is done (see the module docstring).
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
    record = {
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "comm": _is_comm_error(exc),
    }
    final = os.path.join(workdir, f"error{rank}.json")
    with open(final + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(final + ".tmp", final)


# ----------------------------------------------------------------------------- in the caller

_PRELOAD = ["torch", "torch.distributed", "cloudpickle", "reference.runtime"]


def _context(start_method):
    if start_method not in ("forkserver", "spawn", "fork"):
        raise ValueError(f"start_method must be 'forkserver', 'spawn' or 'fork', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Import torch once in the server; every rank forked from it starts warm.
        # (Only takes effect before the server's first start.)
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _kill_tree(procs, grace=1.0):
    """SIGTERM each process and its descendants, then SIGKILL what is left."""
    import psutil

    victims = []
    for p in procs:
        if p.pid is None:
            continue
        try:
            proc = psutil.Process(p.pid)
            victims += proc.children(recursive=True) + [proc]
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        try:
            v.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=grace)
    for v in alive:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    for p in procs:
        if p.pid is not None:
            p.join(timeout=grace)


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _print_logs(workdir, world_size):
    for rank in range(world_size):
        text = _read(os.path.join(workdir, f"rank{rank}.log"))
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")
    sys.stdout.flush()


def _load_result(path, rank, safe_results):
    if safe_results:
        try:
            return torch.load(path, weights_only=True)
        except Exception as exc:  # the rank returned something other than plain data
            raise RankError(f"rank {rank} returned a value that safe_results=True does not "
                            f"accept (only tensors, numbers, strings, lists, tuples and "
                            f"dicts): {str(exc).splitlines()[0]}", rank=rank) from None
    with open(path, "rb") as f:
        return cloudpickle.load(f)


def _signal_name(code):
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _failure_error(workdir, world_size, exits, exit_times):
    """Pick the cause among the failed ranks and build one RankError."""
    errors = {}
    for rank in range(world_size):
        text = _read(os.path.join(workdir, f"error{rank}.json"))
        if text:
            errors[rank] = json.loads(text)
    silent = {r: c for r, c in exits.items() if c not in (0, None) and r not in errors}
    causes = sorted((e for e in errors.values() if not e["comm"]), key=lambda e: e["time"])
    summary = {r: f"{e['type']}: {e['message'].splitlines()[0] if e['message'] else ''}"
               for r, e in errors.items()}
    for r, c in silent.items():
        how = f"killed by {_signal_name(c)}" if c < 0 else f"exit code {c}"
        summary[r] = f"exited without raising ({how})"
    if causes:
        cause = causes[0]
        rank, head, tb = cause["rank"], summary[cause["rank"]], cause["traceback"]
    elif silent:
        rank = min(silent, key=lambda r: exit_times.get(r, float("inf")))
        head, tb = summary[rank], ""
        if silent[rank] < 0:
            tb = "The process was killed by a signal (out of memory, or a crash in native code?)."
        else:
            tb = "The process exited (os._exit or sys.exit?) without raising an exception."
    else:
        first = min(errors.values(), key=lambda e: e["time"])
        rank, head, tb = first["rank"], summary[first["rank"]], first["traceback"]
    others = [r for r in sorted(summary) if r != rank]
    lines = [f"rank {rank} of {world_size} failed: {head}", "",
             f"Traceback of rank {rank}, the first rank to fail for a reason other than "
             f"communication:" if causes else f"Report of rank {rank}:", tb.rstrip()]
    if others:
        lines += ["", "Then, as a consequence: " + "; ".join(f"rank {r}: {summary[r]}"
                                                             for r in others)]
    return RankError("\n".join(lines), rank=rank, traceback_text=tb, failures=summary)


def _hang_stacks(workdir, ranks):
    """Where each hung rank's main thread was, innermost call first, launcher frames dropped."""
    stacks = {}
    for rank in ranks:
        frames = [line for line in _read(os.path.join(workdir, f"stack{rank}.txt")).splitlines()
                  if line.strip().startswith("File") and "multiprocessing" not in line
                  and not line.rstrip().endswith("in _rank_main")]
        if frames:
            stacks[rank] = "\n".join(frames)
    return stacks


def launch(fn, world_size: int, *args, backend: str = "auto", timeout: float = 300.0,
           threads: int | None = None, quiet: bool = False, safe_results: bool = False,
           start_method: str = "forkserver"):
    """Run `fn(*args)` on `world_size` ranks with torch.distributed initialised.

    Returns the list of the ranks' return values (index = rank). Raises `RankError`
    when a rank fails and `RankTimeoutError` when ranks are still running after
    `timeout` seconds. `threads` sets intra-op threads per rank (default: the cores
    shared out, at least one). `quiet=True` hides the ranks' output.
    `safe_results=True` reads results with `torch.load(weights_only=True)`, so ranks
    running untrusted code can only return tensors, numbers, strings and containers.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if under_torchrun():
        return _launch_under_torchrun(fn, world_size, args, backend)
    if _RANK_MARKER in os.environ:
        raise RuntimeError("launch was called inside a rank: start ranks from the caller only")
    backend = resolve_backend(backend, world_size, start_method)
    threads = threads or default_threads(world_size)
    ctx = _context(start_method)
    payload = cloudpickle.dumps((fn, args))
    context = (dict(os.environ), os.getcwd(), list(sys.path))
    workdir = tempfile.mkdtemp(prefix="launch-")
    procs, writers, exits, exit_times = [], [], {}, {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"rank{rank}",
                            args=(rank, world_size, payload, context, workdir, backend, threads,
                                  timeout, reader, safe_results))
            p.start()
            reader.close()
            procs.append(p)
            writers.append(writer)
        deadline = time.monotonic() + timeout
        first_failure = None
        while True:
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank not in exits and p.exitcode is not None:
                    exits[rank], exit_times[rank] = p.exitcode, now
            done = [r for r in range(world_size)
                    if os.path.exists(os.path.join(workdir, f"result{r}.pt"))]
            failed = [r for r, c in exits.items() if c != 0]
            if failed and first_failure is None:
                first_failure = now
            if len(done) == world_size:
                for w in writers:
                    w.send("release")
                for p in procs:
                    p.join(timeout=10)
                break
            # Give the peers a moment to report, then stop everyone.
            if first_failure is not None and (now - first_failure > 1.0
                                              or len(exits) == world_size):
                raise _failure_error(workdir, world_size, exits, exit_times)
            if now > deadline:
                hung = [r for r in range(world_size) if r not in done and r not in exits]
                for r in hung:
                    try:
                        os.kill(procs[r].pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                time.sleep(0.5)  # let faulthandler write the stacks
                stacks = _hang_stacks(workdir, hung)
                finished = sorted(set(range(world_size)) - set(hung))
                where = "".join(f"\n\nrank {r} was waiting in:\n{s}" for r, s in stacks.items())
                raise RankTimeoutError(
                    f"ranks {hung} of {world_size} did not finish within {timeout:g} s "
                    f"(finished: {finished}). A rank that skips a collective its peers entered, "
                    f"or waits for a message nobody sends, hangs them all.{where}",
                    ranks=hung, stacks=stacks)
            alive = [p.sentinel for r, p in enumerate(procs) if r not in exits]
            multiprocessing.connection.wait(alive, timeout=0.05)
        return [_load_result(os.path.join(workdir, f"result{r}.pt"), r, safe_results)
                for r in range(world_size)]
    finally:
        for w in writers:
            w.close()  # a rank still waiting sees end of file and exits
        _kill_tree(procs)
        if not quiet:
            _print_logs(workdir, world_size)
        shutil.rmtree(workdir, ignore_errors=True)


def _launch_under_torchrun(fn, world_size, args, backend):
    """torchrun started the ranks: run fn here and share every rank's result."""
    rank, size = init_from_env(backend)
    if size != world_size:
        raise ValueError(f"launch asked for world_size={world_size}, but torchrun started "
                         f"WORLD_SIZE={size} ranks: pass the same number to both")
    result = fn(*args)
    results = [None] * size
    dist.all_gather_object(results, result)
    return results
