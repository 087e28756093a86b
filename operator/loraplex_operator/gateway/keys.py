"""Tenants' API keys as the gateway holds them: labelled Secrets, read as digests.

A key is a Secret in the tenant's namespace labelled ``loraplex.dev/api-key: "true"``
whose ``key`` field holds ``tml-...`` (or ``sha256:<64 hex>``, its digest); the label
``loraplex.dev/api-key-role`` says what it may do: ``sample`` (read-only: list, sample,
complete) or ``train`` (also create models and step them). A Secret without a role is
``sample``: the least a key can be. The namespace is the Secret's own, which no tenant
can forge. Pure: the table is built from Secret objects (directory.py lists them).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

KEY_LABEL = "loraplex.dev/api-key"
ROLE_LABEL = "loraplex.dev/api-key-role"
KEY_FIELD = "key"
KEY_PREFIX = "tml-"
MIN_KEY_CHARS = 20  # "tml-" and at least 16 characters of secret (the engine's rule)
SAMPLE, TRAIN = "sample", "train"
ROLES = (SAMPLE, TRAIN)
DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")

# Tinker routes (under /api/v1) that change a model: a sample key is refused them (403).
TRAIN_ROUTES = frozenset(
    {
        "create_model",
        "forward_backward",
        "forward",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "save_weights_external",
        "load_weights",
        "unload_model",
        "training_runs/{}/checkpoints/{}/{}",  # DELETE
        "training_runs/{}/checkpoints/{}/{}/ttl",
    }
)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class Key:
    digest: bytes
    namespace: str
    role: str
    secret: str  # the Secret's name (logs and errors; never the key)

    def may(self, route: str) -> bool:
        """Whether this key may call the Tinker ``route`` (its name under /api/v1)."""
        return self.role == TRAIN or route not in TRAIN_ROUTES


def _field(secret: Mapping[str, Any], name: str) -> str | None:
    plain = (secret.get("stringData") or {}).get(name)
    if isinstance(plain, str):
        return plain
    encoded = (secret.get("data") or {}).get(name)
    if not isinstance(encoded, str):
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def parse_secret(secret: Mapping[str, Any]) -> Key | str:
    """The key a labelled Secret holds, or why it holds none (a problem to log)."""
    meta = secret.get("metadata") or {}
    where = f"Secret {meta.get('namespace')}/{meta.get('name')}"
    namespace, name = meta.get("namespace"), meta.get("name")
    if not namespace or not name:
        return f"{where}: no namespace or name"
    role = (meta.get("labels") or {}).get(ROLE_LABEL, SAMPLE)
    if role not in ROLES:
        return f"{where}: label {ROLE_LABEL}={role!r} is not one of {', '.join(ROLES)}"
    text = (_field(secret, KEY_FIELD) or "").strip()
    m = DIGEST.match(text)
    if m:
        return Key(bytes.fromhex(m.group(1)), namespace, role, name)
    if not text.startswith(KEY_PREFIX) or len(text) < MIN_KEY_CHARS:
        return (
            f"{where}: field {KEY_FIELD!r} must hold {KEY_PREFIX}... (at least "
            f"{MIN_KEY_CHARS} characters) or sha256:<64 hex digits>"
        )
    return Key(digest(text), namespace, role, name)


class KeyTable:
    """Digests only. :meth:`lookup` hashes a presented key and compares it with every
    digest in constant time, with no early exit."""

    def __init__(self, keys: Iterable[Key] = ()) -> None:
        self._keys = tuple(keys)

    @classmethod
    def from_secrets(cls, secrets: Iterable[Mapping[str, Any]]) -> tuple[KeyTable, list[str]]:
        keys: list[Key] = []
        problems: list[str] = []
        for s in secrets:
            parsed = parse_secret(s)
            if isinstance(parsed, Key):
                keys.append(parsed)
            else:
                problems.append(parsed)
        return cls(keys), problems

    def lookup(self, presented: str | None) -> Key | None:
        if not presented or not presented.startswith(KEY_PREFIX):
            return None
        given = digest(presented)
        found: Key | None = None
        for key in self._keys:
            if hmac.compare_digest(given, key.digest) and found is None:
                found = key
        return found

    def __len__(self) -> int:
        return len(self._keys)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: ``X-API-Key`` (the Tinker SDK's header) or a bearer
    token (the OpenAI clients')."""
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    auth = headers.get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return None
