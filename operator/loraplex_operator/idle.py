"""The idle TTL of client experiments (``spec.client.idleSeconds``; docs/design/gateway.md,
"unload_model and the idle TTL"): pure decisions, no I/O.

Who does what: the engine measures (it sees every call: ``idleSeconds`` in the
experiment's status), the operator suspends (``spec.suspend: true`` with
``IDLE_ANNOTATION``, so the suspend path everyone knows checkpoints it and frees its
slot), and the gateway resumes on the next call naming the model (it clears both,
answering "paused" meanwhile). A tenant's own ``suspend`` carries no annotation: the
gateway leaves that model suspended.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

IDLE_ANNOTATION = "loraplex.dev/idle-suspended"
IDLE_DEFAULT_S = 3600  # loraplex_engine/spec/client.py IDLE_DEFAULT_S (a test ties them)


def idle_seconds(spec: Mapping[str, Any]) -> int | None:
    """A client experiment's TTL from its spec (None: a task experiment, or 0 = never)."""
    client = spec.get("client")
    if not isinstance(client, Mapping):
        return None
    ttl = client.get("idleSeconds", IDLE_DEFAULT_S)
    return int(ttl) if isinstance(ttl, int) and ttl > 0 else None


def due(spec: Mapping[str, Any], engine_status: Mapping[str, Any] | None) -> float | None:
    """How long the model has been idle, when that is at least its TTL (suspend it); else
    None (a task experiment, no TTL, an engine that does not report idleness, or not yet)."""
    ttl = idle_seconds(spec)
    idle = (engine_status or {}).get("idleSeconds")
    if ttl is None or isinstance(idle, bool) or not isinstance(idle, int | float):
        return None
    return float(idle) if idle >= ttl else None


def suspend_patch(now: datetime) -> dict[str, Any]:
    """The merge patch the operator writes: suspended, and marked as suspended for idleness."""
    return {
        "metadata": {"annotations": {IDLE_ANNOTATION: now.isoformat()}},
        "spec": {"suspend": True},
    }


def resume_patch() -> dict[str, Any]:
    """The merge patch the gateway writes on the next call: running again, mark removed."""
    return {"metadata": {"annotations": {IDLE_ANNOTATION: None}}, "spec": {"suspend": False}}


def merged(obj: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` with a JSON merge patch applied (RFC 7386: ``None`` removes a field)."""
    out = dict(obj)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merged(out[k], v)
        else:
            out[k] = merged({}, v) if isinstance(v, Mapping) else v
    return out


def idle_suspended(obj: Mapping[str, Any]) -> bool:
    """Suspended by its idle TTL (not by its tenant): the next call resumes it."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return bool((obj.get("spec") or {}).get("suspend")) and IDLE_ANNOTATION in annotations
