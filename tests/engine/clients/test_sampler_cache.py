"""The in-memory sampler weights (clients/sampler_cache.py): bounded per model and per
namespace, newest kept; a TTL ends one; a namespace sees only its own; a path that is gone
says why."""

from __future__ import annotations

import pytest
import torch
from loraplex_engine.clients.sampler_cache import SamplerCache, snapshot
from loraplex_engine.clients.saved import StateInfo, StatePath
from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.spec.errors import NotFoundError
from loraplex_engine.spec.training_service import ClientLora

CONFIG = LoRAConfig(rank=2, alpha=2.0, target_modules=("q_proj",))


def _put(cache: SamplerCache, ns: str, model: str, name: str, at: float, expires=None) -> StatePath:
    info = StateInfo(model, "sampler_weights", name, ClientLora(rank=2), 1, "x", at, expires)
    cache.put(ns, snapshot(info, CONFIG, {"w": torch.ones(2, 2)}))
    return StatePath(model, "sampler_weights", name)


def test_newest_per_model_and_per_namespace_are_kept() -> None:
    cache = SamplerCache(per_model=2, per_namespace=3)
    a = [_put(cache, "ns", "a", f"s{i}", float(i)) for i in range(4)]
    assert [s.path for s in cache.listed("ns", "a", 10.0)] == a[2:]
    with pytest.raises(NotFoundError, match="newest 2 of its model"):
        cache.get("ns", a[0], 10.0)
    b = [_put(cache, "ns", "b", f"s{i}", 10.0 + i) for i in range(2)]
    assert {s.path for s in cache.listed("ns", None, 20.0)} == {a[3], *b}
    with pytest.raises(NotFoundError, match="newest 3 of its namespace"):
        cache.get("ns", a[2], 20.0)


def test_ttl_delete_and_namespaces() -> None:
    cache = SamplerCache()
    short = _put(cache, "ns", "m", "short", 0.0, expires=5.0)
    kept = _put(cache, "ns", "m", "kept", 0.0)
    assert cache.get("ns", short, 4.9).path == short
    with pytest.raises(NotFoundError, match="expired"):
        cache.get("ns", short, 5.0)
    with pytest.raises(NotFoundError, match="never saved"):
        cache.get("other", kept, 0.0)  # another namespace's path: not there
    assert not cache.remove("other", kept) and cache.remove("ns", kept)
    with pytest.raises(NotFoundError, match="deleted"):
        cache.get("ns", kept, 0.0)
    again = _put(cache, "ns", "m", "again", 0.0)
    assert cache.set_expires("ns", again, 1.0) and cache.find("ns", again, 2.0) is None


def test_a_snapshot_owns_its_tensors() -> None:
    live = torch.zeros(2, 2)
    info = StateInfo("m", "sampler_weights", "s", ClientLora(rank=2), 1, "x", 0.0)
    snap = snapshot(info, CONFIG, {"w": live})
    live += 1  # the slot trains on
    assert snap.tensors["w"].sum() == 0 and snap.size_bytes == 16
