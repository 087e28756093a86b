"""The clock cycle's gather (clients/gather.py, ``ClientModels.gather``): which client
models a tick waits for, that it takes every model whose call arrives within the window,
and that nothing on its way (a lone client's whole segment) or a passed window holds a
tick at all. No engine: the registry alone, its queues filled as ``_submit`` fills them
(under the lock, notifying the condition)."""

from __future__ import annotations

import threading

from loraplex_engine.clients.gather import oldest_call, waiting_on
from loraplex_engine.clients.models import ClientModels
from loraplex_engine.clients.ops import ClientModel, Op
from loraplex_engine.clients.taking import late_steps
from loraplex_engine.spec.training_service import ClientLora, ClientModelInfo

from tests.support.client_driver import NS
from tests.support.client_registry import queue, registry_of

LONG_S = 3600.0  # a window no test waits out: returning at all shows it did not wait
JOIN_S = 30.0  # liveness guard on a gather thread, not a speed target


def _model(name: str, *kinds: str, namespace: str = NS) -> ClientModel:
    model = ClientModel(ClientModelInfo(name, namespace, "base", "tok", ClientLora(rank=4)), name)
    model.queue.extend(Op(k) for k in kinds)  # type: ignore[arg-type]
    return model


def _queue(clients: ClientModels, model: ClientModel, *kinds: str) -> None:
    queue(clients, model, *(Op(k) for k in kinds))  # type: ignore[arg-type]


def _gather_in_thread(clients: ClientModels, **kw) -> threading.Thread:
    t = threading.Thread(target=clients.gather, kwargs=kw, daemon=True)
    t.start()
    return t


def _taken(clients: ClientModels) -> dict[str, list[str]]:
    return {m.info.model_id: [op.kind for op in ops] for m, ops in clients.take().segments}


def test_waiting_on_only_models_whose_next_call_is_on_its_way() -> None:
    """Waited for: a model the last tick served, with nothing queued and every answer
    fetched (its next step is on its way). Not a model whose forward_backward is queued
    without its optim_step: the tick starts at once and the step joins it late
    (taking.late_steps); a lone client's tick is never held for it."""
    whole = _model("whole", "forward_backward", "optim_step")
    opening = _model("opening", "forward_backward")
    served = _model("served")  # the last tick served it; its next step is on its way
    idle = _model("idle")  # never served lately: nothing is expected of it
    models = [whole, opening, served, idle]
    assert waiting_on(models, {served, whole}, None) == [served]
    assert waiting_on(models, set(), None) == []
    assert waiting_on([opening], {opening}, None) == []  # a lone client: start at once
    # One model a tick: only the first in turn that has work or is on its way matters.
    assert waiting_on(models, {served}, 1) == []  # "whole" is first, and queued
    assert waiting_on([whole, served], {served}, 2) == [served]


def test_a_late_optim_step_joins_the_tick_of_its_forward_backward() -> None:
    """At the step phase, a segment that ended in a forward_backward takes the
    optim_step that has arrived since (the head of its model's queue); a whole segment,
    a forward, or a queue headed by another call takes nothing."""
    opened, whole = _model("opened", "optim_step", "forward"), _model("whole", "optim_step")
    ahead, evaluating = _model("ahead", "save_state", "optim_step"), _model("ev", "optim_step")
    segments = [
        (opened, [Op("forward_backward")]),
        (whole, [Op("forward_backward"), Op("optim_step")]),
        (ahead, [Op("forward_backward")]),
        (evaluating, [Op("forward")]),
    ]  # type: ignore[arg-type]
    step = opened.queue[0]
    assert late_steps(segments) == [(opened, step)]
    assert segments[0][1][-1] is step and [op.kind for op in opened.queue] == ["forward"]
    assert len(whole.queue) == len(evaluating.queue) == 1
    assert [op.kind for op in ahead.queue] == ["save_state", "optim_step"]


def test_oldest_call_is_the_longest_waiting_queued_call() -> None:
    a, b, c = _model("a", "forward_backward"), _model("b", "optim_step"), _model("c")
    a.queue[0].queued_at, b.queue[0].queued_at = 7.0, 3.0
    assert oldest_call([a, b, c]) == 3.0
    assert oldest_call([c]) is None


