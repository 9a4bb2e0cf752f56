"""Which backend and device a rank uses (`resolve_backend`, `device`), its threads, and torchrun.

Under torchrun (one node or many, or srun torchrun) `launch` joins the process group
described in the environment instead of starting processes (`launch_under_torchrun`).
"""
from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist

from reference.runtime.rank import RANK_MARKER, process_group_backend
from reference.runtime.seeds import seed_rank

__all__ = ["default_threads", "resolve_backend", "device", "under_torchrun", "init_from_env",
           "launch_under_torchrun"]


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank: the cores shared out, at least one (more would oversubscribe them).
    ``COURSE_RANK_THREADS=n`` in the environment sets n (`make numerics` runs at 1 and 2 threads)."""
    forced = os.environ.get("COURSE_RANK_THREADS")
    if forced:
        return max(1, int(forced))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def resolve_backend(backend: str, world_size: int, start_method: str = "forkserver") -> str:
    """"auto" -> NCCL with one GPU per rank when there are at least `world_size` GPUs, else gloo.

    Counting the GPUs starts CUDA in the caller, after which no forked rank can use it: with
    ``start_method="fork"`` "auto" is gloo without asking (unless CUDA already runs here)."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if start_method == "fork" and not torch.cuda.is_initialized():
        if backend == "nccl":
            raise RuntimeError(
                "backend='nccl' cannot start ranks with start_method='fork': counting the GPUs "
                "would start CUDA in this process, and a forked rank cannot use it then. Use "
                "start_method='forkserver' (the default).")
        return "gloo"
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
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets the env:// variables)."""
    env = os.environ
    return (RANK_MARKER not in env and "RANK" in env and "WORLD_SIZE" in env
            and "MASTER_ADDR" in env)


def init_from_env(backend: str = "auto") -> tuple[int, int]:
    """Join the process group torchrun describes in the environment (under NCCL on the GPU
    LOCAL_RANK), once; returns (rank, world_size)."""
    if not dist.is_initialized():
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(process_group_backend(backend), init_method="env://")
        # A process group still alive at interpreter exit can abort in its C++
        # destructors ("terminate called without an active exception").
        atexit.register(_destroy_process_group)
    return dist.get_rank(), dist.get_world_size()


def _destroy_process_group():
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_under_torchrun(fn, world_size, args, backend, seed=None):
    """torchrun started the ranks: run fn here and share every rank's result. An int `seed` seeds
    this rank as `launch` does; with None the generators stay as the script left them."""
    rank, size = init_from_env(backend)
    if size != world_size:
        raise ValueError(f"launch asked for world_size={world_size}, but torchrun started "
                         f"WORLD_SIZE={size} ranks: pass the same number to both")
    if seed is not None:
        seed_rank(seed, rank)
    result = fn(*args)
    results = [None] * size
    dist.all_gather_object(results, result)
    return results
