"""Where a tenant's request goes: pure decisions, no I/O.

- OpenAI model ids resolve within the key's namespace: ``<name>`` and
  ``<namespace>.<name>`` both name the experiment ``<namespace>.<name>``; anything else
  is read as a name in the key's namespace, so no id reaches another namespace.
- A Tinker id carries its session: model ``<session>:train:<n>``, sampler
  ``<session>:sample:<x>``, path ``tinker://<model id>/...``. A session lives on one
  engine (stage 1: its models and samplers do too); the gateway finds that engine by
  asking the engines, so it holds nothing a restart would lose.
- A future the gateway hands out is ``<engine>~<request id>``: the engine that holds it
  travels in the id itself.
- A new session goes to the admitted engine with the most free slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from loraplex_operator.admission import selector_matches
from loraplex_operator.api.pool import LabelSelector

FUTURE_SEP = "~"
TINKER_SCHEME = "tinker://"


@dataclass(frozen=True)
class Engine:
    """One engine the gateway may call: its pod name (unique: pools are cluster-scoped
    and pods are named ``<pool>-engine-<suffix>``), pool, URL and the pool's token, and
    which namespaces the pool admits (the EnginePool's fields, same meaning)."""

    name: str
    pool: str
    url: str
    token: str
    allowed_namespaces: tuple[str, ...] | None = None
    namespace_selector: LabelSelector | None = None
    # The name its engines serve the base model by (the pool's servedModelNames' first,
    # else its baseModel directory's name); None = unknown (a file view without it).
    base_model: str | None = None
    # Every name the engines take for it (served_names.names_of): base_model among them.
    served_names: tuple[str, ...] = ()
    # The pool's allowedTargetModules (None: unknown, a file view without it).
    allowed_target_modules: tuple[str, ...] | None = None

    def serves(self, base_model: str | None) -> bool:
        """As the engine's own check: the name before any ``:`` tag; None asks for any."""
        if base_model is None or self.base_model is None:
            return True
        return base_model.split(":")[0] in (self.base_model, *self.served_names)

    def admits(self, namespace: str, labels: Mapping[str, str] | None = None) -> bool:
        """As admission.namespace_allowed: listed or selected; neither set = all."""
        listed, selector = self.allowed_namespaces, self.namespace_selector
        if listed is None and selector is None:
            return True
        if listed and namespace in listed:
            return True
        return selector is not None and selector_matches(selector, labels or {})


def openai_model(namespace: str, model: str) -> str:
    """The engine's id (``<namespace>.<name>``) of the tenant's ``model``."""
    prefix = namespace + "."
    return model if model.startswith(prefix) else prefix + model


def namespace_models(namespace: str, cards: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The model cards of ``namespace``'s adapters only (never the base, never another
    namespace's), once each, by id."""
    prefix = namespace + "."
    seen: dict[str, dict[str, Any]] = {}
    for card in cards:
        mid = card.get("id")
        if isinstance(mid, str) and mid.startswith(prefix) and mid not in seen:
            seen[mid] = dict(card)
    return [seen[k] for k in sorted(seen)]


def session_of(tinker_id: str | None) -> str | None:
    """The session a session, model or sampler id, or a ``tinker://`` path, belongs to."""
    if not tinker_id:
        return None
    if tinker_id.startswith(TINKER_SCHEME):
        tinker_id = tinker_id[len(TINKER_SCHEME) :].split("/", 1)[0]
    session = tinker_id.split(":", 1)[0]
    return session or None


def future_id(engine: str, request_id: str) -> str:
    return f"{engine}{FUTURE_SEP}{request_id}"


def split_future_id(given: str) -> tuple[str, str] | None:
    engine, sep, request_id = given.partition(FUTURE_SEP)
    return (engine, request_id) if sep and engine and request_id else None


def with_future_ids(engine: str, answer: Any) -> Any:
    """An engine's JSON answer with its ``request_id`` made the gateway's."""
    rid = answer.get("request_id") if isinstance(answer, dict) else None
    if isinstance(rid, str) and FUTURE_SEP not in rid:
        return {**answer, "request_id": future_id(engine, rid)}
    return answer


def pick_engine(room: Mapping[str, int]) -> str | None:
    """The engine (by name) with the most room for one more model, ties by name; None if
    none has room."""
    best = sorted((-free, name) for name, free in room.items() if free > 0)
    return best[0][1] if best else None


def registered_room(capacity: Mapping[str, Any]) -> int:
    """How many more models an engine takes, from its ``/v1/capacity``: a paging engine
    registers up to ``maxRegistered`` (resident ``usedSlots`` plus ``pagedAdapters``),
    whatever its slots hold; one that does not report it (no paging, or built before
    paging) has its free slots."""
    limit = capacity.get("maxRegistered")
    if isinstance(limit, int) and not isinstance(limit, bool):
        held = _count(capacity, "usedSlots") + _count(capacity, "pagedAdapters")
        return max(0, limit - held)
    return _count(capacity, "freeSlots") or _count(capacity, "free_slots")


def _count(capacity: Mapping[str, Any], key: str) -> int:
    value = capacity.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def proto_string_field(body: bytes, number: int) -> str | None:
    """The first top-level string field ``number`` of a protobuf message (the Tinker
    ``ForwardBackwardRequest``'s ``model_id`` is field 1), None if absent or malformed.
    Walks the wire format only; the message is forwarded as it came."""
    i = 0
    try:
        while i < len(body):
            tag, i = _varint(body, i)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                _, i = _varint(body, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                n, i = _varint(body, i)
                if field == number:
                    if i + n > len(body):
                        return None
                    return body[i : i + n].decode("utf-8")
                i += n
            else:
                return None
    except (ValueError, UnicodeDecodeError):
        return None
    return None
