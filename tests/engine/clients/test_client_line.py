"""The turn line's index of queued models (clients/line.py): a tick's take looks only at
the models with calls queued, in the same turn order as a walk of every model would."""

from __future__ import annotations

from collections import deque

from loraplex_engine.clients.models import ClientModels
from loraplex_engine.clients.ops import ClientModel, Op
from loraplex_engine.spec.training_service import ClientLora, ClientModelInfo

from tests.support.client_registry import enrolled, queue

NS = "team-a"


class CountingQueue(deque):
    """A queue that counts how often it is looked at (its length: ``if model.queue``)."""

    looks = 0

    def __len__(self) -> int:
        CountingQueue.looks += 1
        return super().__len__()


def _registry(n: int, limit: int | None = None) -> tuple[ClientModels, list[ClientModel]]:
    infos = (
        ClientModelInfo(f"m{i:05d}", f"ns{i % 7}", "base", "tok", ClientLora(rank=4))
        for i in range(n)
    )
    return enrolled(infos, limit)


def _queue(clients: ClientModels, model: ClientModel, *kinds: str) -> None:
    queue(clients, model, *(Op(k) for k in kinds))  # type: ignore[arg-type]


def _taken(clients: ClientModels) -> list[str]:
    return [m.info.model_id for m, _ in clients.take().segments]


def test_a_take_never_looks_at_an_idle_model() -> None:
    """10,000 registered, 3 with calls queued: the tick's demand, has_work and take look
    at no idle model's queue (a walk of every model looked at all 9,997 each time)."""
    clients, models = _registry(10_000)
    for m in models:
        m.queue = CountingQueue()
    busy = [models[17], models[4_000], models[9_999]]
    for m in busy:
        _queue(clients, m, "forward_backward", "optim_step")
    CountingQueue.looks = 0
    assert clients.demand() == (3, False)
    assert clients.has_work()
    assert _taken(clients) == [m.info.model_id for m in busy]
    assert clients.demand() == (0, False)
    assert CountingQueue.looks < 100, CountingQueue.looks


def test_the_turn_order_is_kept_as_models_come_and_go() -> None:
    """Two a tick, in turn: a model taken goes to the back of the line, one whose queue
    emptied and fills again keeps its place, and a new model joins at the back."""
    clients, (a, b, c, d) = _registry(4, limit=2)
    for m in (d, b, a):  # the order calls arrive in does not reorder the line
        _queue(clients, m, "forward_backward", "optim_step")
    assert _taken(clients) == ["m00000", "m00001"]  # a, b; both to the back
    _queue(clients, c, "forward")
    _queue(clients, a, "forward")
    assert _taken(clients) == ["m00002", "m00003"]  # c, d before a (taken last tick)
    e = ClientModel(ClientModelInfo("e", NS, "base", "tok", ClientLora(rank=4)), "e")
    with clients._queued:
        clients._enroll(e)
    _queue(clients, e, "forward")
    _queue(clients, b, "forward")
    assert _taken(clients) == ["m00000", "m00001"]  # a, b: ahead of e, the newest
    assert _taken(clients) == ["e"]
    assert not clients.has_work()
