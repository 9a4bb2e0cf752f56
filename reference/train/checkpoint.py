"""Checkpoints of the 3D GPT on torch.distributed.checkpoint (DCP), loadable by any layout.

    path = save_checkpoint("runs/ckpt", step, pm, optimizer, scheduler=sched, extra={"batch": i})
    latest = latest_checkpoint("runs/ckpt")             # runs/ckpt/step_000010, or None
    info = load_checkpoint(latest, pm, optimizer, scheduler=sched)   # {"step": 10, "extra": {...}}

Both are collective. DCP stores one folder per checkpoint (`.metadata`, the ranks' `.distcp`
files), layout-free (`reference.train.reshard`), under these keys:

    model/<name>               every parameter, under the plain GPT's name, shaped whole, and
                               every buffer state_dict saves (a router's expert_bias)
    optim/<name>/<key>         the optimizer's per-parameter state (exp_avg, exp_avg_sq, step),
                               shaped as its parameter, also under ZeRO-1/2 and FSDP
    meta/<what>                pickled bytes: step, extra, the param groups and the schedule by
                               parameter name (`checkpoint_groups`), the scaler's state_dict,
                               the layout (dp, tp, pp, ep), every rank's RNG states by global rank

Each rank writes and reads only the boxes it holds (`checkpoint_shards`), so any layout loads
any checkpoint of the same model; a load that fails part-way (a corrupt file) leaves the weights
partly loaded. A save is published atomically (`checkpoint_publish`). Checkpoints are pickles:
load only those you trust.
"""
from __future__ import annotations

import pickle
import random
import re
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from reference.runtime import device
from reference.tensor_parallel import TensorParallelRNG
from reference.train.checkpoint_groups import local_groups, merge_groups, resolve_groups
from reference.train.checkpoint_publish import (CheckpointNotPublishedError,
                                                UnwritableCheckpointDirError, agree,
                                                check_checkpoint_dir, publish)
from reference.train.checkpoint_shards import (ShardLoadPlanner, ShardSavePlanner, check_shapes,
                                               load_boxes, save_boxes)
from reference.train.reshard import load_optimizer_local_state

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "check_checkpoint",
           "check_checkpoint_dir", "CorruptCheckpointError", "CheckpointNotPublishedError",
           "UnwritableCheckpointDirError"]

_STEP = re.compile(r"^step_(\d+)$")
last_bytes: dict = {}  # this rank's last save / load: bytes handed to DCP, written, read, allocated
_META = ("step", "extra", "layout", "rng", "param_groups", "scheduler", "scaler")


class CorruptCheckpointError(RuntimeError):
    """A published checkpoint whose files are missing, cut short or unreadable."""


# ---------------------------------------------------------------------- folders
def _steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every published checkpoint in ``directory``, highest step first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _STEP.match(p.name)) and (p / ".metadata").is_file()]
    return sorted(found, reverse=True)


def latest_checkpoint(directory) -> Optional[Path]:
    """The published checkpoint of the highest step in ``directory``, or None."""
    found = _steps(Path(directory))
    return found[0][1] if found else None


def _problems(path: Path) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot load (metadata or a data file missing or short), or None."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # missing, truncated or not DCP metadata at all
        return f"its metadata cannot be read ({type(err).__name__}: {err})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"its data file {name} is missing"
        if file.stat().st_size < size:
            return f"its data file {name} holds {file.stat().st_size} bytes, the metadata needs {size}"
    return None


def check_checkpoint(path) -> int:
    """The step of checkpoint ``path``, or `CorruptCheckpointError` (naming the earlier one that
    loads) when it cannot load. Reads sizes, not data: the command line runs it before any rank."""
    path = Path(path)
    why = _problems(path)
    if why is not None:
        raise _corrupt(path, why)
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else 0


def _corrupt(path: Path, why: str) -> CorruptCheckpointError:
    """The error for a corrupt ``path``, naming the most recent earlier checkpoint that loads."""
    mine = _STEP.match(path.name)
    earlier = [p for step, p in _steps(path.parent)
               if mine and step < int(mine.group(1)) and _problems(p) is None]
    fallback = (f"the most recent earlier checkpoint that loads is {earlier[0]}" if earlier
                else f"there is no earlier checkpoint in {path.parent} that loads")
    return CorruptCheckpointError(f"checkpoint {path} is corrupt: {why}; {fallback}")


def _resolve(path: Path) -> Path:
    """A checkpoint folder itself, or the latest checkpoint of a directory of them."""
    if (_STEP.match(path.name) and path.is_dir()) or (path / ".metadata").is_file():
        return path  # a published step_* without .metadata is corrupt: reported by the caller
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint in {path} (no complete step_* folder"
                                f"{'' if path.is_dir() else '; the folder does not exist'})")
    return latest


# ---------------------------------------------------------------------- random states
def _trackers(pm) -> list[TensorParallelRNG]:
    """The tensor-parallel dropout streams of this rank's modules, each once, in module order."""
    found = {}
    for stage in pm.stages:
        for m in stage.modules():
            for v in vars(m).values():
                if isinstance(v, TensorParallelRNG):
                    found.setdefault(id(v), v)
    return list(found.values())


def _rng_state(pm) -> dict:
    state = {"torch": torch.get_rng_state(), "random": random.getstate(),
             "tensor_parallel": [t.get_state() for t in _trackers(pm)]}
    if device().type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device())
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(pm, state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    for tracker, saved in zip(_trackers(pm), state["tensor_parallel"]):
        tracker.set_state(saved)
    if "cuda" in state and device().type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device())
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])


def _layout(pm) -> dict:
    return {k: getattr(pm.mesh, k) for k in ("dp", "tp", "pp", "ep", "world_size")}