def test_a_tick_takes_every_model_whose_call_arrives_within_the_window() -> None:
    """Three clients the last tick served: one has sent its step, one only its
    forward_backward, one nothing yet. The gather holds the tick until the last one's
    calls are queued, then the tick takes all three whole segments."""
    a = _model("a", "forward_backward", "optim_step")
    b = _model("b", "forward_backward")
    c = _model("c")
    clients = registry_of(a, b, c, gather_s=LONG_S)
    clients._served_last = {a, b, c}
    waiter = _gather_in_thread(clients)
    _queue(clients, b, "optim_step")
    waiter.join(0.05)
    assert waiter.is_alive()  # c's step is still on its way: the tick has not started
    _queue(clients, c, "forward_backward", "optim_step")
    waiter.join(JOIN_S)
    assert not waiter.is_alive()
    assert _taken(clients) == {m: ["forward_backward", "optim_step"] for m in "abc"}


def test_nothing_on_its_way_holds_no_tick() -> None:
    """A lone client whose step is queued whole or only its forward_backward (its
    optim_step on its way joins the tick late), an evaluation ``forward``, no queued
    call at all, or the gather turned off: gather returns without waiting (the window
    is an hour; the thread ends)."""
    lone = _model("lone", "forward_backward", "optim_step")
    opening = _model("opening", "forward_backward")
    evaluating = _model("eval", "forward")
    cases = [([lone], {lone}), ([opening], {opening}), ([evaluating], {evaluating})]
    for models, served in [*cases, ([_model("x")], set())]:
        clients = registry_of(*models, gather_s=LONG_S)
        clients._served_last = served
        waiter = _gather_in_thread(clients)
        waiter.join(JOIN_S)
        assert not waiter.is_alive(), [m.info.model_id for m in models]
    off = registry_of(_model("b", "forward_backward"), gather_s=0.0)
    off.gather()  # returns: 0 turns the gather off, even with a segment open


def test_a_call_is_held_no_longer_than_the_window_after_it_arrived() -> None:
    """The bound runs from the oldest queued call's arrival: once the clock is past it,
    the tick starts on what is there, though a model is still on its way; the partial
    segment is taken as it stands and the rest goes to a later tick."""
    b = _model("b", "forward_backward")
    other = _model("other")
    clients = registry_of(b, other, gather_s=LONG_S)
    clients._served_last = {other}
    arrived = b.queue[0].queued_at
    clients.gather(clock=lambda: arrived + LONG_S)  # the window has passed: at once
    assert _taken(clients) == {"b": ["forward_backward"]}


class _Rows:  # a training call's data as the fair share prices it: its tokens
    def __init__(self, length: int) -> None:
        self.length = length


def _train_op(tokens: int, queued_at: float | None = None) -> Op:
    op = Op("forward_backward", ([_Rows(tokens)], None, True))
    if queued_at is not None:
        op.queued_at = queued_at
    return op


def test_calls_the_fair_share_holds_back_do_not_cut_a_co_tenants_window_short() -> None:
    """Team-a's big call has waited long, held back by the fair share (its namespace is
    dear and in debt: tenancy/client_share.py); team-b's step has just arrived, and its
    other client, which the last tick served, is sending its own. The window runs from
    the oldest call the tick would take (b's), so the gather waits for c and the tick
    takes both; timing from a's call would start the tick at once without c."""
    a = _model("a", namespace="team-a")
    b, c = _model("b", namespace="team-b"), _model("c", namespace="team-b")
    a.queue.append(_train_op(1000, queued_at=0.0))
    b.queue.extend([_train_op(10), Op("optim_step")])
    clients = registry_of(a, b, c, gather_s=LONG_S)
    clients._served_last = {c}
    clients.share.credit = -(10**6)  # a's debt from its earlier calls
    waiter = _gather_in_thread(clients)
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting for c's step
    queue(clients, c, _train_op(10), Op("optim_step"))
    waiter.join(JOIN_S)
    assert not waiter.is_alive()
    step = ["forward_backward", "optim_step"]
    assert _taken(clients) == {"b": step, "c": step}


