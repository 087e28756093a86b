"""The clock cycle's gather: which client models a tick about to start should wait for,
briefly, so that their calls share it (Tinker's clock cycle; clients/models.py waits).

Only a call actually on its way is waited for: the next step of a client the last tick
served, once it holds every answer (it sends that step a round trip after fetching
them; with an answer still to fetch it has sent nothing). A tick that waits for those
(never longer than the window after the oldest queued call arrived, so a call is held at
most that long) runs them together instead of in ticks of one or two models each,
paying the tick's fixed cost once. The window runs from the oldest call the tick would
take: calls the fair share holds back (tenancy/client_share.py) wait anyway, and must not
cut a co-tenant's gather short.

An ``optim_step`` sent after its ``forward_backward`` is not waited for: the tick starts
at once and the step joins it at its step phase if it has come by then
(taking.late_steps), its round trip overlapping the forward/backward. So a tick with
nothing else possible (a lone client) starts at once.

Pure logic: no clock, no lock; the caller holds the registry's lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex_engine.clients.ops import ClientModel, Op


def waiting_on(
    models: Iterable[ClientModel], served_last: set[ClientModel], limit: int | None
) -> list[ClientModel]:
    """The models worth waiting for: among those the tick may take (the first ``limit``
    in turn that have a call queued or were served by the last client tick), each that
    the last tick served and has nothing queued yet while its client holds every answer
    (it is sending its next step)."""
    line = [m for m in models if m.queue or m in served_last]
    if limit is not None:
        line = line[:limit]
    return [m for m in line if not m.queue and m in served_last and not m.outstanding]


def oldest_call(models: Iterable[ClientModel]) -> float | None:
    """When the longest-waiting queued call arrived (its ``queued_at``), or None."""
    return min((m.queue[0].queued_at for m in models if m.queue), default=None)


def first_arrived(ops: Iterable[Op]) -> float | None:
    """When the longest-waiting of ``ops`` arrived (its ``queued_at``), or None."""
    return min((op.queued_at for op in ops), default=None)
