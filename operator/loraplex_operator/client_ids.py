"""Which ``spec.client.modelId`` a client experiment may claim: one its own name spells
(pure, no I/O).

A model id is how a Tinker client names its model on the engine, and it is visible to
others (a co-tenant may learn it); the engine keys models by (namespace, id), and the
operator ties the id to the experiment's name, which only its namespace can hold:

- the gateway's spelling (gateway/experiments.py): ``tinker-<session>-<n>`` holds
  ``<session>:train:<n>``;
- a client experiment written by hand: ``<name>`` holds ``<name>:train:<n>``.

Anything else is an admission problem naming ``spec.client.modelId``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MODEL_ID = re.compile(r"^(.+):train:([0-9]{1,10})$")
GATEWAY_PREFIX = "tinker-"  # gateway/experiments.py PREFIX


def allowed_ids(name: str) -> str:
    """The model ids the experiment ``name`` may claim, in words (for the message)."""
    ids = [f"'{name}:train:<n>'"]
    if name.startswith(GATEWAY_PREFIX) and "-" in name[len(GATEWAY_PREFIX) :]:
        session, _, seq = name[len(GATEWAY_PREFIX) :].rpartition("-")
        ids.append(f"'{session}:train:{seq}'")
    return " or ".join(ids)


def matches(name: str, model_id: str) -> bool:
    m = MODEL_ID.match(model_id)
    if m is None:
        return False
    session, seq = m.group(1), int(m.group(2))
    return session == name or name == f"{GATEWAY_PREFIX}{session}-{seq}"


def problem(name: str, client: Mapping[str, Any]) -> str | None:
    """Why ``client.modelId`` is not the experiment's own (None when it is)."""
    model_id = client.get("modelId")
    if isinstance(model_id, str) and matches(name, model_id):
        return None
    return (
        f"model id {model_id!r} is not this experiment's: a client experiment named "
        f"{name!r} may hold {allowed_ids(name)} (a model id is tied to the experiment's "
        "name, so no experiment can claim another's model)"
    )
