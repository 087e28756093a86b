"""A tick's client work as the fair share sees it (tenancy/client_share.py): every
namespace's queued calls as lanes of priced items, and the taken items back as the
segments and samples a :class:`~loraplex_engine.clients.ticking.ClientTick` runs.

A model's lane is the first segment of its queue (segment_items): one
item per ``forward``/``forward_backward`` call, the ``optim_step`` after the last one in
the same item (a tick that takes part of a segment leaves the rest, its step included,
queued: the gradient accumulates across ticks as across calls, so the step's result is
the same), or one other call. A namespace's samples are one more lane.

Pure but for the queues it pops; the caller holds the registry's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loraplex_engine.clients.ops import TRAIN_KINDS, ClientModel, Op
from loraplex_engine.clients.sampling import SampleTask
from loraplex_engine.tenancy.client_share import Lanes, Work

# A call's fixed cost, in tokens: its own work in the tick whatever its data (the answer,
# an optimiser step over the model's slot, the Python around it). Without it, 4 clients
# hammering 32-token steps priced as small as a co-tenant's step ran beside it in every
# tick and held it at 0.42 of its pace (bench/client_fair_share.py).
CALL_TOKENS = 64


@dataclass(frozen=True, eq=False)
class Taken:
    """One item: a model's ops (None for a sample) in call order."""

    model: ClientModel | None
    ops: tuple[Op, ...]


def segment_items(model: ClientModel) -> list[Work[Taken]]:
    """The model's first segment, priced: a training call's data tokens, and each call's
    ``CALL_TOKENS``."""
    ns, queue = model.info.namespace, model.queue
    if not queue:
        return []
    if queue[0].kind not in TRAIN_KINDS:
        ops = (queue[0],)
        return [Work(ns, CALL_TOKENS, Taken(model, ops), CALL_TOKENS - _pace_free(ops))]
    items = []
    n = 0
    while n < len(queue) and queue[n].kind in TRAIN_KINDS:
        n += 1
    for i in range(n):
        ops = (queue[i],)
        if i == n - 1 and n < len(queue) and queue[n].kind == "optim_step":
            ops += (queue[n],)
        cost = call_tokens(queue[i]) + CALL_TOKENS * len(ops)
        items.append(Work(ns, cost, Taken(model, ops), cost - _pace_free(ops)))
    return items


def _pace_free(ops: Sequence[Op]) -> int:
    """Tokens of ``ops`` that set no pace: an ``optim_step``'s (client_share.Work.pace)."""
    return CALL_TOKENS * sum(op.kind == "optim_step" for op in ops)


def call_tokens(op: Op) -> int:
    """A training call's data tokens (its payload: data, loss, backward)."""
    data = op.payload[0] if isinstance(op.payload, tuple) else ()
    return sum(d.length for d in data)


def sample_cost(task: SampleTask) -> int:
    """Tokens its rows may hold, as a completion's cost counts them (time_share.py), and
    the call's own."""
    rows = task.call.num_samples * (len(task.call.prompt_ids) + task.call.max_tokens)
    return rows + CALL_TOKENS


def lanes(models: Iterable[ClientModel], samples: Sequence[Op]) -> Lanes[Taken]:
    out: Lanes[Taken] = {}
    for model in models:
        if items := segment_items(model):
            out.setdefault(model.info.namespace, []).append(items)
    by_ns: dict[str, list[Work[Taken]]] = {}
    for op in samples:
        task: SampleTask = op.payload
        by_ns.setdefault(task.namespace, []).append(
            Work(task.namespace, sample_cost(task), Taken(None, (op,)))
        )
    for ns, items in by_ns.items():
        out.setdefault(ns, []).append(items)
    return out


def pop(taken: Sequence[Work[Taken]]) -> tuple[list[tuple[ClientModel, list[Op]]], list[Op]]:
    """Take the items off their queues: each model's ops (a prefix of its queue, in call
    order) and the sample ops."""
    segments: dict[ClientModel, list[Op]] = {}
    samples: list[Op] = []
    for w in taken:
        if w.item.model is None:
            samples += w.item.ops
        else:
            segments.setdefault(w.item.model, []).extend(w.item.ops)
    for model, ops in segments.items():
        for op in ops:
            assert model.queue[0] is op, "a lane's items are taken as a prefix"
            model.queue.popleft()
    return list(segments.items()), samples


def late_steps(segments: Sequence[tuple[ClientModel, list[Op]]]) -> list[tuple[ClientModel, Op]]:
    """At a tick's step phase: each segment that ended in a ``forward_backward`` (it was
    open) whose model's queue now starts with an ``optim_step``, which arrived while the
    tick ran. It joins this tick, as if it had been there when the tick took the segment:
    the gradient is the same either way, and the tick need not wait for it first.
    Popped off the queue and added to the segment."""
    late = []
    for model, ops in segments:
        opened = bool(ops) and ops[-1].kind == "forward_backward"
        if opened and model.queue and model.queue[0].kind == "optim_step":
            op = model.queue.popleft()
            ops.append(op)
            late.append((model, op))
    return late


def still_open(segments: Sequence[tuple[ClientModel, list[Op]]]) -> list[Op]:
    """The last ``forward_backward`` of each segment still open: nothing has come after
    it on its model's queue (its ``optim_step`` may be on its way)."""
    return [
        ops[-1]
        for model, ops in segments
        if ops and ops[-1].kind == "forward_backward" and not model.queue
    ]