# ---------------------------------------------------------------------- save
def _write(path: Path, pm, optimizer, meta: dict) -> None:
    """Every rank writes the boxes it holds, rank 0 the meta data and .metadata."""
    boxes, scalars = save_boxes(pm, optimizer)
    dcp.save({**meta, **scalars}, checkpoint_id=str(path), planner=(planner := ShardSavePlanner(boxes)))
    last_bytes.update(handed=sum(t.nbytes for _, bs in boxes.values() for _, t in bs),
                      written=planner.written)


def _save_problem(directory: Path, step, extra) -> Optional[str]:
    """Why this rank cannot save ``step`` (a bad argument, the step already saved), or None."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step must be a non-negative int, got {step!r}"
    if extra is not None and not isinstance(extra, dict):
        return f"extra must be a dict of plain data, got {type(extra).__name__}"
    final = directory / f"step_{step:06d}"
    if final.exists():
        return f"checkpoint {final} already exists (step={step}); remove it or save another step"
    return None


def save_checkpoint(directory, step: int, pm, optimizer, *, scheduler=None, scaler=None,
                    extra: Optional[dict] = None) -> Path:
    """Save the training state after ``step`` as ``directory/step_<step>`` and return that path;
    ``extra`` is a dict of plain data (the data position, ...). Different steps, or a failed write,
    publish nothing and raise `CheckpointNotPublishedError` on every rank. RNG states are kept."""
    directory = Path(directory)
    problem = _save_problem(directory, step, extra)
    groups, scheduler_rest = {}, None
    try:  # this rank's param groups by parameter name (`reference.train.checkpoint_groups`)
        groups, scheduler_rest = local_groups(pm, optimizer, scheduler)
    except ValueError as err:
        problem = problem or str(err)
    agree(step, problem, "before writing")  # before any collective of the state's gather
    mine = _rng_state(pm)
    gathered = [None] * dist.get_world_size() if dist.is_initialized() else [(mine, groups)]
    if dist.is_initialized():
        dist.all_gather_object(gathered, (mine, groups))  # rank r's at index r
    meta = dict(step=step, extra=extra, layout=_layout(pm), rng=[r for r, _ in gathered],
                param_groups=merge_groups([g for _, g in gathered]),  # the same on every rank
                scheduler=scheduler_rest, scaler=None if scaler is None else scaler.state_dict())
    meta = {f"meta/{k}": pickle.dumps(v) for k, v in meta.items()}  # written once, by the coordinator
    final = publish(directory, step, lambda partial: _write(partial, pm, optimizer, meta))
    _set_rng_state(pm, mine)
    return final


# ---------------------------------------------------------------------- load
def _read_error(err: BaseException) -> str:
    first = next(iter(err.failures.values()))[0] if isinstance(err, dcp.CheckpointException) else err
    return f"reading it failed ({type(first).__name__}: {first})"


def load_checkpoint(path, pm, optimizer, *, scheduler=None, scaler=None) -> dict:
    """Load ``path`` (a step_* folder, or a directory: its latest) into ``pm``, ``optimizer`` (None:
    the weights only), ``scheduler`` and ``scaler``; returns {"step": ..., "extra": ...}. Under the
    layout that saved it the RNG states (torch, CUDA, random, numpy, the tensor-parallel dropout
    streams) are restored too, so training continues bit for bit; else each rank keeps its own."""
    path = _resolve(Path(path))
    check_checkpoint(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    layout = metadata.state_dict_metadata
    missing = [f"meta/{k}" for k in _META if f"meta/{k}" not in layout]
    if missing:
        raise _corrupt(path, f"it has no {', '.join(missing)}")
    tensors = {k: md.size for k, md in layout.items() if not isinstance(md, BytesStorageMetadata)}
    check_shapes(path, pm, tensors)
    try:  # the meta data first: a refusal below changes nothing
        state = {f"meta/{k}": b"" for k in _META}
        dcp.load(state, checkpoint_id=str(path), planner=ShardLoadPlanner({}))
        meta = {k: pickle.loads(state[f"meta/{k}"]) for k in _META}
    except (Exception, dcp.CheckpointException) as err:
        raise _corrupt(path, _read_error(err)) from None
    for what, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and meta[what] is None:
            raise ValueError(f"a {what} was given, but checkpoint {path} was saved without one")
    if scheduler is not None and optimizer is None:
        raise ValueError("a scheduler was given without its optimizer: its per-group state is "
                         "rebuilt for the optimizer's param groups")
    hyper, scheduler_state = meta["param_groups"], meta["scheduler"]
    if optimizer is not None:  # collective; refused on every rank alike before any data is read
        hyper, scheduler_state = resolve_groups(pm, optimizer, hyper, scheduler_state)
    boxes, scalars, finish, allocated = load_boxes(pm, optimizer, metadata)
    planner = ShardLoadPlanner(boxes)
    try:  # each rank reads the parts of the stored chunks its boxes need, in place
        dcp.load(scalars, checkpoint_id=str(path), planner=planner)
    except (Exception, dcp.CheckpointException) as err:  # bytes overwritten inside the files
        raise _corrupt(path, _read_error(err)) from None
    last_bytes.update(read=planner.read, allocated=allocated)
    if optimizer is not None:
        load_optimizer_local_state(pm, optimizer, finish(), hyper)
    if scheduler is not None:
        scheduler.load_state_dict(scheduler_state)
    if scaler is not None:
        scaler.load_state_dict(meta["scaler"])
    if meta["layout"] == _layout(pm):
        _set_rng_state(pm, meta["rng"][dist.get_rank() if dist.is_initialized() else 0])
    return {"step": meta["step"], "extra": meta["extra"]}
