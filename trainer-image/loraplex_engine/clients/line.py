"""The client models' turn line, and an index of the ones with calls queued.

A tick takes client work from the models with calls queued, in turn order (a model
taken goes to the back of the line: clients/models.py). An engine that pages registers
thousands of models, most of them idle; walking all of them every tick to find the few
with calls queued cost most of a quiet tick at 10,000 registered. The line keeps each
model's place as a number (a later number is further back) and the set of models that
may have calls queued, so a tick's walk is proportional to the models with work.

The index holds every model with a call queued (``queued`` is called wherever a call is
queued) and may hold a model whose queue has since emptied (taken, refused, unloaded):
``waiting`` drops those as it meets them. Pure bookkeeping; the caller holds the
registry's lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import count

from loraplex_engine.clients.ops import ClientModel


class TurnLine:
    def __init__(self) -> None:
        self._next = count()
        self._place: dict[ClientModel, int] = {}  # every registered model: its place
        self._queued: set[ClientModel] = set()  # a superset of those with calls queued

    def join(self, model: ClientModel) -> None:
        """A new model, at the back of the line."""
        self._place[model] = next(self._next)

    def to_back(self, model: ClientModel) -> None:
        if model in self._place:
            self._place[model] = next(self._next)

    def leave(self, model: ClientModel) -> None:
        self._place.pop(model, None)
        self._queued.discard(model)

    def queued(self, model: ClientModel) -> None:
        """A call was queued on ``model``."""
        if model in self._place:
            self._queued.add(model)

    def waiting(self) -> list[ClientModel]:
        """The registered models with calls queued, in turn order."""
        self._queued = {m for m in self._queued if m.queue}
        return sorted(self._queued, key=self._place.__getitem__)

    def in_turn(self, models: Iterable[ClientModel]) -> list[ClientModel]:
        """Those of ``models`` still registered, in turn order."""
        here = [m for m in models if m in self._place]
        return sorted(here, key=self._place.__getitem__)
