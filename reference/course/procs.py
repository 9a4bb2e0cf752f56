"""Leave nothing running: the process containment the grader and its runners use.

A submission can start processes meant to outlive it: `subprocess.Popen(...,
start_new_session=True)` leaves the process group, a double fork leaves the
parent. Both end up orphans, and Linux hands an orphan to its nearest ancestor
that declared itself a *child subreaper* (`prctl(PR_SET_CHILD_SUBREAPER)`), or to
init when there is none. So each runner, and the grader itself, declares itself a
subreaper: every process a submission starts stays a descendant of the runner
(or, if the runner dies first, a child of the grader), where it can be found and
killed. Killing goes round after round, because killing a parent can orphan
children that only then show up.
"""
from __future__ import annotations

import ctypes
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import threading

import psutil

__all__ = ["become_subreaper", "kill_descendants", "ChildRegistry"]

_PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux); False elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kill(procs) -> None:
    """`reference.runtime.kill_processes`, imported when something is left to kill: the runner
    that executes each submission imports this module, and should not pay for torch (which
    `reference.runtime` loads) on every notebook it runs."""
    from reference.runtime import kill_processes

    kill_processes(procs)


def kill_descendants(root: psutil.Process, keep: set | frozenset = frozenset(),
                     rounds: int = 20) -> int:
    """Kill every descendant of `root` except the pids in `keep` and their subtrees.

    Repeats until none is left (or `rounds` passes), since each kill can orphan
    grandchildren that are then re-parented here. Returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        try:
            victims = []
            for child in root.children():
                if child.pid in keep:
                    continue
                victims.append(child)
                victims += child.children(recursive=True)
        except psutil.Error:
            return killed
        if not victims:
            break
        # Stop them all first, so none can fork while its siblings are being killed.
        for v in victims:
            try:
                v.send_signal(signal.SIGSTOP)
            except psutil.Error:
                pass
        _kill(victims)
        killed += len(victims)
    return killed


def _multiprocessing_helpers() -> set:
    """Pids of the forkserver and resource tracker that `launch` starts as our children."""
    pids = set()
    for owner, attr in ((multiprocessing.forkserver, "_forkserver"),
                        (multiprocessing.resource_tracker, "_resource_tracker")):
        helper = getattr(owner, attr, None)
        for name in ("_forkserver_pid", "_pid"):
            pid = getattr(helper, name, None)
            if isinstance(pid, int):
                pids.add(pid)
    return pids


class ChildRegistry:
    """The children this process started on purpose; every other child is an orphan to kill.

    Start processes through `popen` (so they are registered before any sweep can see
    them) and `release` them when done; `sweep` kills all other children."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pids: set[int] = set()

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        with self._lock:
            proc = subprocess.Popen(*args, **kwargs)
            self._pids.add(proc.pid)
        return proc

    def release(self, proc) -> None:
        """Kill `proc`, its process group and its descendants, then forget it."""
        with self._lock:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the runner leads its own session
            except (ProcessLookupError, PermissionError):
                pass
            try:
                root = psutil.Process(proc.pid)
                kill_descendants(root)
                _kill([root])
            except psutil.Error:
                pass
            proc.wait()
            self._pids.discard(proc.pid)
            # Whatever the runner's death orphaned now hangs from us.
            kill_descendants(psutil.Process(), keep=self._pids | _multiprocessing_helpers())

    def sweep(self) -> int:
        """Kill every child that is neither registered nor a multiprocessing helper."""
        with self._lock:
            return kill_descendants(psutil.Process(),
                                    keep=self._pids | _multiprocessing_helpers())
