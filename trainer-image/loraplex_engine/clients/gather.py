"""The clock cycle's gather: which client models a tick about to start should wait for,
briefly, so that their calls share it (Tinker's clock cycle; clients/models.py waits).

A Tinker client sends ``forward_backward`` and then, once that is acknowledged,
``optim_step``: a tick that starts between the two runs the ``forward_backward`` alone
and the ``optim_step`` in a tick of its own. And a client whose step the last tick
answered sends its next step a round trip later, once it has fetched the answer (a
client with an answer outstanding sends nothing yet). Both are *on their way*; a tick that
waits for them (never longer than the window after the oldest queued call arrived, so
a lone client's call is held at most that long) runs them together instead of in
ticks of one or two models each, paying the tick's fixed cost once. The window runs
from the oldest call the tick would take: calls the fair share holds back
(tenancy/client_share.py) wait anyway, and must not cut a co-tenant's gather short.

Pure logic: no clock, no lock; the caller holds the registry's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from loraplex_engine.clients.ops import TRAIN_KINDS, ClientModel, Op


def segment_open(queue: Sequence[Op]) -> bool:
    """The queue's first segment ends in a ``forward_backward`` with nothing after it:
    its ``optim_step`` (or the next ``forward_backward`` of an accumulated step) is on
    its way, and the segment would take it if it came. A ``forward`` alone, an
    ``optim_step`` or any other call is a whole segment as it stands."""
    n = 0
    while n < len(queue) and queue[n].kind in TRAIN_KINDS:
        n += 1
    return 0 < n == len(queue) and queue[-1].kind == "forward_backward"


def waiting_on(
    models: Iterable[ClientModel], served_last: set[ClientModel], limit: int | None
) -> list[ClientModel]:
    """The models worth waiting for: among those the tick may take (the first ``limit``
    in turn that have a call queued or were served by the last client tick), each whose
    segment is open, or that the last tick served and has nothing queued yet while its
    client holds every answer (it is sending its next step; with an answer still to
    fetch it cannot have sent it, so nothing of it is on its way)."""
    line = [m for m in models if m.queue or m in served_last]
    if limit is not None:
        line = line[:limit]
    return [
        m
        for m in line
        if segment_open(m.queue) or (not m.queue and m in served_last and not m.outstanding)
    ]


def oldest_call(models: Iterable[ClientModel]) -> float | None:
    """When the longest-waiting queued call arrived (its ``queued_at``), or None."""
    return min((m.queue[0].queued_at for m in models if m.queue), default=None)


def first_arrived(ops: Iterable[Op]) -> float | None:
    """When the longest-waiting of ``ops`` arrived (its ``queued_at``), or None."""
    return min((op.queued_at for op in ops), default=None)
