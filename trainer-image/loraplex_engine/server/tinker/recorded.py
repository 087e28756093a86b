"""Sequences sampled with ``record_stability_info``: what the engine itself sampled, kept
so that a ``stable_reinforce`` training request can name them (``sequence_id``) and train
on the engine's own record instead of the client's copy (server/tinker/provenance.py).

One recording is one sample request: its prompt tokens, each sequence's sampled tokens
and log-probs (float32, exactly the values the client was sent) and the weights it was
sampled from. Tenants are untrusted, so the table is bounded:

- keyed by namespace, and a recording answers only its own session (another session's
  sequence id is unknown, like one that never existed);
- a namespace holds at most ``tokens_per_namespace`` tokens (prompts counted once per
  request): a new recording pushes out the least recently used ones; a request that
  alone could exceed the cap is refused before it samples;
- a recording unused for ``ttl_s`` expires (each training request naming it restarts its
  time), and its session's end frees it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.tinker_limits import RecordLimits
from loraplex_engine.spec.training_service import SampledRow

GONE_KEPT = 4096  # why a sequence id is gone, per namespace (bounded)


@dataclass(frozen=True)
class RecordedSequence:
    tokens: np.ndarray  # int32, the sampled tokens
    logprobs: np.ndarray  # float32, the sampler's log-prob of each


@dataclass
class Recording:
    """One sample request with ``record_stability_info``."""

    session_id: str
    prompt: np.ndarray  # int32
    sequences: dict[str, RecordedSequence]  # by sequence id
    version: str  # the sampler path (or base model name) it was sampled from
    last_used: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return int(self.prompt.size) + sum(int(s.tokens.size) for s in self.sequences.values())

    @property
    def nbytes(self) -> int:
        held = sum(s.tokens.nbytes + s.logprobs.nbytes for s in self.sequences.values())
        return int(self.prompt.nbytes) + held


@dataclass(frozen=True)
class Found:
    prompt: np.ndarray
    sequence: RecordedSequence
    version: str


@dataclass
class _Space:
    recordings: OrderedDict[str, Recording] = field(default_factory=OrderedDict)  # LRU first
    owner: dict[str, str] = field(default_factory=dict)  # sequence id -> recording key
    tokens: int = 0
    sessions: dict[str, int] = field(default_factory=dict)  # session id -> its recordings
    gone: OrderedDict[str, str] = field(default_factory=OrderedDict)  # sequence id -> why


class Recorder:
    def __init__(
        self, limits: RecordLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits or RecordLimits()
        self.clock = clock
        self._lock = threading.Lock()
        self._spaces: dict[str, _Space] = {}

    def check_fits(self, prompt_tokens: int, num_samples: int, max_tokens: int) -> None:
        """Before sampling: one request's recording must fit the namespace's cap."""
        most = prompt_tokens + num_samples * max_tokens
        if most > self.limits.tokens_per_namespace:
            raise InvalidRequestError(
                f"recording this sample takes up to {most} tokens (its prompt and "
                f"num_samples x max_tokens), over the {self.limits.tokens_per_namespace} a "
                "namespace's recordings may hold (serve --tinker-recorded-tokens)",
                field="record_stability_info",
            )

    def record(
        self,
        namespace: str,
        session_id: str,
        key: str,
        sequence_ids: Sequence[str],
        prompt: Sequence[int],
        rows: Sequence[SampledRow],
        version: str,
    ) -> None:
        seqs = {
            sid: RecordedSequence(
                np.asarray(row.token_ids, dtype=np.int32), np.asarray(row.logprobs, np.float32)
            )
            for sid, row in zip(sequence_ids, rows, strict=True)
        }
        rec = Recording(session_id, np.asarray(prompt, np.int32), seqs, version, self.clock())
        with self._lock:
            space = self._spaces.setdefault(namespace, _Space())
            self._drop_locked(space, key, "recorded again")
            while space.recordings and space.tokens + rec.tokens > self.limits.tokens_per_namespace:
                oldest = next(iter(space.recordings))
                why = (
                    "pushed out by newer recordings (a namespace's recordings hold "
                    f"{self.limits.tokens_per_namespace} tokens)"
                )
                self._drop_locked(space, oldest, why)
            space.recordings[key] = rec
            space.tokens += rec.tokens
            space.sessions[session_id] = space.sessions.get(session_id, 0) + 1
            for sid in seqs:
                space.owner[sid] = key
                space.gone.pop(sid, None)

    def find(self, namespace: str, session_id: str, sequence_id: str) -> Found | str:
        """The recorded sequence, its time restarted; else why there is none."""
        with self._lock:
            space = self._spaces.get(namespace)
            key = None if space is None else space.owner.get(sequence_id)
            rec = None if key is None or space is None else space.recordings.get(key)
            if rec is None or rec.session_id != session_id or space is None:
                why = None if space is None else space.gone.get(sequence_id)
                return why or "no sequence recorded under this id in this session"
            rec.last_used = self.clock()
            space.recordings.move_to_end(key)  # type: ignore[arg-type]
            return Found(rec.prompt, rec.sequences[sequence_id], rec.version)

    def end_session(self, namespace: str, session_id: str) -> None:
        with self._lock:
            space = self._spaces.get(namespace)
            if space is None:
                return
            for key in [k for k, r in space.recordings.items() if r.session_id == session_id]:
                self._drop_locked(space, key, "its session has ended")
            self._forget_empty_locked(namespace, space)

    def sweep(self, session_open: Callable[[str, str], bool] | None = None) -> None:
        """Drops recordings unused past the TTL, and those of sessions no longer open. The
        table is in order of last use, so expiry stops at the first one still fresh."""
        now = self.clock()
        with self._lock:
            for ns, space in list(self._spaces.items()):
                while space.recordings:
                    key, rec = next(iter(space.recordings.items()))
                    if now - rec.last_used <= self.limits.ttl_s:
                        break
                    self._drop_locked(space, key, f"expired: unused for {self.limits.ttl_s:g}s")
                closed = set()
                if session_open is not None:
                    closed = {sid for sid in space.sessions if not session_open(ns, sid)}
                for key in [k for k, r in space.recordings.items() if r.session_id in closed]:
                    self._drop_locked(space, key, "its session has ended")
                self._forget_empty_locked(ns, space)

    def held_tokens(self, namespace: str) -> int:
        with self._lock:
            space = self._spaces.get(namespace)
            return 0 if space is None else space.tokens

    def held_bytes(self, namespace: str | None = None) -> int:
        """The memory the recordings hold: a namespace's, or all of them."""
        with self._lock:
            spaces = (
                list(self._spaces.values())
                if namespace is None
                else [s for ns, s in self._spaces.items() if ns == namespace]
            )
            return sum(r.nbytes for s in spaces for r in s.recordings.values())

    def held_bytes_by_namespace(self) -> dict[str, int]:
        """Each namespace's recordings' memory (namespaces holding none are left out)."""
        with self._lock:
            held = {
                ns: sum(r.nbytes for r in s.recordings.values()) for ns, s in self._spaces.items()
            }
        return {ns: n for ns, n in held.items() if n}

    def _drop_locked(self, space: _Space, key: str, why: str) -> None:
        rec = space.recordings.pop(key, None)
        if rec is None:
            return
        space.tokens -= rec.tokens
        left = space.sessions.pop(rec.session_id) - 1
        if left:
            space.sessions[rec.session_id] = left
        for sid in rec.sequences:
            space.owner.pop(sid, None)
            space.gone[sid] = why
        while len(space.gone) > GONE_KEPT:
            space.gone.popitem(last=False)

    def _forget_empty_locked(self, namespace: str, space: _Space) -> None:
        if not space.recordings and not space.gone:
            del self._spaces[namespace]
