"""Clients of one size stay in lockstep (clients/taking.py's prices, the fair share of
tenancy/client_share.py): N equal Tinker clients each pipelining ``forward_backward`` +
``optim_step``, one of whose ``optim_step`` misses its tick now and then (it arrived
after the tick's step phase, taking.late_steps, and waits queued alone). Every tick must
take every model that has a call queued: the lone ``optim_step`` (the end of a step its
``forward_backward`` already priced) must not make that client look cheaper than its
neighbours, which the fair share would then hold back as dear, a few ticks of one or two
models each, and, once in debt with no co-tenant running, not at all (the engine loop
then idles with calls queued until a wake-up or ``IDLE_WAIT_S``).

A deterministic driver, no engine and no clock: the registry alone, its queues filled as
``ClientModels.submit`` fills them; each client sends its next step as soon as the tick
that ran its ``optim_step`` is over."""

from __future__ import annotations

import time

from loraplex_engine.clients.calls import queued_call
from loraplex_engine.clients.models import ClientModels
from loraplex_engine.clients.ops import ClientModel, Op
from loraplex_engine.spec.training_service import (
    AdamStep,
    ClientLora,
    ClientModelInfo,
    Forward,
    Limits,
    LossCall,
    OptimStep,
)
from loraplex_engine.tenancy.client_share import RECENT_S, SETTLED_S

from tests.support.client_driver import sft_datum
from tests.support.client_registry import enrolled, queue

CLIENTS = 8
STEPS = 20
ROWS = (1, 4)  # the clock bench's sizes (bench/tinker_clock.py)
LOSS = LossCall("cross_entropy")


LIMITS = Limits(vocab=473, context=512, max_tokens=4096)


def _train_op(kind: str, rows: int) -> Op:
    """As the registry queues it (clients/calls.py): the bench's rows, 8 + 24 tokens."""
    data = [sft_datum(list(range(3, 11)), list(range(11, 35))) for _ in range(rows)]
    call = OptimStep(AdamStep()) if kind == "optim_step" else Forward(data, LOSS, backward=True)
    op_kind, payload = queued_call(call, LIMITS, lambda state: None)
    return Op(op_kind, payload, detached=True)


def _clients(n: int) -> tuple[ClientModels, list[ClientModel]]:
    infos = (
        ClientModelInfo(f"m{i}", f"ns{i}", "base", "tok", ClientLora(rank=8)) for i in range(n)
    )
    return enrolled(infos)


def test_equal_clients_share_every_tick_when_an_optim_step_comes_late() -> None:
    for rows in ROWS:
        registry, models = _clients(CLIENTS)
        done = dict.fromkeys(models, 0)
        late: dict[ClientModel, Op] = {}  # its optim_step, sent after its tick's step phase
        for model in models:  # every client sends its first step
            queue(registry, model, _train_op("forward_backward", rows))
            late[model] = _train_op("optim_step", rows)
        ticks = 0
        while any(m.queue for m in models):
            queued = {m.info.model_id for m in models if m.queue}
            assert registry.has_work(), f"calls of {sorted(queued)} queued, no tick takes one"
            taken = registry.take().segments
            ticks += 1
            assert {m.info.model_id for m, _ in taken} == queued, (rows, ticks)
            for model, ops in taken:
                if ops[-1].kind == "forward_backward":  # its optim_step arrives now, alone
                    queue(registry, model, late.pop(model))
                    continue
                done[model] += 1
                if done[model] == STEPS:
                    continue
                # the next step; one client in turn sends its optim_step late
                fb = _train_op("forward_backward", rows)
                if (done[model] + models.index(model)) % CLIENTS == 0:
                    queue(registry, model, fb)
                    late[model] = _train_op("optim_step", rows)
                else:
                    queue(registry, model, fb, _train_op("optim_step", rows))
        assert all(n == STEPS for n in done.values())


def test_a_held_back_client_is_told_when_its_co_tenant_stops_counting() -> None:
    """A dear client (40 rows a call beside a 1-row one) in debt, its small co-tenant
    between calls: no tick takes its call, and the registry says when one will (the
    co-tenant's ``RECENT_S`` ends), so the engine wakes then instead of an idle poll."""
    registry, (small, dear) = _clients(2)
    queue(registry, small, _train_op("forward_backward", 1))
    queue(registry, dear, _train_op("forward_backward", 40))
    assert registry.held_until() is None  # queued, but nobody served yet: no window to end
    before = time.monotonic()
    assert {m.info.model_id for m, _ in registry.take().segments} == {"m0", "m1"}
    queue(registry, dear, _train_op("forward_backward", 40))  # the small one is thinking
    assert not registry.has_work()  # the dear one's debt: held back
    at = registry.held_until()
    assert at is not None and before + RECENT_S < at <= time.monotonic() + RECENT_S + 0.01
    while not registry.has_work():  # what the engine's timer waits for
        assert time.monotonic() <= at + 0.5, "still held after the co-tenant stopped counting"
        time.sleep(0.05)
    assert time.monotonic() >= at - SETTLED_S
    assert {m.info.model_id for m, _ in registry.take().segments} == {"m1"}
