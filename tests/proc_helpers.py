"""Which of a set of processes still live: shared by the tests that check nothing is left."""
import time

import psutil


def alive(pids) -> list:
    """The pids that are live processes (a zombie has ended: it only waits to be reaped)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def gone(pids, within: float = 5.0) -> bool:
    """True when none of the pids is a live process within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pids):
            return True
        time.sleep(0.1)
    return False
