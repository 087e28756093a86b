"""Adapter paging: tiers for every registered adapter, so an engine holds many more
adapters than it has slots (docs/design/paging.md).

An adapter is either *resident* (in a slot of the stacked LoRA buffers, with its AdamW
state in the optimiser's stacked moments) or *paged out*: an :class:`AdapterPage`
(memory/pages.py) in host memory, or past the host budget a file on the checkpoint volume
(memory/spill.py), holding exactly what the slot held, at the adapter's own rank (never the engine's
max rank): its weights, both Adam moments, its settings and step count, and any gradient
its client accumulated but has not stepped. Paging is copies, no arithmetic, so an
adapter paged out and in continues bit for bit as if it had stayed (the padding beyond
its rank is exactly zero in a slot, and is recreated as zeros).

The :class:`AdapterPager` keeps the resident ones in least-recently-used order. A tick
names its working set first (``ensure``): each paged-out member is paged in, evicting the
least recently used resident adapter outside the working set; an adapter the caller
marks busy (work in flight: a reward pending, a call taken) is never evicted.

Registering is bookkeeping (``add``): a new adapter takes a free slot when there is one,
else it is recorded as a :class:`FreshPage` and its first slot is made by the tick that
first needs it, so no page-out (or spill) runs on a registering request's thread.

A tick's page-ins are issued without waiting (memory/copy_stream.py: on CUDA a side
stream, an event per adapter) and the tick calls ``ready`` right before the rows run, so
the copies overlap the work before them; every other page-in waits at once. After a
tick's compute is issued, memory/prefetch.py pages the next tick's likely members into
slots this tick does not touch, on the side stream, waiting only for the tick's start.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Protocol

from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.memory import spill
from loraplex_engine.memory.copy_stream import CopyStream, for_device
from loraplex_engine.memory.pages import (
    AdapterPage,
    FreshPage,
    HoldsGrads,
    compact_grads,
    expand_grads,
    host_copy,
)
from loraplex_engine.memory.spill_owner import SpillDir
from loraplex_engine.spec.errors import NoFreeSlotError, UnknownAdapterError, UsageError
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW

# Registered adapters per slot when --max-registered is not given and paging can run.
DEFAULT_REGISTERED_PER_SLOT = 64


def registered_limit(slots: int, configured: int | None, supported: bool) -> int:
    """How many adapters an engine registers: ``--max-registered``, by default 64 per
    slot where paging runs (one rank decoding with the trainer's weights, the sync
    tick: a page-in is a copy into the slot every forward reads), else the slots."""
    if configured is None:
        return slots * DEFAULT_REGISTERED_PER_SLOT if supported else slots
    if configured < slots:
        raise UsageError(f"--max-registered {configured} is below --max-adapters {slots}")
    if configured > slots and not supported:
        raise UsageError(
            "--max-registered above --max-adapters pages adapters, which needs one rank, "
            "the torch rollout and --schedule sync"
        )
    return configured


class SpillGate(Protocol):
    """Whose quota a spilled page counts against (store/spill_quota.py)."""

    def owner(self, name: str, namespace: str | None) -> None: ...
    def refresh(self, namespace: str) -> None: ...
    def may_spill(self, name: str, nbytes: int) -> bool: ...
    def spilled(self, name: str, disk_bytes: int) -> None: ...
    def returned(self, name: str) -> None: ...
    def forget(self, name: str) -> None: ...
    def check_registration(self, namespace: str) -> None: ...


@dataclass
class PagingStats:
    page_ins: int = 0
    page_outs: int = 0
    spills: int = 0  # pages written to the third tier (memory/spill.py)
    first_slots: int = 0  # fresh pages given their first slot (not counted as page-ins)
    prefetches: int = 0  # page-ins issued ahead, during the previous tick (memory/prefetch.py)
    prefetch_hits: int = 0  # members a tick found resident because they were prefetched
    prefetch_misses: int = 0  # members a tick had to page in itself
    prefetch_wasted: int = 0  # prefetched, and not a member of the next tick
    page_in_seconds: list[float] = field(default_factory=list)  # the most recent ones
    page_out_seconds: list[float] = field(default_factory=list)

    def record(self, into: list[float], seconds: float) -> None:
        into.append(seconds)
        del into[:-4096]  # a bounded window: percentiles of the recent ones


class AdapterPager:
    """The resident adapters it manages, in LRU order, and the pages of the others.
    The caller holds the engine's model lock around every call."""

    def __init__(
        self,
        model: MultiLoRAModel,
        optimizer: PerAdapterAdamW,
        max_registered: int,
        host_budget: int | None = None,
        spill_dir: SpillDir | None = None,
        gate: SpillGate | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.max_registered = max_registered
        # Past this many host bytes of pages, the coldest go to files in spill_dir
        # (memory/spill.py, the third tier); None: host memory only.
        self.host_budget, self.spill_dir = host_budget, spill_dir
        self.gate = gate  # a spill past its namespace's quota keeps the page in host memory
        self.device = next(iter(model.lora_layers.values())).lora_A.device
        self.pin = self.device.type == "cuda"
        self.copies: CopyStream = for_device(self.device)  # page-ins' copies (a side stream)
        self.overlap = True  # a tick's page-ins wait at ``ready``, not each at once
        self.pages: dict[str, AdapterPage | spill.SpilledPage | FreshPage] = {}  # oldest first
        self._fresh = 0  # of the pages, those never in a slot (FreshPage)
        self._resident: OrderedDict[str, None] = OrderedDict()  # LRU first
        self._holders: dict[str, HoldsGrads] = {}
        self.busy: set[str] = set()  # this tick's working set: never evicted
        self.stats = PagingStats()
        self._host_bytes = 0
        # The pages in host memory, paged out longest ago first: what spills next, found
        # without walking the (mostly spilled) pages of ten thousand adapters.
        self._in_host: OrderedDict[str, None] = OrderedDict()
        # The tick's start on the compute stream (``ensure``), the slots free then, and
        # the pages made since (their device-to-host copies are queued after that point):
        # what a prefetch may write without waiting for the tick (memory/prefetch.py).
        self.ticking = False  # between ``ensure`` and ``release``
        self.tick_start: object | None = None
        self.free_at_start: frozenset[int] = frozenset()
        self.paged_out_in_tick: set[str] = set()
        self.prefetched: set[str] = set()  # issued for the next tick, not yet waited
        self.prefetch_limit: int | None = None  # None: the slots; 0: no prefetch

    # ---- the registry ------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.max_registered > self.model.max_adapters

    def has_room(self) -> bool:
        """One more adapter may register: under --max-registered when paging, else a
        slot is free or can be freed (lora/model.py)."""
        if not self.enabled:
            return self.model.has_room()
        return self.registered() < self.max_registered

    def registered(self) -> int:
        return len(self._resident) + len(self.pages)

    def check_registration(self, namespace: str) -> None:
        """Refuse a new adapter of ``namespace`` while its pages are held in host memory
        for want of quota (store/spill_quota.py)."""
        if self.gate is not None:
            self.gate.refresh(namespace)  # the volume walked here, never on the tick
            self._spill_coldest()  # a held page spills now if its namespace made room
            self.gate.check_registration(namespace)

    def register(
        self, name: str, holder: HoldsGrads | None = None, namespace: str | None = None
    ) -> None:
        """A resident adapter (just added to the model and optimiser) is now pageable;
        its spilled page counts against ``namespace``'s quota."""
        self._resident[name] = None
        self._own(name, holder, namespace)

    def add(
        self,
        name: str,
        config: LoRAConfig,
        seed: int | None,
        settings: AdamWSettings,
        holder: HoldsGrads | None = None,
        namespace: str | None = None,
    ) -> None:
        """A new adapter: into a free slot when one is (or a cached version gives its slot
        back), else a fresh page that its first tick pages in. No page-out here: this runs
        on the registering request's thread. Raises as ``model.add_adapter`` does."""
        self.model.check_config(config)
        if self.enabled and not self.model.free_slots(reclaim=True):
            if name in self.pages or name in self._resident:
                raise UsageError(f"adapter {name!r} is already registered")
            self.pages[name] = FreshPage(name, config, seed, settings)
            self._fresh += 1
            self._own(name, holder, namespace)
            return
        self.model.add_adapter(name, config, seed=seed)
        self.optimizer.add_adapter(name, settings)
        self.register(name, holder, namespace)

    def discard(self, name: str) -> None:
        """Undo a registration: its slot (if it has one), its page, its bookkeeping."""
        self.copies.wait([name])  # a prefetch's copies land before the slot is cleared
        self.prefetched.discard(name)
        if self.optimizer.has_adapter(name):
            self.optimizer.remove_adapter(name)
        if name in self.model.adapters():
            self.model.remove_adapter(name)
        self.forget(name)

    def _own(self, name: str, holder: HoldsGrads | None, namespace: str | None) -> None:
        if self.gate is not None:
            self.gate.owner(name, namespace)
        if holder is not None:
            self._holders[name] = holder

    def forget(self, name: str) -> None:
        """It was removed: its page (if any) goes too."""
        self._resident.pop(name, None)
        page = self.pages.pop(name, None)
        self._in_host.pop(name, None)
        if isinstance(page, AdapterPage):
            self._host_bytes -= page.nbytes()
        elif isinstance(page, FreshPage):
            self._fresh -= 1
        elif page is not None:
            spill.remove(page)
        self._holders.pop(name, None)
        if self.gate is not None:
            self.gate.forget(name)

    def is_paged(self, name: str) -> bool:
        return name in self.pages

    def touch(self, name: str) -> None:
        if name in self._resident:
            self._resident.move_to_end(name)

    def host_bytes(self) -> int:
        return self._host_bytes  # kept as pages come and go: read from request threads

    def capacity_fields(self) -> dict[str, int]:
        """What the engine's capacity report (spec/api_types.Capacity) says of paging."""
        stats = self.stats
        return {
            "max_registered": self.max_registered,
            "paged_adapters": len(self.pages),
            "spilled_adapters": self.spilled(),
            "paged_host_bytes": self.host_bytes(),
            "page_ins": stats.page_ins,
            "page_outs": stats.page_outs,
        }

    # ---- the tiers ---------------------------------------------------------------------

    def page_out(self, name: str, spill_now: bool = True) -> AdapterPage:
        """Copy the adapter's slot to the host and free the slot (on the current stream:
        a prefetch's side stream when it evicts). ``spill_now``: past the host budget
        the coldest pages spill here, else at the next tick's start."""
        if name not in self._resident:
            raise UnknownAdapterError(f"no resident pageable adapter named {name!r}")
        self.copies.wait([name])  # its slot is read below: its own page-in comes first
        start = time.perf_counter()
        model, opt = self.model, self.optimizer
        config = model.config_of(name)
        holder = self._holders.get(name)
        slot = model.slot_of(name)
        page = AdapterPage(
            name=name,
            config=config,
            weights=host_copy(model.adapter_views(name), self.pin),
            settings=opt.settings[slot],
            step=opt.step_count(name),
            exp_avg=host_copy(model.adapter_views(name, opt.exp_avg.__getitem__), self.pin),
            exp_avg_sq=host_copy(model.adapter_views(name, opt.exp_avg_sq.__getitem__), self.pin),
            grads=None if holder is None or holder.grads is None
            else compact_grads(model, config, holder.grads),
        )  # fmt: skip
        if page.grads is not None and holder is not None:
            holder.grads = None
        opt.remove_adapter(name)
        model.remove_adapter(name)
        del self._resident[name]
        self.pages[name] = page
        self._in_host[name] = None
        self._host_bytes += page.nbytes()
        self.paged_out_in_tick.add(name)
        if name in self.prefetched:  # evicted before any tick used it
            self.prefetched.discard(name)
            self.stats.prefetch_wasted += 1
        if spill_now:
            self._spill_coldest()
        self.stats.page_outs += 1
        self.stats.record(self.stats.page_out_seconds, time.perf_counter() - start)
        return page

    def page_in(self, name: str, wait: bool = True) -> int:
        """Put a paged-out adapter back into a slot (evicting the least recently used
        adapter not busy when none is free); returns the slot. Resident: a touch.
        ``wait``: the compute stream waits for the copies now, else at ``ready``."""
        if name not in self.pages:
            if name not in self._resident:
                raise UnknownAdapterError(f"no pageable adapter named {name!r}")
            if wait:  # prefetched: its copies land before the caller reads the slot
                self.copies.wait([name])
            self.touch(name)
            return self.model.slot_of(name)
        if not self.make_room(self.busy | {name}):
            raise NoFreeSlotError(
                f"all {self.model.max_adapters} adapter slots hold adapters with work in flight"
            )
        return self.fill(name, wait)

    def fill(self, name: str, wait: bool, side: bool = False, evict: str | None = None) -> int:
        """Page ``name`` in: into a free slot, its reset and grads on the compute stream.
        ``side`` (a prefetch, during a tick): everything that touches the slot
        (``evict``'s page-out, the reset, the copies) is issued on the copy stream, after
        the tick's start only (``tick_start``: that slot's last reader ran before it)."""
        held = self.pages[name]
        start = time.perf_counter()
        page = held if isinstance(held, (FreshPage, AdapterPage)) else spill.read(held)
        try:
            with self.copies.issue(name, self.tick_start) if side else nullcontext():
                if evict is not None:
                    self.page_out(evict, spill_now=False)
                if isinstance(page, FreshPage):
                    return self._first_slot(page)
                slot = self.model.add_adapter(name, page.config, seed=0)
                self._restore(page, side)
            self._restore_grads(page)
        except BaseException:  # the page stays the adapter's copy: nothing is lost
            if side:  # no copy may land in the slot once it is freed
                self.copies.sync()
            else:
                self.copies.wait([name])
            if self.optimizer.has_adapter(name):
                self.optimizer.remove_adapter(name)
            if name in self.model.adapters():
                self.model.remove_adapter(name)
            raise
        del self.pages[name]
        self._in_host.pop(name, None)
        if held is page:
            self._host_bytes -= page.nbytes()
        else:
            spill.remove(held)
        if self.gate is not None:
            self.gate.returned(name)
        self._resident[name] = None
        if wait:
            self.copies.wait([name])
        self.stats.page_ins += 1
        self.stats.record(self.stats.page_in_seconds, time.perf_counter() - start)
        return slot

    def _first_slot(self, page: FreshPage) -> int:
        """A fresh page's first slot (room made by the caller): its seeded initial weights,
        as registering it in a free slot would have made them."""
        name = page.name
        slot = self.model.add_adapter(name, page.config, seed=page.seed)
        self.optimizer.add_adapter(name, page.settings)
        del self.pages[name]
        self._fresh -= 1
        self._resident[name] = None
        self.stats.first_slots += 1
        return slot

    def _spill_coldest(self) -> None:
        """Past the host budget, the pages paged out longest ago go to files; one its
        namespace's quota has no room for stays (the gate holds it)."""
        if self.host_budget is None or self.spill_dir is None:
            return
        synced = not self.pin
        for name in list(self._in_host):
            if self._host_bytes <= self.host_budget:
                return
            page = self.pages[name]
            assert isinstance(page, AdapterPage)
            if self.gate is not None and not self.gate.may_spill(name, page.nbytes()):
                continue
            if not synced:  # a page-out's copies to pinned memory may still be running
                self.copies.sync()
                synced = True
            del self._in_host[name]
            written = spill.write(page, self.spill_dir.path)
            self.pages[name] = written
            self._host_bytes -= page.nbytes()
            self.stats.spills += 1
            if self.gate is not None:
                self.gate.spilled(name, written.disk_bytes)

    def close(self) -> None:
        if self.spill_dir is not None:  # spilled pages die with the process
            self.spill_dir.release()

    def fresh(self) -> int:
        """Registered adapters that have never had a slot (FreshPage)."""
        return self._fresh

    def spilled(self) -> int:
        # read from request threads
        return max(0, len(self.pages) - len(self._in_host) - self._fresh)

    def _restore(self, page: AdapterPage, issued: bool = False) -> None:
        name = page.name
        # Weights and moments: host-to-device copies only (``issued``: already inside
        # the copy stream's context).
        with nullcontext() if issued else self.copies.issue(name):
            self.model.load_adapter_state_dict(name, page.weights)
            self.optimizer.load_state_dict(name, {
                "settings": asdict(page.settings), "step": page.step,
                "exp_avg": page.exp_avg, "exp_avg_sq": page.exp_avg_sq,
            })  # fmt: skip

    def _restore_grads(self, page: AdapterPage) -> None:
        """A gradient is allocated and used on the compute stream (never the copy
        stream's: the allocator would reuse its memory there), ordered as before."""
        name = page.name
        holder = self._holders.get(name)
        if holder is not None and page.grads is not None:
            like = (p.data for p in self.optimizer.params)
            holder.grads = expand_grads(self.model, page.config, page.grads, like)

    def make_room(self, keep: set[str] | frozenset[str] = frozenset()) -> bool:
        """A free slot, by reclaiming a cached version (lora/model.py's reclaimer) or
        paging out the least recently used adapter not in ``keep``; False if none can go."""
        if self.model.free_slots(reclaim=True) or not self.enabled:
            return bool(self.model.free_slots())
        victim = next((n for n in self._resident if n not in keep), None)
        if victim is None:
            return False
        self.page_out(victim)
        return True

    def ensure(self, names: Iterable[str], busy: Iterable[str] = ()) -> None:
        """A tick's working set: every one of ``names`` resident (and most recently used),
        none of them nor of ``busy`` evicted to make room. The caller sized the set to the
        slots; ``release`` ends the tick's hold."""
        wanted = [n for n in dict.fromkeys(names) if n in self.pages or n in self._resident]
        self.busy = set(wanted) | set(busy)
        self._count_prefetches(wanted)
        self._spill_coldest()  # what the previous tick's prefetch left past the budget
        self.ticking, self.tick_start = True, self.copies.mark()  # every slot's earlier readers
        self.free_at_start = frozenset(self.model.free_slots())
        self.paged_out_in_tick = set()
        for name in wanted:
            self.page_in(name, wait=not self.overlap)
            self.touch(name)

    def ready(self, names: Iterable[str]) -> None:
        """Right before these adapters' rows run: the compute stream waits for their
        page-ins' copies (issued by ``ensure``; on CPU they are done already)."""
        self.copies.wait(names)

    def _count_prefetches(self, wanted: list[str]) -> None:
        if self.prefetched:
            hits = self.prefetched.intersection(wanted)
            self.stats.prefetch_hits += len(hits)
            self.stats.prefetch_wasted += len(self.prefetched) - len(hits)
            self.prefetched = set()
        self.stats.prefetch_misses += sum(n in self.pages for n in wanted)

    def release(self) -> None:
        # A failed tick's copies: none left loose (a prefetch's wait for the next tick).
        self.copies.wait(self.copies.pending() - self.prefetched)
        self.busy = set()
        self.ticking, self.tick_start = False, None

    def in_flight(self, name: str) -> bool:
        """Work in flight on a resident adapter: this tick's, or a gradient accumulated
        and not yet stepped (a client's forward_backward awaiting its optim_step)."""
        holder = self._holders.get(name)
        return name in self.busy or (holder is not None and holder.grads is not None)

    def resident_pageable(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return list(self._resident)
