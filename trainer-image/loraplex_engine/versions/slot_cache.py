"""Published versions kept resident in spare adapter slots between the ticks that serve
them (docs/versions.md "Serving").

A version served as ``<ns>.<name>@v<N>`` or through an alias is loaded from its PEFT
directory into a free slot; after its tick it stays there, so the next request for it
decodes without loading again. Bounds:

- only free slots: training experiments, client models and Tinker samplers take a slot
  through ``MultiLoRAModel.add_adapter``, which asks :meth:`VersionSlots.reclaim` for one
  when none is free: the least recently served version not in use this tick is evicted.
  So a resident version never costs a training experiment its slot (every slot is sized
  by the memory plan at start-up: a resident version adds no memory);
- in use: the versions a tick loaded are never evicted before the tick ends
  (:meth:`release`).

Keyed by content: the adapter name holds the version's manifest ``contentHash``
(:func:`resident_name`), so an alias that moves resolves to another name (the new
version's) and a version number that names other bytes (an experiment deleted and made
again) is another entry: stale weights are never served under a name.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.spec.errors import NoCapacityError, NoFreeSlotError
from loraplex_engine.store import checkpoint as ckpt

log = logging.getLogger("loraplex_engine.versions.slots")

HASH_CHARS = 16  # of the sha256 hex digest: enough to tell any two versions apart


def resident_name(served: str, content_hash: str) -> str:
    """The adapter name a version is loaded under: its served name and content."""
    return f"{served}#{content_hash.removeprefix('sha256:')[:HASH_CHARS]}"


class VersionSlots:
    """An LRU of versions resident in spare slots; the same interface as SpareSlots
    (``load``, ``release``) so the serving tick and the Tinker samplers use either."""

    def __init__(self, model: MultiLoRAModel) -> None:
        self.model = model
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recent first
        self._in_use: set[str] = set()
        self.loads = 0  # versions read from disk into a slot
        self.hits = 0  # served from a resident slot
        model.reclaimer = self

    def resident(self) -> list[str]:
        return list(self._resident)

    def load(self, name: str, directory: Path, what: str) -> str:
        """Version ``name`` (:func:`resident_name`) resident and in use for this tick;
        NoCapacityError naming ``what`` when every slot is taken, CheckpointError when
        the directory is not a loadable adapter."""
        if name in self._resident:
            self._resident.move_to_end(name)
            self._in_use.add(name)
            self.hits += 1
            return name
        served = name.partition("#")[0]
        for other in [n for n in self._resident if n.partition("#")[0] == served]:
            self._evict(other)  # the same name with other bytes: never served again
        t = time.perf_counter()
        try:
            ckpt.load_adapter(self.model, name, directory)  # may reclaim an idle one
        except NoFreeSlotError as e:
            raise NoCapacityError(f"no spare slot to sample {what}: {e}") from e
        self._resident[name] = None
        self._in_use.add(name)
        self.loads += 1
        log.info("version %s loaded into slot %d in %.1f ms (%d resident)", name,
                 self.model.slot_of(name), 1000 * (time.perf_counter() - t),
                 len(self._resident))  # fmt: skip
        return name

    def release(self) -> None:
        """The tick is over: its versions stay resident, evictable again."""
        self._in_use.clear()

    def reclaim(self) -> bool:
        """Evict the least recently served version not in use; False when none is."""
        for name in self._resident:
            if name not in self._in_use:
                self._evict(name)
                return True
        return False

    def evictable(self) -> int:
        return len(self._resident.keys() - self._in_use)

    def _evict(self, name: str) -> None:
        del self._resident[name]
        self._in_use.discard(name)
        if name in self.model.adapters():
            self.model.remove_adapter(name)
        log.info("version %s evicted from its slot", name)
