"""A client model's ``tinker://`` paths and the names a saved state may take: the
contract the Tinker door (server/tinker/) and the client models (clients/saved.py) share,
so that the door checks a path without reaching into the engine.

``tinker://<model_id>/<kind>/<name>`` (kind ``weights``, ``sampler_weights`` or
``external_weights``) lives at ``<root>/<namespace>/_tinker/<model_id>/<kind>/<name>/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from loraplex_engine.spec.errors import InvalidRequestError

MAX_TTL_S = 10 * 365 * 86400  # the SDK's bound on ttl_seconds: ten years
SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights", "external_weights")
CLIENT_DIR = "_tinker"
Kind = Literal["weights", "sampler_weights", "external_weights"]
# ":" for the ids the Tinker protocol hands out (server/tinker/state.py: <session>:train:<n>).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


# The engine's own saves (a model's last weights when it unloads, a vanished client's)
# are named under this prefix, which a client's save is refused: the engine never
# overwrites a checkpoint a client named (every cookbook recipe names its last "final").
ENGINE_PREFIX = "loraplex-"


def engine_name(name: str) -> str:
    """The name the engine saves ``name`` under: one no client can write."""
    return ENGINE_PREFIX + name


def reserved(name: str) -> bool:
    return name.startswith(ENGINE_PREFIX)


def valid_name(value: str) -> bool:
    """A model id or state name the store may use as one directory name."""
    return _NAME.fullmatch(value) is not None and ".." not in value


@dataclass(frozen=True)
class StatePath:
    model_id: str
    kind: Kind
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"

    def directory(self, root: Path, namespace: str) -> Path:
        return root / namespace / CLIENT_DIR / self.model_id / self.kind / self.name


def parse_path(path: str, field: str = "path") -> StatePath:
    """``tinker://<model_id>/<kind>/<name>``, or InvalidRequestError naming ``field``."""
    parts = path[len(SCHEME) :].split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(valid_name(p) for p in parts[::2]):
        raise InvalidRequestError(
            f"{path!r} is not a saved state's path: tinker://<model_id>/<kind>/<name>, "
            f"kind one of {list(KINDS)}",
            field=field,
        )
    return StatePath(parts[0], cast(Kind, parts[1]), parts[2])
