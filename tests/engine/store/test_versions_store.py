"""The versions store (store/versions.py): whole versions or none, retention, aliases, the
quota, and a writer killed with SIGKILL at random points (a real process publishing in a
loop: nothing is mocked)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from loraplex_engine.spec.errors import CheckpointError, CheckpointQuotaError
from loraplex_engine.store.quota import CheckpointQuota
from loraplex_engine.store.versions import (
    VERSIONS_DIR,
    Manifest,
    VersionStore,
    parse_version,
    versions_to_prune,
)

from tests.support import version_writer
from tests.support.child_processes import kill_group, spawn

WRITER = Path(version_writer.__file__)


def _manifest(n: int, parent: int | None, digest: str) -> Manifest:
    return Manifest(version=n, experiment="ns.exp", run_id="r", parent=parent, base_model="m",
                    base_model_hash="sha256:0", step=n, content_hash=digest,
                    created_at="2026-01-01T00:00:00Z")  # fmt: skip


def _writer(payload: bytes = b"w" * 100):
    def write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text("{}")
        (tmp / "adapter_model.safetensors").write_bytes(payload)

    return write


def test_retention_keeps_newest_and_protected() -> None:
    assert versions_to_prune([1, 2, 3, 4, 5], keep=2) == [1, 2, 3]
    assert versions_to_prune([1, 2, 3, 4, 5], keep=2, protected=[1, 4]) == [2, 3]
    assert versions_to_prune([1, 2], keep=5) == []
    assert versions_to_prune([3, 1, 2], keep=1, protected=[9]) == [1, 2]


def test_version_names() -> None:
    assert parse_version("v1") == 1 and parse_version("v120") == 120
    for bad in ("v0", "v01", "1", "v", "v1x", "V1", "v-1", "v1234567890"):
        assert parse_version(bad) is None, bad


def test_publish_numbers_chains_and_prunes(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    for _ in range(4):
        store.publish("ns", "exp", _writer(), _manifest, keep=2, protected=[1])
    assert store.list("ns", "exp") == [1, 3, 4]  # v2 pruned; v1 protected
    m = store.read("ns", "exp", 4, verify=True)
    assert (m.version, m.parent) == (4, 3)
    assert store.read("ns", "exp", 1).parent is None


def test_tampered_version_fails_verification(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    store.publish("ns", "exp", _writer(), _manifest, keep=3)
    (store.path("ns", "exp", 1) / "adapter_model.safetensors").write_bytes(b"evil")
    store.read("ns", "exp", 1)  # the manifest alone still reads
    with pytest.raises(CheckpointError, match="content hash"):
        store.read("ns", "exp", 1, verify=True)


def test_failed_write_leaves_no_version(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)

    def broken(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text("{}")
        raise OSError("disk on fire")

    with pytest.raises(OSError):
        store.publish("ns", "exp", broken, _manifest, keep=3)
    assert store.list("ns", "exp") == []
    assert list(store.dir("ns", "exp").iterdir()) == []
    store.publish("ns", "exp", _writer(), _manifest, keep=3)
    assert store.list("ns", "exp") == [1]


def test_quota_refuses_before_writing(tmp_path: Path) -> None:
    store = VersionStore(tmp_path, CheckpointQuota(bytes_per_namespace=1500))
    store.publish("ns", "exp", _writer(b"x" * 300), _manifest, keep=5, estimate_bytes=300)
    store.publish("ns", "exp", _writer(b"x" * 300), _manifest, keep=5)
    with pytest.raises(CheckpointQuotaError, match=r"publish\.keep"):
        store.publish("ns", "exp", _writer(b"x" * 300), _manifest, keep=5)
    assert store.list("ns", "exp") == [1, 2]
    # keep 1: the write frees v1 and v2, so it fits
    store.publish("ns", "exp", _writer(b"x" * 300), _manifest, keep=1)
    assert store.list("ns", "exp") == [3]


def test_the_last_request_token_survives_a_kill_and_retention(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)

    def asked(token: str | None):
        def manifest(n: int, parent: int | None, digest: str) -> Manifest:
            return _manifest(n, parent, digest).model_copy(update={"request_token": token})

        return manifest

    assert store.read_token("ns", "exp") is None
    store.publish("ns", "exp", _writer(), asked("r1"), keep=1)
    # killed before the request file was written: the manifest tells
    assert store.read_token("ns", "exp") == "r1"
    store.write_token("ns", "exp", "r1", 1)
    store.publish("ns", "exp", _writer(), asked(None), keep=1)  # v1 pruned
    assert store.list("ns", "exp") == [2] and store.read_token("ns", "exp") == "r1"
    store.publish("ns", "exp", _writer(), asked("r2"), keep=1)  # v3, its file not written
    assert store.read_token("ns", "exp") == "r2"  # newer than the file's v1
    # a hostile or torn file: the manifests still answer, nothing raises
    (store.dir("ns", "exp") / "request.json").write_text('{"requestToken": 7, "version": "x"}')
    assert store.read_token("ns", "exp") == "r2"
    (store.dir("ns", "exp") / "request.json").write_text("{not json")
    assert store.read_token("ns", "exp") == "r2"


def test_aliases_round_trip_and_hostile_file(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    store.write_aliases("ns", "exp", {"stable": 3, "latest": 5})
    assert store.read_aliases("ns", "exp") == {"stable": 3, "latest": 5}
    raw = json.loads((store.dir("ns", "exp") / "aliases.json").read_text())
    assert raw == {"latest": "v5", "stable": "v3"}
    (store.dir("ns", "exp") / "aliases.json").write_text('{"a": "v1", "b": "../x", "c": 3}')
    assert store.read_aliases("ns", "exp") == {"a": 1}
    (store.dir("ns", "exp") / "aliases.json").write_text("not json")
    assert store.read_aliases("ns", "exp") == {}
    assert VERSIONS_DIR.startswith("_")  # never a valid run id: run pruning never takes it


def _check_whole(store: VersionStore) -> list[int]:
    seen = store.list("ns", "exp")
    for n in seen:
        try:
            m = store.read("ns", "exp", n, verify=True)
        except CheckpointError as e:  # pruned meanwhile is fine; keep=1000 prunes nothing
            raise AssertionError(f"v{n} is visible but not whole: {e}") from e
        assert m.version == n
    return seen


def _run_writer(root: Path, count: int, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(WRITER), str(root), str(count), *extra]
    return spawn(cmd, "version writer", stdout=subprocess.PIPE, text=True)


def test_sigkill_mid_write_leaves_no_version_and_the_sequence_continues(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    proc = _run_writer(tmp_path, 1, "--pause-in-write")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("writing .v1.tmp-"), line
    kill_group(proc)
    leftovers = [p.name for p in store.dir("ns", "exp").iterdir()]
    assert leftovers and all(n.startswith(".v1.tmp-") for n in leftovers)
    assert store.list("ns", "exp") == []
    proc = _run_writer(tmp_path, 2)
    assert proc.wait(120) == 0
    assert _check_whole(store) == [1, 2]
    assert [p.name for p in store.dir("ns", "exp").iterdir() if p.name.startswith(".")] == []


def test_sigkill_at_random_points_while_a_reader_watches(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    rng = random.Random(7)
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                _check_whole(store)
                reads[0] += 1
            except AssertionError as e:
                errors.append(str(e))

    watcher = threading.Thread(target=reader, daemon=True)
    watcher.start()
    published = 0
    try:
        for _ in range(4):
            proc = _run_writer(tmp_path, 1000)
            assert proc.stdout is not None
            # let it publish one version at least, then kill it at a random point after
            first = proc.stdout.readline()
            assert first.startswith("published v"), first
            time.sleep(rng.uniform(0.0, 0.5))
            kill_group(proc)
            seen = _check_whole(store)
            assert seen == list(range(1, len(seen) + 1)), "a gap: a number was reused or lost"
            assert len(seen) > published
            published = len(seen)
    finally:
        stop.set()
        watcher.join(30)
    assert not errors, errors[:3]
    assert reads[0] > 0
