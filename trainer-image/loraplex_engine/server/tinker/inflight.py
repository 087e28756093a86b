"""Inflight sampling clients (the SDK's ``SamplingClientKind = "inflight"``): one mutable
weights target per training model, shared by all of its inflight sampling clients.

Each inflight ``save_weights_for_sampler`` writes an ordinary, immutable sampler-weights
checkpoint and makes it the model's current target (its version counts up); it returns a
new sampling session, as the SDK's contract has it. A sample on any of the model's
inflight sessions resolves the target once, when it is sent: it runs on exactly that one
published checkpoint (never a mix), the one current when it was sent or, for a later
sample, a newer one, and its sequence ids name it (``<request>:<i>@<checkpoint name>``).
Keyed by namespace like everything else: another namespace's model id is another key.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from loraplex_engine.spec.errors import InvalidRequestError, NotFoundError

KINDS = ("snapshot", "inflight")


@dataclass(frozen=True)
class Published:
    path: str  # tinker://<model>/sampler_weights/<name>
    version: int  # 1, 2, ...: the model's inflight saves so far

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def check_kind(body: dict[str, object]) -> str:
    """The save's ``kind``, checked (422 naming ``kind``)."""
    kind = body.get("kind", "snapshot")
    if kind not in KINDS:
        raise InvalidRequestError(f"kind must be one of {', '.join(KINDS)}", field="kind")
    if kind == "inflight" and body.get("path") is not None:
        raise InvalidRequestError(
            "an inflight save publishes the model's shared sampler weights: it takes no path",
            field="kind",
        )
    return str(kind)


def sequence_ids(request_id: str, n: int, published: Published | None) -> list[str]:
    if published is None:
        return [f"{request_id}:{i}" for i in range(n)]
    return [f"{request_id}:{i}@{published.name}" for i in range(n)]


class Inflight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._targets: dict[tuple[str, str], Published] = {}

    def publish(self, namespace: str, model_id: str, path: str) -> Published:
        with self._lock:
            before = self._targets.get((namespace, model_id))
            now = Published(path, 1 if before is None else before.version + 1)
            self._targets[(namespace, model_id)] = now
            return now

    def current(self, namespace: str, model_id: str) -> Published:
        with self._lock:
            found = self._targets.get((namespace, model_id))
        if found is None:
            raise NotFoundError(
                f"model {model_id!r} has published no inflight weights",
                field="sampling_session_id",
            )
        return found

    def forget(self, namespace: str, model_id: str) -> None:
        with self._lock:
            self._targets.pop((namespace, model_id), None)
