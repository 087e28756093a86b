"""Client models' saved states, wherever each kind lives: ``weights`` (adapter and
optimiser state) and ``external_weights`` (a PEFT directory to download) on the checkpoint
volume, under the namespace's quota (clients/saved.py); ``sampler_weights`` in memory,
bounded (clients/sampler_cache.py). Saving, finding, listing, deleting and TTLs, all
keyed by the caller's namespace: another namespace's path is not found.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from loraplex_engine.clients import saved
from loraplex_engine.clients.ops import ClientModel
from loraplex_engine.clients.parts import ClientParts
from loraplex_engine.clients.sampler_cache import SamplerCache, Snapshot, snapshot
from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.spec.errors import InvalidRequestError, NotFoundError
from loraplex_engine.spec.tinker_paths import MAX_TTL_S
from loraplex_engine.spec.training_service import SavedState
from loraplex_engine.store import checkpoint as ckpt
from loraplex_engine.store.quota import tree_bytes

EXPORT_FILES = (ckpt.ADAPTER_CONFIG, ckpt.ADAPTER_WEIGHTS)  # what a download holds


@dataclass(frozen=True)
class Found:
    """A saved state: on the volume (``directory``) or in memory (``snapshot``)."""

    info: saved.StateInfo
    directory: Path | None = None
    snapshot: Snapshot | None = None

    @property
    def config(self) -> LoRAConfig:
        if self.snapshot is not None:
            return self.snapshot.config
        assert self.directory is not None
        return ckpt.read_adapter_config(self.directory)

    def load_weights(self, model: MultiLoRAModel, adapter: str) -> None:
        """Its adapter weights into the loaded ``adapter``."""
        if self.snapshot is not None:
            model.load_adapter_state_dict(adapter, self.snapshot.tensors)
        else:
            assert self.directory is not None
            ckpt.load_adapter(model, adapter, self.directory)


def check_ttl(ttl_s: float | None, field: str = "ttl_seconds") -> float | None:
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidRequestError(f"{field} must be 1 to {MAX_TTL_S} seconds, or null", field)
    return float(ttl_s)


class ClientCheckpoints:
    def __init__(self, parts: Callable[[], ClientParts], cache: SamplerCache | None = None):
        self._parts = parts
        self.cache = cache or SamplerCache()

    def save(
        self, model: ClientModel, name: str, kind: saved.Kind, ttl_s: float | None = None
    ) -> SavedState:
        """The model's adapter as ``kind`` (with ``weights``, its optimiser state too)."""
        h, info = self._parts(), model.info
        with h.model_lock:
            h.pager.page_in(model.name)  # paged out: its slot again, to be read
        created = saved.now()
        expires = None if ttl_s is None else created + ttl_s
        stored = saved.StateInfo(
            info.model_id, kind, name, info.lora, model.version, model.incarnation, created, expires
        )
        if kind == "sampler_weights":
            config = h.model.config_of(model.name)
            snap = snapshot(stored, config, h.model.adapter_views(model.name))  # copied once
            self.cache.put(info.namespace, snap)
            return _state(snap.info, snap.size_bytes)
        target = saved.StatePath(info.model_id, kind, name).directory(h.root, info.namespace)
        if h.quota is not None:
            saved.list_saved(h.root, info.namespace, None)  # expired states removed first
            tensors = h.model.adapter_state_dict(model.name).values()
            writing = (3 if kind == "weights" else 1) * 4 * sum(t.numel() for t in tensors)
            h.quota.check(h.root, info.namespace, writing, saved.removable(target))
        with ckpt.atomic_dir(target, overwrite=True) as tmp:
            ckpt.save_adapter(h.model, model.name, tmp, base_model_name_or_path=str(h.model_dir))
            if kind == "weights":
                ckpt.save_trainer_state(tmp, h.optimizer, model.name, model.generator)
            saved.write_info(tmp, stored)
        return _state(stored, tree_bytes(target))

    def find(self, namespace: str, state: saved.StatePath) -> Found:
        """The caller's state at ``state``; NotFoundError (saying why) when none."""
        if state.kind == "sampler_weights":
            snap = self.cache.find(namespace, state, saved.now())
            if snap is not None:
                return Found(snap.info, snapshot=snap)
            directory = state.directory(self._parts().root, namespace)
            if not (directory / saved.STATE_FILE).is_file():  # none left by an older engine
                self.cache.get(namespace, state, saved.now())  # raises, saying why
        directory = state.directory(self._parts().root, namespace)
        return Found(saved.read_info(directory, state.uri), directory=directory)

    def saved_state(self, namespace: str, state: saved.StatePath) -> SavedState:
        found = self.find(namespace, state)
        if found.snapshot is not None:
            return _state(found.info, found.snapshot.size_bytes)
        assert found.directory is not None
        return _state(found.info, tree_bytes(found.directory))

    def listed(self, namespace: str, model_id: str | None) -> list[SavedState]:
        on_disk = saved.list_saved(self._parts().root, namespace, model_id)
        held = self.cache.listed(namespace, model_id, saved.now())
        found = on_disk + [_state(s.info, s.size_bytes) for s in held]
        return sorted(found, key=lambda s: (s.created, s.path))

    def delete(self, namespace: str, path: str) -> None:
        state = saved.parse_path(path)
        if state.kind == "sampler_weights" and self.cache.remove(namespace, state):
            return
        directory = state.directory(self._parts().root, namespace)
        if not (directory / saved.STATE_FILE).is_file():
            raise NotFoundError(f"no checkpoint {path!r}", field="checkpoint_id")
        shutil.rmtree(directory, ignore_errors=True)

    def set_ttl(self, namespace: str, path: str, ttl_s: float | None) -> None:
        state = saved.parse_path(path)
        ttl_s = check_ttl(ttl_s)
        expires = None if ttl_s is None else saved.now() + ttl_s
        if state.kind == "sampler_weights" and self.cache.set_expires(namespace, state, expires):
            return
        found = self.find(namespace, state)
        assert found.directory is not None
        tmp = found.directory / f".{saved.STATE_FILE}.tmp"
        saved.write_info(tmp.parent, replace(found.info, expires=expires), tmp.name)
        os.replace(tmp, found.directory / saved.STATE_FILE)

    def files(self, namespace: str, path: str) -> dict[str, Path]:
        """An ``external_weights`` state's PEFT files, by name."""
        state = saved.parse_path(path, field="checkpoint_id")
        if state.kind != "external_weights":
            raise InvalidRequestError(
                "only external_weights checkpoints have download URLs", field="checkpoint_id"
            )
        found = self.find(namespace, state)
        assert found.directory is not None
        return {name: found.directory / name for name in EXPORT_FILES}


def _state(info: saved.StateInfo, size: int) -> SavedState:
    uri = saved.StatePath(info.model_id, info.kind, info.name).uri
    return SavedState(uri, info.kind, info.model_id, info.name, info.created, size, info.expires)
