"""Prefetch: page the next tick's likely members in while this tick computes
(docs/design/paging.md).

After a training tick's compute is issued, before its calls are answered, the engine
names the client models that still have calls queued (clients/line.py's index, in turn
order): the next tick's likely set. Those paged out are paged in (``pager.fill`` with
``side``) into slots this tick does not touch: a slot free since the tick began, else the
slot of the least recently used resident adapter outside the tick's set with no work in
flight and not itself wanted. Such a slot's last reader ran before the tick began, so
its copies (and the evicted adapter's page-out, and the slot's reset) wait only for the
tick's start (``pager.tick_start``) and run under the tick's compute, on CUDA. The next
tick finds them resident; its ``ready`` waits on their events. A wrong guess is one
more least recently used resident; at most ``limit`` page-ins a tick are spent on them.

A slot freed during the tick (a sample call's spare adapter, an unload) may still be
read or cleared by the tick's kernels, so prefetch stops when one is free: it writes
only slots whose every reader precedes the tick's start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from loraplex_engine.memory.paging import AdapterPager

log = logging.getLogger(__name__)


def prefetch(pager: AdapterPager, likely: Iterable[str], samples: bool = False) -> list[str]:
    """Page in the paged-out ones of ``likely`` (the next tick's, most likely first) on
    the copy stream; returns those issued. ``samples``: this tick ran sample calls (a
    spare adapter may have used a free slot), so no slot is known quiet."""
    if not pager.ticking or not pager.enabled or samples:
        return []
    limit = pager.model.max_adapters if pager.prefetch_limit is None else pager.prefetch_limit
    wanted = list(dict.fromkeys(likely))
    keep = pager.busy | set(wanted) | pager.copies.pending()
    chosen = [
        n for n in wanted if pager.is_paged(n) and n not in pager.busy
        and n not in pager.paged_out_in_tick  # its page's copies are queued after the start
    ][:limit]  # fmt: skip
    issued: list[str] = []
    for name in chosen:
        free = pager.model.free_slots()
        if not set(free) <= pager.free_at_start:
            break  # a slot freed during the tick: add_adapter would take it first
        victim = None if free else _victim(pager, keep)
        if not free and victim is None:
            break
        try:
            pager.fill(name, wait=False, side=True, evict=victim)
        except Exception:  # a prefetch never fails the tick: its page stays as it was
            log.exception("prefetching adapter %r failed", name)
            break
        pager.prefetched.add(name)
        pager.stats.prefetches += 1
        keep.add(name)
        issued.append(name)
    return issued


def _victim(pager: AdapterPager, keep: set[str]) -> str | None:
    """The least recently used resident adapter that may leave now."""
    return next(
        (n for n in pager.resident_pageable() if n not in keep and not pager.in_flight(n)), None
    )
