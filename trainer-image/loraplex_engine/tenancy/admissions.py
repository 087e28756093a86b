"""One admission per experiment id at a time.

Admitting an experiment may take minutes: a dataset from object storage is read into the
engine's spool by a bounded reader process (data/spool.py, up to ``READ_TIMEOUT_S``).
The operator's PUT gives up long before that (its engine timeout, 30 s) and retries
every round. Without this, each retry would start another reader of the same dataset
while the first still runs: one tenant's big dataset multiplying into readers that take
its neighbours' CPU and memory. With it, a retry waits for the admission in flight and
then finds the experiment loaded (200), or builds it itself if that one failed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class KeyedLocks:
    """A lock per key, held by one thread at a time, forgotten when nobody holds or
    waits for it (so the table does not grow with every experiment id ever seen)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def users(self, key: str) -> int:
        """Threads holding or waiting for ``key``'s lock."""
        with self._guard:
            return self._locks.get(key, (None, 0))[1]

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)
