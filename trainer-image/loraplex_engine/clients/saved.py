"""Client models' saved states on the checkpoint volume, and their ``tinker://`` paths.

``tinker://<model_id>/<kind>/<name>`` (kind ``weights``, ``sampler_weights`` or
``external_weights``) lives at ``<root>/<namespace>/_tinker/<model_id>/<kind>/<name>/``
(``sampler_weights`` only when an older engine wrote it: they are held in memory now,
clients/sampler_cache.py): under the caller's namespace, so
the namespace's checkpoint quota counts it (store/quota.py) and a path of another
namespace is simply not there (NotFoundError). ``_tinker`` cannot be an experiment's
name (Kubernetes names have no ``_``), so it never meets the run store's directories.

Each directory is a PEFT adapter (store/checkpoint.py), written atomically; ``weights``
adds the optimiser state (the run store's trainer-state files), and both carry
``client_state.json``: the model, its LoRA settings and the adapter *version* saved (the
model's count of weight changes, with the id of the model's incarnation), which tells
the sampler whether the live adapter still is that version, and when it expires
(``ttl_seconds``): an expired state is removed when it is next looked up or listed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loraplex_engine.spec.errors import NotFoundError
from loraplex_engine.spec.tinker_paths import (  # noqa: F401  the paths' contract, re-exported
    CLIENT_DIR,
    ENGINE_PREFIX,
    KINDS,
    SCHEME,
    Kind,
    StatePath,
    engine_name,
    parse_path,
    reserved,
    valid_name,
)
from loraplex_engine.spec.training_service import ClientLora, SavedState
from loraplex_engine.store.quota import tree_bytes

STATE_FILE = "client_state.json"


@dataclass(frozen=True)
class StateInfo:
    """What ``client_state.json`` records."""

    model_id: str
    kind: Kind
    name: str
    lora: ClientLora
    version: int  # the model's weight version saved
    incarnation: str  # which load of the model (a model id may be created again)
    created: float
    expires: float | None = None  # unix seconds; None: kept until deleted

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "lora": asdict(self.lora)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StateInfo:
        return cls(**{**raw, "lora": ClientLora(**raw["lora"])})


def write_info(directory: Path, info: StateInfo, file: str = STATE_FILE) -> None:
    (directory / file).write_text(json.dumps(info.to_json(), indent=2) + "\n")


def read_info(directory: Path, uri: str) -> StateInfo:
    """The saved state at ``directory``; NotFoundError when there is none (also for a
    path of another namespace: it is looked for under the caller's)."""
    try:
        info = StateInfo.from_json(json.loads((directory / STATE_FILE).read_text()))
    except FileNotFoundError:
        raise NotFoundError(f"no saved state {uri!r}") from None
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise NotFoundError(f"saved state {uri!r} cannot be read: {e}") from None
    if info.expires is not None and now() >= info.expires:
        shutil.rmtree(directory, ignore_errors=True)
        raise NotFoundError(f"saved state {uri!r} expired (its ttl_seconds passed)")
    return info


def saved_state(directory: Path, info: StateInfo) -> SavedState:
    uri = StatePath(info.model_id, info.kind, info.name).uri
    size = tree_bytes(directory)
    return SavedState(uri, info.kind, info.model_id, info.name, info.created, size, info.expires)


def list_saved(root: Path, namespace: str, model_id: str | None) -> list[SavedState]:
    """The namespace's saved states (one model's, with ``model_id``), oldest first."""
    base = root / namespace / CLIENT_DIR
    found: list[SavedState] = []
    for file in base.glob(f"{model_id or '*'}/*/*/{STATE_FILE}"):
        try:
            found.append(saved_state(file.parent, read_info(file.parent, str(file.parent))))
        except NotFoundError:
            continue  # removed meanwhile, or half-written by a crash: not listed
    return sorted(found, key=lambda s: (s.created, s.path))


def now() -> float:
    return time.time()


def removable(directory: Path) -> list[Path]:
    """What overwriting ``directory`` frees (for the quota check)."""
    return [directory] if os.path.isdir(directory) else []
