"""A namespace's share of the checkpoint volume. The volume is shared by every tenant of a
pool (and every engine of it), so one tenant writing without bound (keep: 1000, every
step) would fill it and fail whoever writes next. With a quota, a write that would take
its namespace past it is refused before it starts, and fails that experiment alone.

Counted: every file under ``<root>/<namespace>/`` (all its experiments and runs, on any
engine), less what the write's own pruning frees, plus what it writes (the size of the
run's newest checkpoint, or an estimate before the first), plus the namespace's adapter
pages this engine has spilled to the volume (memory/spill.py; store/spill_quota.py keeps
the count: their files are named by hashes, outside the namespace's directory).
"""

from __future__ import annotations

import os
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
    spilled: dict[str, int] = field(default_factory=dict, compare=False)

    def used(self, root: Path, namespace: str) -> int:
        """What ``namespace`` holds on the volume: its checkpoints and its spilled pages."""
        return tree_bytes(root / namespace) + self.spilled.get(namespace, 0)

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
        if after > self.bytes_per_namespace:
            raise CheckpointQuotaError(
                f"namespace {namespace!r}'s checkpoints would take {after} bytes, over its "
                f"quota of {self.bytes_per_namespace} (serve --checkpoint-quota-bytes; "
                f"{used} used now, {self.spilled.get(namespace, 0)} of them paged-out "
                f"adapters spilled to the volume): {advice}, or delete the namespace's "
                "experiments whose checkpoints are no longer needed"
            )
