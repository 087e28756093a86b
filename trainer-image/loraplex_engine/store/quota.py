"""A namespace's share of the checkpoint volume. The volume is shared by every tenant of a
pool (and every engine of it), so one tenant writing without bound (keep: 1000, every
step) would fill it and fail whoever writes next. With a quota, a write that would take
its namespace past it is refused before it starts, and fails that experiment alone.

Counted: every file under ``<root>/<namespace>/`` (all its experiments and runs, on any
engine), less what the write's own pruning frees, plus what it writes (the size of the
run's newest checkpoint, or an estimate before the first), plus the namespace's adapter
pages this engine has spilled to the volume (memory/spill.py; store/spill_quota.py keeps
the count: their files are named by hashes, outside the namespace's directory).

Every walk of a namespace's directory is remembered (``known_used``), so the pager's spill
decision on the tick's thread reads the last count instead of walking the volume; the
walks themselves happen where checkpoints are written and where adapters register
(request threads). Both threads touch the counts, hence the lock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from loraplex_engine.spec.errors import CheckpointQuotaError


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed; files vanishing meanwhile,
    another engine's pruning, are skipped)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


@dataclass(frozen=True)
class CheckpointQuota:
    """``bytes_per_namespace``: what each namespace's checkpoints may take."""

    bytes_per_namespace: int
    # Bytes of each namespace's spilled adapter pages on the volume (store/spill_quota.py).
    _spilled: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    # Bytes of each namespace's directory when it was last walked.
    _walked: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def add_spilled(self, namespace: str, nbytes: int) -> None:
        with self._lock:
            self._spilled[namespace] = self._spilled.get(namespace, 0) + nbytes

    def remove_spilled(self, namespace: str, nbytes: int) -> None:
        with self._lock:
            left = self._spilled.get(namespace, 0) - nbytes
            if left > 0:
                self._spilled[namespace] = left
            else:
                self._spilled.pop(namespace, None)

    def spilled_bytes(self, namespace: str) -> int:
        with self._lock:
            return self._spilled.get(namespace, 0)

    def used(self, root: Path, namespace: str) -> int:
        """What ``namespace`` holds on the volume: its checkpoints (walked now, and
        remembered) and its spilled pages."""
        walked = tree_bytes(root / namespace)
        with self._lock:
            self._walked[namespace] = walked
            return walked + self._spilled.get(namespace, 0)

    def known_used(self, namespace: str) -> int | None:
        """``used`` as of the namespace's last walk, without walking (None: never walked)."""
        with self._lock:
            walked = self._walked.get(namespace)
            return None if walked is None else walked + self._spilled.get(namespace, 0)

    def check(
        self,
        root: Path,
        namespace: str,
        writing: int,
        freeing: Iterable[Path] = (),
        advice: str = "lower checkpoint.keep",
    ) -> None:
        """Refuse a write of ``writing`` bytes that would take ``namespace`` past its
        quota, counting the checkpoints ``freeing`` its pruning then deletes; ``advice``:
        the spec setting that bounds what is written."""
        used = self.used(root, namespace)
        after = used - sum(tree_bytes(p) for p in freeing) + writing
        if after <= self.bytes_per_namespace:  # what the namespace holds once it is written
            with self._lock:
                self._walked[namespace] = max(0, after - self._spilled.get(namespace, 0))
            return
        raise CheckpointQuotaError(
            f"namespace {namespace!r}'s checkpoints would take {after} bytes, over its "
            f"quota of {self.bytes_per_namespace} (serve --checkpoint-quota-bytes; "
            f"{used} used now, {self.spilled_bytes(namespace)} of them paged-out "
            f"adapters spilled to the volume): {advice}, or delete the namespace's "
            "experiments whose checkpoints are no longer needed"
        )
