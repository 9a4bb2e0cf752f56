"""Start N ranks from a notebook cell, a test or a script.

    results = launch(fn, 4, x)        # fn(x) on 4 processes, torch.distributed ready

Under `torchrun` the same call runs `fn` on the ranks torchrun started, so one notebook or
script serves a laptop and a GPU node.

How the ranks are started, and why. `python bench/launch_methods.py` launches 2
ranks from a caller that already used OpenMP (as a kernel has), each rank running
a matmul on two threads; on a 2-core CPU machine it printed:

    method       first launch  next (median)
    forkserver          1.32s          0.15s
    spawn               1.29s          1.15s
    fork                 HANG

* `spawn` starts a fresh interpreter per rank and re-imports torch every time.
  Plain pickle cannot send it a function defined in a notebook cell (it looks
  the function up by name in `__main__`, which the new interpreter lacks).
* `fork` copies the caller. Once the caller has run an OpenMP parallel region, a
  forked rank running more than one intra-op thread deadlocks inside the OpenMP
  runtime (the HANG above), and a forked rank cannot use CUDA once the caller
  initialised it.
* `forkserver` (chosen) forks each rank from a small clean server process that
  imported torch but never ran an op or touched CUDA: neither problem can occur,
  and after the first launch a rank starts in a fraction of a second. The
  function travels by value (`reference.runtime.payload`), and each rank reseeds
  the generators it inherited (`reference.runtime.seeds`).

Rendezvous uses a `FileStore` in a fresh temporary folder per launch, so launches side by
side never share a port. Each rank's stdout and stderr (C++ logs included) go to a file,
printed by the caller after the run with each line prefixed `[rank r]`.

Failure handling. A rank that raises writes its traceback and exits; the caller stops every
other rank within a second and raises one `RankError` showing the first failure that is not
a communication error (a peer's "connection closed" is a consequence, not a cause). A rank
that finishes waits for the caller's release before tearing down its connections, so a rank
that skips a collective leaves its peers hanging instead of failing them; at `timeout` the
caller dumps every unfinished rank's Python stack, kills it and raises `RankTimeoutError`.
Ranks stay in the caller's process group (Jupyter's interrupt reaches them) and are killed in
a `finally`, so an interrupted kernel leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import linecache
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.spawn as mp_spawn
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import types

from reference.runtime.errors import RankError, RankTimeoutError, failure_error, hang_stacks, read_text
from reference.runtime.backend import default_threads, launch_under_torchrun, resolve_backend, under_torchrun
from reference.runtime.payload import dumps, load_result
from reference.runtime.rank import RANK_MARKER, rank_main
from reference.runtime.seeds import check_seed

__all__ = ["launch", "preload", "RankError", "RankTimeoutError", "kill_processes"]

# ----------------------------------------------------------------------------- in the caller

# torch._dynamo is imported by the first optimizer.step(): preloading it saves every rank
# several seconds. DTensor and FSDP are imported by the parallel packages (0.15 s a rank).
# Packages whose import is costly add themselves with `preload` when they are imported.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
            "torch.distributed.fsdp", "cloudpickle", "reference.runtime.rank"]


def preload(*modules: str) -> None:
    """Have every rank start with ``modules`` already imported by the fork server, instead of each
    rank importing them again. Takes effect only before the first `launch` of the process (a
    package calls it when imported); a preloaded module must not touch CUDA at import time."""
    for module in modules:
        if module not in _PRELOAD:
            _PRELOAD.append(module)

_START_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_main_module():
    """Start processes that do not re-import the caller's `__main__` (as multiprocessing does, for
    pickled references into it; a rank's function travels by value): it saves every rank a
    re-import and makes launch work where `__main__` is no file (`python -c`, `python -`)."""
    original = mp_spawn.get_preparation_data

    def without_main(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    with _START_LOCK:
        mp_spawn.get_preparation_data = without_main
        try:
            yield
        finally:
            mp_spawn.get_preparation_data = original


def _context(start_method):
    if start_method not in ("forkserver", "spawn", "fork"):
        raise ValueError(f"start_method must be 'forkserver', 'spawn' or 'fork', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Import torch once in the server; every rank forked from it starts warm.
        ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def kill_processes(procs: list, grace: float = 0.0) -> None:
    """SIGKILL (after SIGTERM and `grace` seconds if grace > 0) and reap psutil processes."""
    import psutil

    procs = [p for p in procs if p.pid != os.getpid()]
    if grace > 0:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, procs = psutil.wait_procs(procs, timeout=grace)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=5)  # reaps our own children among them


def _kill_tree(procs, grace=1.0):
    """SIGTERM each rank and its descendants, then SIGKILL what is left after `grace` s."""
    import psutil

    victims = []
    for p in procs:
        if p.pid is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(p.pid)
                victims += proc.children(recursive=True) + [proc]
    kill_processes(victims, grace=grace)
    for p in procs:
        if p.pid is not None:
            p.join(timeout=grace)


def _print_logs(workdir, world_size):
    for rank in range(world_size):
        text = read_text(os.path.join(workdir, f"rank{rank}.log"))
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")
    sys.stdout.flush()


# A traceback frame ('line 3, in f') or a faulthandler frame ('line 3 in f').
_DYNAMIC_FRAME = re.compile(r'File "<dynamic-code>", line (\d+)(,?) in (\w+)(\n|$)', re.M)


def _with_source_lines(err, fn):
    """Point the ranks' traceback frames back at the caller's source: cloudpickle names the file of a
    function sent by value "<dynamic-code>", and the caller's code objects match them by name."""
    codes = {}

    def add(code):
        codes.setdefault(code.co_name, code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                add(const)

    main = sys.modules.get("__main__")
    for obj in [fn, *(vars(main).values() if main else [])]:
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            add(code)

    def source(match):
        number, comma, name, end = match.groups()
        code = codes.get(name)
        if code is None:
            return match.group(0)
        frame = f'File "{code.co_filename}", line {number}{comma} in {name}'
        line = linecache.getline(code.co_filename, int(number)).strip()
        return frame + (f"\n    {line}" if line and comma else "") + end

    if isinstance(err, RankTimeoutError):
        stacks = {r: _DYNAMIC_FRAME.sub(source, s) for r, s in err.stacks.items()}
        return RankTimeoutError(_DYNAMIC_FRAME.sub(source, str(err)), err.ranks, stacks)
    return RankError(_DYNAMIC_FRAME.sub(source, str(err)), rank=err.rank,
                     traceback_text=_DYNAMIC_FRAME.sub(source, err.traceback),
                     failures=err.failures)


def _wait(fn, procs, writers, workdir: str, timeout: float) -> None:
    """Until every rank has written its result (then release them all), or raise: a rank's
    failure (its peers get a moment to report theirs), or ranks still running at the
    deadline (their stacks, written by faulthandler on SIGUSR1)."""
    world_size, exits, exit_times = len(procs), {}, {}
    deadline = time.monotonic() + timeout
    first_failure = None
    while True:
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank not in exits and p.exitcode is not None:
                exits[rank], exit_times[rank] = p.exitcode, now
        done = [r for r in range(world_size) if os.path.exists(os.path.join(workdir, f"result{r}.pt"))]
        if any(c != 0 for c in exits.values()) and first_failure is None:
            first_failure = now
        if len(done) == world_size:
            for w in writers:
                w.send("release")
            for p in procs:
                p.join(timeout=10)
            return
        # Give the peers a moment to report, then stop everyone.
        if first_failure is not None and (now - first_failure > 1.0 or len(exits) == world_size):
            raise _with_source_lines(failure_error(workdir, world_size, exits, exit_times), fn)
        if now > deadline:
            hung = [r for r in range(world_size) if r not in done and r not in exits]
            for r in hung:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(0.5)  # let faulthandler write the stacks
            stacks = hang_stacks(workdir, hung)
            finished = sorted(set(range(world_size)) - set(hung))
            where = "".join(f"\n\nrank {r} was waiting in:\n{s}" for r, s in stacks.items())
            raise _with_source_lines(RankTimeoutError(
                f"ranks {hung} of {world_size} did not finish within {timeout:g} s "
                f"(finished: {finished}). A rank that skips a collective its peers entered, "
                f"or waits for a message nobody sends, hangs them all.{where}",
                ranks=hung, stacks=stacks), fn)
        alive = [p.sentinel for r, p in enumerate(procs) if r not in exits]
        multiprocessing.connection.wait(alive, timeout=0.05)


def launch(fn, world_size: int, *args, backend: str = "auto", timeout: float = 300.0,
           threads: int | None = None, quiet: bool = False, safe_results: bool = False,
           start_method: str = "forkserver", seed: int | None = None):
    """Run `fn(*args)` on `world_size` ranks with torch.distributed initialised; the ranks' return
    values, index = rank.

    `threads`: intra-op threads per rank (default: `default_threads`). `quiet=True` hides the
    ranks' output. `safe_results=True` reads results with `torch.load(weights_only=True)`, so
    ranks running untrusted code can only return tensors, numbers, strings and containers.
    `seed`: fresh entropy with None, rank r from `rank_seed(seed, r)` with an int (under
    torchrun None leaves the generators as the script set them). A CUDA tensor among `args`
    arrives on the rank's own GPU; results come back with every tensor on the CPU.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    check_seed(seed)
    if under_torchrun():
        return launch_under_torchrun(fn, world_size, args, backend, seed)
    if RANK_MARKER in os.environ:
        raise RuntimeError("launch was called inside a rank: start ranks from the caller only")
    backend = resolve_backend(backend, world_size, start_method)
    # COURSE_RANK_THREADS (see default_threads) overrides even an explicit `threads`: the
    # numerics matrix (`make numerics`) must reach every launch.
    threads = (default_threads(world_size) if os.environ.get("COURSE_RANK_THREADS")
               else threads or default_threads(world_size))
    ctx = _context(start_method)
    payload = dumps((fn, args))
    context = (dict(os.environ), os.getcwd(), list(sys.path))
    workdir = tempfile.mkdtemp(prefix="launch-")
    procs, writers = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=rank_main, name=f"rank{rank}",
                            args=(rank, world_size, payload, context, workdir, backend, threads,
                                  timeout, reader, safe_results, seed))
            with _without_main_module():
                p.start()
            reader.close()
            procs.append(p)
            writers.append(writer)
        _wait(fn, procs, writers, workdir, timeout)
        return [load_result(os.path.join(workdir, f"result{r}.pt"), r, safe_results)
                for r in range(world_size)]
    finally:
        for w in writers:
            w.close()  # a rank still waiting sees end of file and exits
        _kill_tree(procs)
        if not quiet:
            _print_logs(workdir, world_size)
        shutil.rmtree(workdir, ignore_errors=True)
