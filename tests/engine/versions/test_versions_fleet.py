"""What the fleet sync (versions/fleet.py) loads into vLLM: every alias of the watched
experiments and the versions they point at, never a version whose files do not match
its manifest. The sync against a real vLLM server: test_versions_vllm.py."""

from __future__ import annotations

from pathlib import Path

from loraplex_engine.store.versions import Manifest, VersionStore
from loraplex_engine.versions.fleet import Watch, wanted


def _publish(store: VersionStore) -> None:
    def write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text("{}")
        (tmp / "adapter_model.safetensors").write_bytes(b"w")

    def manifest(n: int, parent: int | None, digest: str) -> Manifest:
        return Manifest(version=n, experiment="ns.exp", run_id="r", parent=parent,
                        base_model="m", base_model_hash="h", step=n, content_hash=digest,
                        created_at="2026-01-01T00:00:00Z")  # fmt: skip

    store.publish("ns", "exp", write, manifest, keep=10)


def test_aliases_and_their_versions_and_nothing_tampered(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    for _ in range(3):
        _publish(store)
    store.write_aliases("ns", "exp", {"latest": 3, "stable": 2, "canary": 1})
    got = wanted(store, [Watch("ns", "exp"), Watch("ns", "none")])
    assert got == {
        "ns.exp:canary": store.path("ns", "exp", 1),
        "ns.exp@v1": store.path("ns", "exp", 1),
        "ns.exp:latest": store.path("ns", "exp", 3),
        "ns.exp@v3": store.path("ns", "exp", 3),
        "ns.exp:stable": store.path("ns", "exp", 2),
        "ns.exp@v2": store.path("ns", "exp", 2),
    }
    (store.path("ns", "exp", 1) / "adapter_model.safetensors").write_bytes(b"evil")
    got = wanted(store, [Watch("ns", "exp")])
    assert "ns.exp:canary" not in got and "ns.exp@v1" not in got
    assert got["ns.exp:stable"] == store.path("ns", "exp", 2)
