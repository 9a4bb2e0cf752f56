"""The errors `reference.runtime.launch` raises, built from what the ranks left behind."""
from __future__ import annotations

import json
import os
import signal


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


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _signal_name(code):
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _first_line(text, limit=160):
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def failure_error(workdir, world_size, exits, exit_times):
    """Pick the cause among the failed ranks and build one RankError."""
    errors = {}
    for rank in range(world_size):
        text = read_text(os.path.join(workdir, f"error{rank}.json"))
        if text:
            errors[rank] = json.loads(text)
    silent = {r: c for r, c in exits.items() if c not in (0, None) and r not in errors}
    causes = sorted((e for e in errors.values() if not e["comm"]), key=lambda e: e["time"])
    summary = {r: f"{e['type']}: {_first_line(e['message'])}" for r, e in errors.items()}
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


def hang_stacks(workdir, ranks):
    """Where each hung rank's main thread was, innermost call first, launcher frames dropped."""
    stacks = {}
    for rank in ranks:
        frames = [line for line in read_text(os.path.join(workdir, f"stack{rank}.txt")).splitlines()
                  if line.strip().startswith("File") and "multiprocessing" not in line
                  and not line.rstrip().endswith(("in rank_main", "in <module>"))]
        if frames:
            stacks[rank] = "\n".join(frames)
    return stacks
