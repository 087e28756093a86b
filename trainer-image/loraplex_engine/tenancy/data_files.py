"""Opening a tenant's dataset file without following links (issue 26).

Checking a path and then opening it by name leaves a window: the file can be swapped for a
symlink to another tenant's file in between. So the allowed directory
(``<data root>/<namespace>``) is opened once, at admission, and the file is reached from
that descriptor one path component at a time, each opened with ``O_NOFOLLOW`` relative to
the previous one: no symlink is followed anywhere below the directory, whatever changes in
the meantime. Every read then goes through the descriptor (``fstat``, ``pread``), never the
name. A file with more than one hard link is refused unless the pool allows it: a hard link
is another name for a file that may live outside the directory.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from loraplex_engine.spec.errors import TaskError

FIELD = "spec.task.dataset"
# O_NONBLOCK: opening a FIFO planted under the name would otherwise block the tick for ever.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY
_LINK_ERRORS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)  # a symlink met with O_NOFOLLOW


class DataFile:
    """``parts`` (the file's path below ``base``), opened only beneath ``base``.

    ``shown``: the name errors use (the tenant's own path). The directory descriptor is
    held until :meth:`close`."""

    def __init__(
        self, base: Path, parts: tuple[str, ...], shown: str, *, allow_hard_links: bool = False
    ) -> None:
        if not parts or any(p in ("", ".", "..") or "/" in p for p in parts):
            raise TaskError(FIELD, f"dataset {shown!r} is not allowed")
        self.parts = parts
        self.shown = shown
        self.allow_hard_links = allow_hard_links
        try:
            self.dir_fd: int | None = os.open(base, _DIR_FLAGS)
        except OSError as e:
            raise self._error(e) from None

    def open(self) -> tuple[int, os.stat_result]:
        """A new read-only descriptor of the file and its ``fstat``; TaskError if a link
        is met on the way, or it is not a regular file, or it has several hard links."""
        if self.dir_fd is None:
            raise TaskError(FIELD, f"dataset {self.shown!r} is closed")
        return open_beneath(self.dir_fd, self.parts, self.shown, self.allow_hard_links)

    def _error(self, e: OSError) -> TaskError:
        return _error(e, self.shown)

    def close(self) -> None:
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None


def open_beneath(
    dir_fd: int, parts: tuple[str, ...], shown: str, allow_hard_links: bool = False
) -> tuple[int, os.stat_result]:
    """``parts`` below the directory ``dir_fd``, each component opened relative to the one
    before without following a link; the file's descriptor and ``fstat``. TaskError if a
    link is met, or it is not a regular file, or it has several hard links (unless
    ``allow_hard_links``). Also the dataset reader's (data/child.py), which inherits
    ``dir_fd`` and opens a saved dataset's files by the names its state.json gives."""
    if not parts or any(p in ("", ".", "..") or "/" in p for p in parts):
        raise TaskError(FIELD, f"dataset {shown!r} is not allowed")
    fd = dir_fd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            opened = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = opened
    except OSError as e:
        if fd != dir_fd:
            os.close(fd)
        raise _error(e, shown) from None
    try:
        st = os.fstat(fd)
        _check(st, shown, allow_hard_links)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _check(st: os.stat_result, shown: str, allow_hard_links: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise TaskError(FIELD, f"dataset {shown!r} is not a regular file")
    if st.st_nlink > 1 and not allow_hard_links:
        raise TaskError(
            FIELD,
            f"dataset {shown!r} has {st.st_nlink} hard links: refused, as a hard "
            "link can give another tenant's file a name here (unless the pool allows it: "
            "serve --allow-dataset-hard-links)",
        )


def _error(e: OSError, shown: str) -> TaskError:
    if e.errno == errno.ENOENT:
        return TaskError(FIELD, f"dataset file {shown!r} does not exist")
    if e.errno in _LINK_ERRORS:
        return TaskError(FIELD, f"dataset {shown!r} is not allowed: a symbolic link")
    return TaskError(FIELD, f"dataset {shown!r} cannot be opened ({e.strerror})")


def beneath(path: Path, base: Path | None) -> tuple[Path, tuple[str, ...]]:
    """The directory to open and the components below it: ``base`` (allowed directory)
    and ``path`` relative to it; without a base (no trust boundary: tests, one user) the
    file's own resolved directory."""
    if base is None:
        resolved = path.resolve(strict=False)
        return resolved.parent, (resolved.name,)
    try:
        return base, path.relative_to(base).parts
    except ValueError:
        raise TaskError(FIELD, f"dataset {str(path)!r} is not allowed") from None
