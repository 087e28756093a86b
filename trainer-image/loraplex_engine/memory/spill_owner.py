"""Who owns a spill directory (memory/spill.py) on a checkpoint volume that engines share.

Each engine process spills into its own ``<root>/.paged-adapters/<id>/`` and holds an
exclusive ``flock`` on ``<id>.lock`` beside it for as long as it lives. A process that dies
(``kill -9``, a lost node) releases its lock with it, so the next engine to start on the
volume finds the lock free and removes what it left: spilled pages do not survive their
process (a model's checkpoints do), and nothing grows across restarts. A live
neighbour's lock is held, so its directory is never touched.

The lock file is made locked under a temporary name and renamed into place, so every
``<id>.lock`` another engine can see is already held by its owner; a directory whose lock
file is gone has no owner (the owner makes its lock first and removes it last).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

LOCK = ".lock"
TMP = ".lock.tmp"


@dataclass
class SpillDir:
    """This process's spill directory and the open file whose lock says it is alive."""

    path: Path
    _fd: int | None

    def release(self) -> None:
        """Clean close: the pages go (they die with the process), then the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.with_name(self.path.name + LOCK).unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def base(root: Path) -> Path:
    """Under the checkpoint root; a namespace's name never starts with a dot."""
    return root / ".paged-adapters"


def _take(path: Path) -> int | None:
    """The lock of ``path``, open, if no live process holds it; else None."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def sweep(root: Path) -> list[str]:
    """Remove the spill directories no live engine owns; returns their ids."""
    where = base(root)
    if not where.is_dir():
        return []
    removed = []
    for entry in sorted(where.iterdir()):
        name = entry.name
        if not (name.endswith(LOCK) or name.endswith(TMP)):
            continue
        fd = _take(entry)
        if fd is None:
            continue
        owner = name.removesuffix(TMP).removesuffix(LOCK)
        shutil.rmtree(where / owner, ignore_errors=True)
        entry.unlink(missing_ok=True)
        os.close(fd)
        removed.append(owner)
    for entry in where.iterdir():  # directories whose lock is gone: no owner
        if entry.is_dir() and not entry.with_name(entry.name + LOCK).exists():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def claim(root: Path, attempts: int = 5) -> SpillDir:
    """A new spill directory for this process, its lock held until ``release`` or exit."""
    where = base(root)
    where.mkdir(parents=True, exist_ok=True)
    for _ in range(attempts):
        owner = uuid.uuid4().hex
        tmp = where / (owner + TMP)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, where / (owner + LOCK))  # a sweeper took it first: try again
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            continue
        (where / owner).mkdir()
        return SpillDir(where / owner, fd)
    raise OSError(f"could not claim a spill directory under {where}")
