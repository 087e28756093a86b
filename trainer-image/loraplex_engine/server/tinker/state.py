"""Sessions, the models they created and their samplers: who owns what.

A session is created by the SDK's ``ServiceClient`` and kept alive by its heartbeat
(every 10 s). One not heard from for ``session_ttl_s`` seconds has vanished: it is
removed, and its models are saved (``TrainingService.save_state``, kind ``weights``,
named ``expired-<unix time>``) and unloaded, freeing their slots. A session the client
closes (``/sessions/{id}/finish``) goes the same way. Either way its id answers 410
afterwards.

Everything here is keyed by (namespace, id): an id is only ever looked up in the
caller's namespace, so one another namespace chose (a client experiment's model id is
the tenant's own ``spec.client.modelId``) names a different session, model or sampler,
and a lookup from another namespace answers ``NotFoundError``, exactly as for an id
that never existed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplex_engine.server.tinker.errors import SessionGone, SessionLimit
from loraplex_engine.server.tinker.journal import Journal
from loraplex_engine.spec.errors import NotFoundError
from loraplex_engine.spec.tinker_limits import DEFAULT_MAX_SESSIONS
from loraplex_engine.spec.training_service import Adoption

SESSION_TTL_S = 300.0  # no heartbeat (or request) for this long: the client has vanished
MAX_SEQ_MEMORY = 256  # (model, seq_id) -> future remembered, for resent requests
MAX_RETIRED = 4096  # unloaded models whose run metadata the REST reads still answer


@dataclass
class Session:
    id: str
    namespace: str
    user_metadata: dict[str, Any]
    last_seen: float = field(default_factory=time.monotonic)
    models: set[str] = field(default_factory=set)
    # A client experiment's model lives in a pinned session: no heartbeat TTL ends it,
    # its life is the experiment's (clients/experiments.py).
    pinned: bool = False


@dataclass
class Model:
    id: str
    namespace: str
    session_id: str
    rank: int
    user_metadata: dict[str, Any] | None
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)
    seq_futures: dict[int, str] = field(default_factory=dict)
    # A client experiment's (adopted): its journal and checkpoint cadence (journal.py).
    journal: Journal | None = None
    checkpoint_every: int = 0
    restored_steps: int = 0  # the optimiser steps of the checkpoint it was adopted from


@dataclass(frozen=True)
class Sampler:
    id: str
    namespace: str
    session_id: str
    base_model: str
    model_path: str | None
    inflight_model: str | None = None  # an inflight client's model (server/tinker/inflight.py)


Key = tuple[str, str]  # (namespace, the id)


def _key(s: Session) -> Key:
    return (s.namespace, s.id)


# (namespace, model id) -> a client experiment's model loaded here, or None.
Adopter = Callable[[str, str], "Adoption | None"]


class Registry:
    def __init__(
        self,
        session_ttl_s: float = SESSION_TTL_S,
        adopter: Adopter | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self.session_ttl_s = session_ttl_s
        self.max_sessions = max_sessions  # open (unpinned) sessions per namespace
        self.adopter = adopter
        self.on_adopted: Callable[[Model, Adoption], None] | None = None  # the replay
        self._lock = threading.Lock()
        self._sessions: dict[Key, Session] = {}
        self._gone: dict[Key, None] = {}  # ended sessions, oldest first
        self._models: dict[Key, Model] = {}
        self._samplers: dict[Key, Sampler] = {}
        self._creating: dict[tuple[str, str], str] = {}  # (ns, model id) -> request id
        # Unloaded models, newest last: a training run's rank and user_metadata outlive
        # its model (the REST reads answer them); bounded, oldest forgotten first.
        self._retired: dict[Key, Model] = {}

    # --- sessions ---

    def new_session(self, namespace: str, user_metadata: dict[str, Any] | None) -> Session:
        s = Session("s" + uuid.uuid4().hex[:20], namespace, dict(user_metadata or {}))
        with self._lock:
            mine = sum(ns == namespace for ns, _ in self._sessions)
            if mine >= self.max_sessions:
                raise SessionLimit(
                    f"namespace {namespace!r} has {mine} open Tinker sessions, the engine's "
                    f"limit (serve --tinker-max-sessions {self.max_sessions}): close one "
                    "(ServiceClient.close) or let one expire, then retry"
                )
            self._sessions[(namespace, s.id)] = s
        return s

    def session(self, namespace: str, session_id: str, field_name: str = "session_id") -> Session:
        with self._lock:
            s = self._sessions.get((namespace, session_id))
            if s is not None:
                s.last_seen = time.monotonic()
                return s
            if (namespace, session_id) in self._gone:
                raise SessionGone(
                    f"session {session_id} has ended (closed, or no heartbeat for "
                    f"{self.session_ttl_s:.0f}s); create a new ServiceClient",
                    field=field_name,
                )
        raise NotFoundError(f"no session {session_id!r}", field=field_name)

    def is_open(self, namespace: str, session_id: str) -> bool:
        with self._lock:
            return (namespace, session_id) in self._sessions

    def end_session(self, namespace: str, session_id: str) -> list[Model]:
        """Ends the session; returns its models (the caller saves and unloads them)."""
        with self._lock:
            s = self._sessions.get((namespace, session_id))
            if s is None:
                if (namespace, session_id) in self._gone:
                    return []
                raise NotFoundError(f"no session {session_id!r}", field="session_id")
            return self._end_locked(s)

    def expired(self) -> list[Model]:
        """Ends every session past its TTL; returns their models."""
        now = time.monotonic()
        out: list[Model] = []
        with self._lock:
            late = [s for s in self._sessions.values() if now - s.last_seen > self.session_ttl_s]
            for s in [s for s in late if not s.pinned]:
                out.extend(self._end_locked(s))
        return out

    def _end_locked(self, s: Session) -> list[Model]:
        del self._sessions[(s.namespace, s.id)]
        self._gone[(s.namespace, s.id)] = None
        if len(self._gone) > 100_000:  # forget the oldest ended sessions
            for key in list(self._gone)[:50_000]:
                del self._gone[key]
        mine = [k for k, v in self._samplers.items() if (v.namespace, v.session_id) == _key(s)]
        for key in mine:
            del self._samplers[key]
        found = [self._models.get((s.namespace, m)) for m in s.models]
        return [m for m in found if m is not None]

    # --- models ---

    def creating(self, namespace: str, model_id: str) -> str | None:
        with self._lock:
            return self._creating.get((namespace, model_id))

    def set_creating(self, namespace: str, model_id: str, request_id: str | None) -> None:
        with self._lock:
            if request_id is None:
                self._creating.pop((namespace, model_id), None)
            else:
                self._creating[(namespace, model_id)] = request_id

    def add_model(self, model: Model) -> bool:
        """Registers a created model; False when its session has ended meanwhile."""
        with self._lock:
            s = self._sessions.get((model.namespace, model.session_id))
            self._models[(model.namespace, model.id)] = model
            if s is None:
                return False
            s.models.add(model.id)
            return True

    def model(self, namespace: str, model_id: str) -> Model:
        with self._lock:
            known = (namespace, model_id) in self._models
        if not known:
            self._adopt(namespace, model_id)
        with self._lock:
            m = self._models.get((namespace, model_id))
            if m is None:
                raise NotFoundError(f"no model {model_id!r}", field="model_id")
            m.last_request = time.time()
            s = self._sessions.get((namespace, m.session_id))
            if s is not None:
                s.last_seen = time.monotonic()
            return m

    def _adopt(self, namespace: str, model_id: str) -> None:
        """A client experiment's model, first named here: registered in its pinned
        session (the session part of its id), as if this engine had created it."""
        found = self.adopter(namespace, model_id) if self.adopter is not None else None
        if found is None:
            return
        session_id = model_id.split(":", 1)[0]
        with self._lock:
            s = self._sessions.get((namespace, session_id))
            if s is None:
                s = Session(session_id, namespace, {}, pinned=True)
                self._sessions[(namespace, session_id)] = s
                self._gone.pop((namespace, session_id), None)
            if (namespace, model_id) in self._models:
                return
            s.pinned = True
            m = Model(model_id, namespace, session_id, found.rank, None)
            m.journal, m.checkpoint_every = Journal(found.journal_dir), found.checkpoint_every
            m.restored_steps = found.steps
            self._models[(namespace, model_id)] = m
            s.models.add(model_id)
        if self.on_adopted is not None:
            self.on_adopted(m, found)

    def drop_model(self, namespace: str, model_id: str) -> None:
        with self._lock:
            m = self._models.pop((namespace, model_id), None)
            if m is not None:
                self._retired.pop((namespace, model_id), None)
                self._retired[(namespace, model_id)] = m
                while len(self._retired) > MAX_RETIRED:
                    del self._retired[next(iter(self._retired))]
            s = None if m is None else self._sessions.get((namespace, m.session_id))
            if s is not None:
                s.models.discard(model_id)

    def models(self, namespace: str) -> list[Model]:
        with self._lock:
            return [m for m in self._models.values() if m.namespace == namespace]

    def known_models(self, namespace: str) -> list[Model]:
        """The namespace's models, loaded or unloaded (the loaded one of an id wins)."""
        with self._lock:
            found = {m.id: m for (ns, _), m in self._retired.items() if ns == namespace}
            found |= {m.id: m for m in self._models.values() if m.namespace == namespace}
            return list(found.values())

    def seq_request(self, model: Model, seq_id: int) -> str | None:
        with self._lock:
            return model.seq_futures.get(seq_id)

    def record_seq(self, model: Model, seq_id: int, request_id: str) -> None:
        with self._lock:
            model.seq_futures[seq_id] = request_id
            while len(model.seq_futures) > MAX_SEQ_MEMORY:
                del model.seq_futures[min(model.seq_futures)]

    # --- samplers ---

    def add_sampler(
        self,
        session: Session,
        base_model: str,
        model_path: str | None,
        seq: int | None,
        inflight_model: str | None = None,
    ) -> Sampler:
        suffix = str(seq) if seq is not None else uuid.uuid4().hex[:12]
        sid = f"{session.id}:sample:{suffix}"
        sampler = Sampler(
            sid, session.namespace, session.id, base_model, model_path, inflight_model
        )
        with self._lock:
            self._samplers[(session.namespace, sampler.id)] = sampler
        return sampler

    def sampler(self, namespace: str, sampler_id: str) -> Sampler:
        with self._lock:
            s = self._samplers.get((namespace, sampler_id))
        if s is None:
            raise NotFoundError(f"no sampler {sampler_id!r}", field="sampling_session_id")
        return s
