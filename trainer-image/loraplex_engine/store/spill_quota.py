"""Spilled adapter pages against their namespace's checkpoint quota (store/quota.py).

The third tier of paging (memory/spill.py) writes a paged-out adapter's page to the
checkpoint volume, which each namespace shares up to its quota. Those bytes are the
namespace's: they count against its quota as its checkpoints do, so a tenant with many
idle models cannot fill the volume through the pager that it could not fill through
checkpoints.

A spill that would take its namespace past the quota does not happen: the page stays in
host memory (the pager spills the next coldest page instead), so no tick and no other
tenant fails for it. While any page of a namespace is held so, the namespace registers no
new adapter (``check_registration``: a NamespaceShareError naming the quota, 409
``namespace_share``, refused at once rather than waited for, as its own limit), which
bounds what it holds in host memory beyond the budget by the adapters it already has.
The hold ends when the page is paged in or forgotten, or spills once the namespace has
room again (a checkpoint pruned, a model unloaded).

The spill decision runs on the tick's thread (a page-out there spills the coldest page),
so it never walks the volume: it reads the namespace's checkpoint bytes as last counted
(``CheckpointQuota.known_used``: every checkpoint write's quota check and every
registration walks and remembers them, on request threads).

Implements memory/paging.SpillGate; the pager calls it under the engine's model lock.
"""

from __future__ import annotations

from pathlib import Path

from loraplex_engine.spec.errors import NamespaceShareError
from loraplex_engine.store.quota import CheckpointQuota


class SpillQuota:
    def __init__(self, quota: CheckpointQuota, root: Path) -> None:
        self.quota, self.root = quota, root
        self._namespace: dict[str, str] = {}  # adapter name -> its namespace
        self._disk: dict[str, int] = {}  # adapter name -> bytes of its spill file
        self._held: dict[str, set[str]] = {}  # namespace -> its pages kept in host memory

    def owner(self, name: str, namespace: str | None) -> None:
        if namespace is not None:
            self._namespace[name] = namespace

    def refresh(self, namespace: str) -> None:
        """Count ``namespace``'s checkpoints and those of every namespace with pages held
        again (a walk of each: on a registering request's thread, never the tick's)."""
        for ns in {namespace, *self._held}:
            self.quota.used(self.root, ns)

    def may_spill(self, name: str, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits the namespace's quota (as last counted: no
        walk); if not it is held."""
        ns = self._namespace.get(name)
        if ns is None:
            return True
        used = self.quota.known_used(ns)
        if used is None:  # never counted (its adapters registered before the quota knew it)
            used = self.quota.spilled_bytes(ns)
        if used + nbytes <= self.quota.bytes_per_namespace:
            return True
        self._held.setdefault(ns, set()).add(name)
        return False

    def spilled(self, name: str, disk_bytes: int) -> None:
        self._release(name)
        ns = self._namespace.get(name)
        if ns is not None:
            self._disk[name] = disk_bytes
            self.quota.add_spilled(ns, disk_bytes)

    def returned(self, name: str) -> None:
        """Its page left the volume or host memory: read back, or the adapter removed."""
        self._release(name)
        ns, disk = self._namespace.get(name), self._disk.pop(name, 0)
        if ns is not None and disk:
            self.quota.remove_spilled(ns, disk)

    def forget(self, name: str) -> None:
        self.returned(name)
        self._namespace.pop(name, None)

    def check_registration(self, namespace: str) -> None:
        held = self._held.get(namespace)
        if held:
            used = self.quota.known_used(namespace)  # refresh counted it just now
            raise NamespaceShareError(
                f"namespace {namespace!r} has {len(held)} paged-out adapters that do not "
                f"fit its checkpoint quota of {self.quota.bytes_per_namespace} bytes "
                f"(serve --checkpoint-quota-bytes; {used} used now, spilled pages "
                "included): unload idle models or delete checkpoints no longer needed "
                "before registering more"
            )

    def _release(self, name: str) -> None:
        ns = self._namespace.get(name)
        held = self._held.get(ns) if ns is not None else None
        if held is not None:
            held.discard(name)
            if not held:
                del self._held[ns]
