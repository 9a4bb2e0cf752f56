"""The runtime: start N ranks from a notebook cell, a test or a script.

    from reference.runtime import launch, device
    results = launch(fn, 4, x)     # fn(x) on 4 processes with torch.distributed ready

* `launcher`: `launch` (forkserver ranks, FileStore rendezvous, per-rank output,
  failures and hangs as one clear error, nothing left running; its docstring says why
  a fork server) and `preload` (modules every rank starts with);
* `backend`: gloo on CPU or NCCL with one GPU per rank, `device()`, threads per rank,
  and the path for ranks that torchrun started;
* `rank`: what runs inside each rank; `payload`: what travels between caller and ranks;
* `seeds`: each rank's random state; `errors`: `RankError` and `RankTimeoutError`.
"""
from reference.runtime.errors import RankError, RankTimeoutError
from reference.runtime.backend import (
    default_threads, device, init_from_env, resolve_backend, under_torchrun,
)
from reference.runtime.launcher import kill_processes, launch, preload
from reference.runtime.seeds import rank_seed

__all__ = ["launch", "preload", "RankError", "RankTimeoutError", "device", "resolve_backend",
           "init_from_env", "under_torchrun", "default_threads", "kill_processes", "rank_seed"]
