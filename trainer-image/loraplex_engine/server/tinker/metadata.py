"""Bounds on what a Tinker client may have the engine keep: a session's or a model's
``user_metadata`` (kept for as long as the session lives) and the number of open
sessions per namespace (``serve --tinker-max-sessions``). Without them one key could
grow the engine's memory by megabytes a call, for every tenant.
"""

from __future__ import annotations

import json
from typing import Any

MAX_METADATA_BYTES = 16 * 1024  # the whole of it, as compact JSON
MAX_METADATA_KEYS = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 4096  # a string value; nested ones count in the total


def check_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``user_metadata`` within the bounds, or ``ValueError`` saying which (pydantic
    reports it as a 422 naming ``user_metadata``)."""
    if value is None:
        return None
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"{len(value)} keys; at most {MAX_METADATA_KEYS}")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"a key of {len(key)} characters; at most {MAX_METADATA_KEY_CHARS}")
        if isinstance(item, str) and len(item) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(
                f"the value of {key[:40]!r} has {len(item)} characters; "
                f"at most {MAX_METADATA_VALUE_CHARS}"
            )
    size = len(json.dumps(value, separators=(",", ":"), default=str).encode())
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"{size} bytes as JSON; at most {MAX_METADATA_BYTES}")
    return value
