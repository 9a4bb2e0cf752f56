"""The atomic publish of a checkpoint, agreed by every rank (`reference.train.checkpoint`).

    agree(step, problem, "before writing")    # every rank: the same step, no problem
    publish(directory, step, write)           # write(partial) on every rank, then step_<step>

A save writes `.step_000010.partial` and renames it to `step_000010` (`os.replace` of a folder:
no half-written `step_000010` ever exists) only when every rank agrees twice, with one
`all_gather_object` of a (step, error) pair per rank: before writing (the same step, no problem
such as an existing step_<step>) and after (no rank's `dcp.save` raised; a failed rank still
takes part, so none waits at a barrier). Otherwise the partial folder is cleared and every rank
raises the same `CheckpointNotPublishedError`, naming each rank's step and error. A save killed
part-way leaves a partial folder, which `latest_checkpoint` ignores and the next save clears.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["CheckpointNotPublishedError", "agree", "publish", "describe_error",
           "UnwritableCheckpointDirError", "check_checkpoint_dir"]


class CheckpointNotPublishedError(RuntimeError):
    """The ranks did not agree on a save: nothing was published. Raised on every rank alike."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def describe_error(err: BaseException) -> str:
    """One line for ``err``; DCP's CheckpointException names each failed rank's own error."""
    if isinstance(err, dcp.CheckpointException):
        parts = []
        for rank, failure in sorted(err.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "dcp.save failed (" + "; ".join(parts) + ")"
    return "".join(traceback.format_exception_only(type(err), err)).strip()


def agree(step, error: Optional[str], when: str) -> None:
    """Collective: raise `CheckpointNotPublishedError` on every rank unless all ranks give the
    same ``step`` and ``error`` None; ``when`` is "before writing" or "after writing"."""
    pairs = [(step, error)]
    if dist.is_initialized():
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, (step, error))
    steps = sorted({repr(s) for s, _ in pairs})
    if len(steps) == 1 and all(e is None for _, e in pairs):
        return
    lines = []
    if len(steps) > 1:
        by_step = {}
        for rank, (s, _) in enumerate(pairs):
            by_step.setdefault(repr(s), []).append(rank)
        lines.append("the ranks passed different steps: " + "; ".join(
            f"step {s} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
            for s, r in by_step.items()))
    errors = [(rank, s, e) for rank, (s, e) in enumerate(pairs) if e is not None]
    if len(errors) == len(pairs) > 1 and len({(s, e) for _, s, e in errors}) == 1:
        lines.append(f"every rank (step {errors[0][1]!r}): {errors[0][2]}")  # DCP's shared error
    else:
        lines += [f"rank {rank} (step {s!r}): {e}" for rank, s, e in errors]
    raise CheckpointNotPublishedError(f"checkpoint not published ({when}; nothing was "
                                      f"renamed to step_*): " + "; ".join(lines))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)


def _broadcast_outcome(error: Optional[str]) -> Optional[str]:
    """Rank 0's ``error`` (None: success) on every rank."""
    box = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def publish(directory: Path, step: int, write: Callable[[Path], None]) -> Path:
    """Collective, after `agree` on ``step``: ``write(partial)`` on every rank, agree, rename the
    partial folder to ``directory/step_<step>`` and return it; else `CheckpointNotPublishedError`."""
    final = directory / f"step_{step:06d}"
    partial = directory / f".{final.name}.partial"
    error = None
    if _rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a save that was killed: never published, never read
                shutil.rmtree(partial)
            partial.mkdir()
        except OSError as err:
            error = describe_error(err)
    error = _broadcast_outcome(error)  # every rank waits until the folder exists
    if error is not None:
        raise CheckpointNotPublishedError(f"checkpoint not published: rank 0 could not create "
                                          f"{partial}: {error}")
    try:
        write(partial)  # every rank writes its share, rank 0 .metadata
        mine = None
    except (Exception, dcp.CheckpointException) as err:  # CheckpointException is a BaseException
        mine = describe_error(err)
    try:
        agree(step, mine, "after writing")
    except CheckpointNotPublishedError:
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # never published: nobody will read it
        _broadcast_outcome(None)  # the partial folder is gone when any rank raises
        raise
    outcome = None
    if _rank() == 0:
        try:
            os.replace(partial, final)  # the publish: one atomic rename, nothing written after
            _fsync_dir(directory)
        except OSError as err:
            outcome = describe_error(err)
    outcome = _broadcast_outcome(outcome)
    if outcome is not None:
        raise CheckpointNotPublishedError(f"checkpoint not published: rank 0 could not rename "
                                          f"{partial} to {final}: {outcome}")
    return final


class UnwritableCheckpointDirError(RuntimeError):
    """A checkpoint folder that cannot be created, or that this user may not write into."""


def check_checkpoint_dir(directory) -> None:
    """Raise `UnwritableCheckpointDirError` (one line) when no save could write into ``directory``;
    where the permission bits allow the write (as they always do for root), a real probe decides."""
    directory = Path(directory)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            raise UnwritableCheckpointDirError(
                f"checkpoint.dir {directory} cannot be created: {existing} is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        what = "cannot be created" if existing != directory else "cannot be used"
        kind = "a file" if existing.is_file() else "something else"
        raise UnwritableCheckpointDirError(
            f"checkpoint.dir {directory} {what}: {existing} is {kind}, not a folder")
    verb = "write into it" if existing == directory else f"write into {existing}, where it would be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UnwritableCheckpointDirError(
            f"checkpoint.dir {directory} is not writable: no permission to {verb}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as err:
        raise UnwritableCheckpointDirError(
            f"checkpoint.dir {directory} is not writable: could not {verb} "
            f"({err.strerror or type(err).__name__})") from None
