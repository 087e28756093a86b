"""Sampler weights (``save_weights_for_sampler``) held in memory, never on the volume.

The SDK documents them as ephemeral: an RL loop saves one every step only to sample it,
and kept as checkpoints they filled the volume (one full adapter a step). Here a
snapshot is the adapter's tensors copied to host memory with the ``StateInfo`` that
tells the sampler whether the live slot still is that version (clients/sampling.py).

Bounds, newest kept: ``per_model`` snapshots of one model and ``per_namespace`` of a
namespace (a model unloaded keeps its snapshots until newer ones push them out), so the
memory held is at most ``per_namespace`` adapters a namespace. A ``ttl_seconds`` ends
one sooner. An engine restart drops them all (``save_state`` is the durable kind). A
path that is gone says why: deleted, expired, pushed out or never saved.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from loraplex_engine.clients.saved import StateInfo, StatePath
from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.spec.errors import NotFoundError

PER_MODEL = 4  # an RL loop samples the newest; a few more cover samplers still running
PER_NAMESPACE = 16
_GONE_KEPT = 4096  # why a path is gone, for the error of a late sampler (bounded)


@dataclass(frozen=True)
class Snapshot:
    """One sampler_weights state: the adapter as it was, on the host."""

    info: StateInfo
    config: LoRAConfig
    tensors: dict[str, torch.Tensor]  # PEFT key names, on the CPU

    @property
    def path(self) -> StatePath:
        return StatePath(self.info.model_id, self.info.kind, self.info.name)

    @property
    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def expired(self, now: float) -> bool:
        return self.info.expires is not None and now >= self.info.expires


def snapshot(info: StateInfo, config: LoRAConfig, tensors: dict[str, torch.Tensor]) -> Snapshot:
    """A snapshot owning host copies of ``tensors`` (the slot trains on after this)."""
    copies = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    return Snapshot(info, config, copies)


class SamplerCache:
    def __init__(self, per_model: int = PER_MODEL, per_namespace: int = PER_NAMESPACE) -> None:
        self.per_model = per_model
        self.per_namespace = per_namespace
        self._lock = threading.Lock()
        self._held: dict[str, dict[StatePath, Snapshot]] = {}
        self._gone: OrderedDict[tuple[str, StatePath], str] = OrderedDict()

    def put(self, namespace: str, snap: Snapshot) -> None:
        with self._lock:
            held = self._held.setdefault(namespace, {})
            held.pop(snap.path, None)
            held[snap.path] = snap
            self._gone.pop((namespace, snap.path), None)
            self._evict(namespace, snap.info.created)

    def get(self, namespace: str, path: StatePath, now: float) -> Snapshot:
        """The snapshot at ``path``; NotFoundError saying why when it is gone."""
        with self._lock:
            self._evict(namespace, now)
            snap = self._held.get(namespace, {}).get(path)
            if snap is None:
                why = self._gone.get((namespace, path), "never saved (or the engine restarted)")
                raise NotFoundError(f"no sampler weights {path.uri!r}: {why}", field="model_path")
            return snap

    def find(self, namespace: str, path: StatePath, now: float) -> Snapshot | None:
        try:
            return self.get(namespace, path, now)
        except NotFoundError:
            return None

    def listed(self, namespace: str, model_id: str | None, now: float) -> list[Snapshot]:
        with self._lock:
            self._evict(namespace, now)
            held = self._held.get(namespace, {}).values()
            return [s for s in held if model_id is None or s.info.model_id == model_id]

    def remove(self, namespace: str, path: StatePath) -> bool:
        with self._lock:
            if self._held.get(namespace, {}).pop(path, None) is None:
                return False
            self._forget(namespace, path, "deleted")
            return True

    def set_expires(self, namespace: str, path: StatePath, expires: float | None) -> bool:
        with self._lock:
            held = self._held.get(namespace, {})
            snap = held.get(path)
            if snap is None:
                return False
            held[path] = replace(snap, info=replace(snap.info, expires=expires))
            return True

    def _evict(self, namespace: str, now: float) -> None:
        """Drop the namespace's expired snapshots, then the oldest past each bound."""
        held = self._held.get(namespace, {})
        for path, snap in list(held.items()):
            if snap.expired(now):
                del held[path]
                self._forget(namespace, path, "expired (its ttl_seconds passed)")
        by_age = sorted(held.values(), key=lambda s: s.info.created)
        counts: dict[str, int] = {}
        for snap in reversed(by_age):  # newest first
            counts[snap.info.model_id] = counts.get(snap.info.model_id, 0) + 1
            if counts[snap.info.model_id] > self.per_model:
                self._push_out(namespace, snap, f"the newest {self.per_model} of its model")
        left = sorted(held.values(), key=lambda s: s.info.created)
        for snap in left[: max(0, len(left) - self.per_namespace)]:
            self._push_out(namespace, snap, f"the newest {self.per_namespace} of its namespace")

    def _push_out(self, namespace: str, snap: Snapshot, kept: str) -> None:
        self._held[namespace].pop(snap.path, None)
        why = f"pushed out by newer ones (the engine keeps {kept} in memory)"
        self._forget(namespace, snap.path, why)

    def _forget(self, namespace: str, path: StatePath, why: str) -> None:
        self._gone[(namespace, path)] = why
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)
