"""The runtime: start N ranks from a notebook cell, a test or a script.

    from reference.runtime import launch, device
    results = launch(fn, 4, x)     # fn(x) on 4 processes with torch.distributed ready

Where each part lives:

* `reference.runtime.launcher`: `launch` (forkserver ranks with a cloudpickle
  payload, FileStore rendezvous, per-rank output, failures and hangs as one clear
  error, nothing left running) and `preload` (modules every rank starts with);
* `reference.runtime.backend`: the backend choice (`resolve_backend`: gloo on CPU,
  NCCL with one GPU per rank), `device()`, the device of this rank, threads per
  rank, and the torchrun path;
* `reference.runtime.rank`: what runs inside each rank (its log, its device and
  seed, its process group, its result or its error record);
* `reference.runtime.payload`: what travels between caller and ranks (the
  cloudpickle payload out, CUDA tensors landing on the rank's own GPU; the
  results back, read onto the CPU);
* `reference.runtime.seeds`: each rank's random state, fresh entropy or
  `launch(..., seed=s)` (rank r seeded with `rank_seed(s, r)`);
* `reference.runtime.errors`: `RankError` and `RankTimeoutError`, built from what
  the ranks left behind.

`launcher`'s docstring says why the ranks are forked from a fork server rather
than spawned or forked from the caller.
"""
from reference.runtime.errors import RankError, RankTimeoutError
from reference.runtime.backend import (
    default_threads, device, init_from_env, resolve_backend, under_torchrun,
)
from reference.runtime.launcher import kill_processes, launch, preload
from reference.runtime.seeds import rank_seed

__all__ = [
    "launch", "preload", "RankError", "RankTimeoutError", "device", "resolve_backend",
    "init_from_env", "under_torchrun", "default_threads", "kill_processes", "rank_seed",
]
