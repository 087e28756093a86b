"""Every process group the test helpers start (engines, operators), so none outlives the run.

Each child starts in its own session (its own process group), so killing the group also
ends anything it forked. Groups are killed when their owner tears down, and again at
interpreter exit; `survivors()` lets the session-finish hook in tests/conftest.py fail
the run when a test left one alive.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

_groups: dict[int, tuple[subprocess.Popen[Any], str]] = {}  # pgid -> (leader, what)


def spawn(cmd: list[str], what: str, **popen_kw: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(cmd)` in a new process group, remembered until it is gone."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kw)
    _groups[proc.pid] = (proc, what)
    return proc


def _group_alive(pgid: int) -> bool:
    """A process of group `pgid` still runs (zombies, which nothing reaps in some
    containers, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: the kernel's answer counts zombies too
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            # pid (comm) state ppid pgrp ...; comm may hold spaces: split after the ")"
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def kill_group(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """SIGKILL the leader and everything in its group; reap the leader, and wait (up to
    `timeout`) until the rest is gone too: a killed process stays runnable until the
    kernel schedules its exit, which on a loaded machine is not at once."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    while _group_alive(proc.pid):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    _groups.pop(proc.pid, None)


def survivors() -> list[str]:
    """What is still running, as `what (pid N)`; forgets the groups that are gone."""
    alive = []
    for pgid, (proc, what) in list(_groups.items()):
        proc.poll()  # reap a dead leader, so only live members keep the group
        if _group_alive(pgid):
            alive.append(f"{what} (pid {pgid})")
        else:
            _groups.pop(pgid, None)
    return alive


def kill_all() -> None:
    for proc, _ in list(_groups.values()):
        kill_group(proc, timeout=10.0)


atexit.register(kill_all)