def test_a_client_with_an_answer_to_fetch_is_not_on_its_way() -> None:
    """Two clients the last tick served, each with a detached call's answer (the Tinker
    layer's: the SDK fetches it with retrieve_future). ``lone`` has not fetched it, so it
    cannot have sent its next step: the tick with ``other``'s queued step starts at once.
    Once ``lone`` has fetched its answer, its next step is on its way and the gather
    waits for it (``lone`` is then taken with ``other``)."""
    lone, other = _model("lone"), _model("other", "forward_backward", "optim_step")
    lone.outstanding = 1  # what take() counts for each detached call it took
    clients = registry_of(lone, other, gather_s=LONG_S)
    clients._served_last = {lone, other}
    waiter = _gather_in_thread(clients)
    waiter.join(JOIN_S)
    assert not waiter.is_alive()  # nothing on its way: at once
    clients.retrieved(NS, "lone")
    assert lone.outstanding == 0
    waiter = _gather_in_thread(clients)
    waiter.join(0.2)
    assert waiter.is_alive()  # lone holds its answer: its step is on its way
    _queue(clients, lone, "forward_backward", "optim_step")
    waiter.join(JOIN_S)
    assert not waiter.is_alive()
    assert _taken(clients) == {m: ["forward_backward", "optim_step"] for m in ("lone", "other")}


def test_a_tick_counts_the_detached_answers_it_will_give() -> None:
    model = _model("m")
    model.queue.extend(
        [Op("forward_backward", detached=True), Op("optim_step", detached=True)]  # type: ignore[arg-type]
    )
    clients = registry_of(model, gather_s=0.0)
    clients.take()
    assert model.outstanding == 2
    clients.retrieved(NS, "m")
    clients.retrieved(NS, "m")
    clients.retrieved(NS, "m")  # once more (a repeated fetch): never below 0
    assert model.outstanding == 0


def test_the_step_phase_waits_within_the_window_for_an_open_segments_step() -> None:
    """A tick ran a forward_backward whose optim_step has not come: at its step phase it
    waits for it (the step arrives while waiting and joins the tick), but never past the
    window after the step phase began (then it steps without it)."""
    model = _model("m")
    clients = registry_of(model, gather_s=LONG_S)
    fb = Op("forward_backward")
    segments = [(model, [fb])]
    got: list = []
    waiter = threading.Thread(target=lambda: got.extend(clients.late_steps(segments)))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()  # its optim_step is on its way
    _queue(clients, model, "optim_step")
    waiter.join(JOIN_S)
    assert not waiter.is_alive()
    assert got == [(model, segments[0][1][-1])] and got[0][1].kind == "optim_step"
    late = [(model, [Op("forward_backward")])]
    began = late[0][1][0].queued_at + 2 * LONG_S
    times = [began]  # the phase begins; then its window has passed
    assert clients.late_steps(late, clock=lambda: times.pop() if times else began + LONG_S) == []


def test_the_step_phase_window_runs_from_its_start_not_from_the_forward_backward() -> None:
    """Eight clients: the gather and the pass spend the window after the oldest
    forward_backward arrived before the step phase begins. An optim_step the SDK sends
    once its forward_backward is acknowledged, a moment after that, still joins the tick
    (it made a tick of its own)."""
    models = [_model(f"m{i}") for i in range(8)]
    clients = registry_of(*models, gather_s=LONG_S)
    segments = [(m, [Op("forward_backward")]) for m in models]
    began = max(ops[0].queued_at for _, ops in segments) + 2 * LONG_S  # the window is spent
    got: list = []
    waiter = threading.Thread(
        target=lambda: got.extend(clients.late_steps(segments, clock=lambda: began))
    )
    waiter.start()
    for m in models:
        _queue(clients, m, "optim_step")
    waiter.join(JOIN_S)
    assert not waiter.is_alive()
    assert [(m.info.model_id, op.kind) for m, op in got] == [
        (m.info.model_id, "optim_step") for m in models
    ]
