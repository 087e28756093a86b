"""A namespace's share of an engine's adapter slots for client models (the Tinker
protocol's, and client experiments'): one tenant creating models as fast as it can must
leave room for the others (docs/design/tenancy.md, *Client models: slots*).

The rule: a namespace holds at most ``--client-models-per-namespace`` client models on
an engine; by default half the adapters it registers (``--max-registered``: its slots
when it does not page, memory/paging.py), rounded up. Fixed, not a share of the namespaces
seen so far: a tenant alone first would otherwise take every slot, and nothing could
give one back to a newcomer without unloading a model its client still drives (the
engine cannot suspend a plain Tinker model: no one would resume it). One namespace
beyond its share is refused at once (``NamespaceShareError``, naming the limit), never
parked, so it does not wait for itself.
"""

from __future__ import annotations

import math

from loraplex_engine.spec.errors import NamespaceShareError


def limit(slots: int, configured: int | None) -> int:
    """The most client models one namespace may hold on an engine registering ``slots``."""
    return configured if configured is not None else max(1, math.ceil(slots / 2))


def check(namespace: str, held: int, slots: int, configured: int | None) -> None:
    """Refuses one more client model of ``namespace`` when it holds ``held`` already."""
    most = limit(slots, configured)
    if held >= most:
        raise NamespaceShareError(
            f"namespace {namespace!r} holds {held} client models on this engine, its share "
            f"of the {slots} adapters the engine registers (--client-models-per-namespace "
            f"{most}); "
            "unload one of them first",
            field="model_id",
        )
