"""Page-in copies on a side stream, so they overlap the work queued before them
(memory/paging.py).

On CUDA a page-in's host-to-device copies (weights and both Adam moments, from pinned
pages) are issued on one side stream, after it waits for the compute stream (a slot's new
contents never race the slot's earlier readers, its reset, or the page-out that freed
it); an event recorded after the copies marks the adapter ready. The compute stream
waits on that event (``wait_event``: on the device, no host sync) right before the
adapter's rows run, so a copy overlaps the host work that follows it (the next page-ins:
reading a spill file, building views). A tick's own page-ins start after the work
queued on the compute stream before them (that includes the slot's reset). Elsewhere
(CPU) the same calls run with an inline stream: the copies are synchronous and every
adapter is ready at once.

A copy may instead wait for one point of the compute stream (``mark``: an event recorded
there), not for all of it: a prefetch (memory/prefetch.py) writes slots the running tick
does not touch, so it waits only for the point after those slots' last readers (the
tick's start) and runs under the tick's compute. The slot's reset is then issued inside
``issue`` too, on the side stream.

``CopyStats`` counts, per waited-on copy, whether it had finished by then (hidden: it ran
under earlier work) or not (exposed: the compute stream stalls on it), and the copies'
device time, for bench/paging.py's GPU run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class CopyStats:
    issued: int = 0
    hidden: int = 0  # copies already finished when their adapter was waited on
    exposed: int = 0  # copies still running then: the compute stream waits on them
    copy_seconds: list[float] = field(default_factory=list)  # device time, the recent ones


class CopyStream(Protocol):
    stats: CopyStats

    def issue(self, name: str, after: object = None) -> AbstractContextManager[None]:
        """A context: the copies made inside it are ``name``'s page-in. They start after
        the point ``after`` (from ``mark``) of the compute stream, or after everything
        queued there when None."""
        ...

    def mark(self) -> object:
        """A point of the compute stream: what is queued there now."""
        ...

    def sync(self) -> None:
        """The host waits for every copy and every kernel (before a page is read on it)."""
        ...

    def wait(self, names: Iterable[str]) -> None:
        """The compute stream waits for these adapters' copies (those not waited yet)."""
        ...

    def pending(self) -> frozenset[str]:
        """Adapters whose copies are issued and not yet waited on."""
        ...


class InlineStream:
    """No side stream (CPU): a copy is done when issued; nothing is ever pending."""

    def __init__(self) -> None:
        self.stats = CopyStats()

    @contextmanager
    def issue(self, name: str, after: object = None) -> Iterator[None]:
        yield
        self.stats.issued += 1

    def mark(self) -> object:
        return None

    def sync(self) -> None:
        return None

    def wait(self, names: Iterable[str]) -> None:
        return None

    def pending(self) -> frozenset[str]:
        return frozenset()


@dataclass
class _Copy:
    start: torch.cuda.Event
    end: torch.cuda.Event


class SideStream:
    """One CUDA side stream for every page-in of an engine's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.stats = CopyStats()
        self._issued: dict[str, _Copy] = {}
        self._waited: list[_Copy] = []  # their device time is read once they are done

    @contextmanager
    def issue(self, name: str, after: object = None) -> Iterator[None]:
        if isinstance(after, torch.cuda.Event):
            self.stream.wait_event(after)  # that point only: later kernels keep running
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        copy = _Copy(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        copy.start.record(self.stream)
        with torch.cuda.stream(self.stream):
            yield
        copy.end.record(self.stream)
        self._issued[name] = copy
        self.stats.issued += 1

    def mark(self) -> object:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def wait(self, names: Iterable[str]) -> None:
        compute = torch.cuda.current_stream(self.device)
        for name in names:
            copy = self._issued.pop(name, None)
            if copy is None:
                continue
            if copy.end.query():
                self.stats.hidden += 1
            else:
                self.stats.exposed += 1
            compute.wait_event(copy.end)
            self._waited.append(copy)
        self._collect()

    def pending(self) -> frozenset[str]:
        return frozenset(self._issued)

    def _collect(self) -> None:
        done = [c for c in self._waited if c.end.query()]
        self._waited = [c for c in self._waited if c not in done]
        self.stats.copy_seconds += [c.start.elapsed_time(c.end) / 1000 for c in done]
        del self.stats.copy_seconds[:-4096]


def for_device(device: torch.device) -> CopyStream:
    """A side stream on CUDA, the inline stream elsewhere."""
    return SideStream(device) if device.type == "cuda" else InlineStream()
