"""One tenant cannot fill the shared checkpoint volume and fail its neighbours: a
namespace over its checkpoint quota fails alone, before it writes (store/quota.py); a
volume that is full anyway (ENOSPC) defers the checkpoint and training goes on, and a
finished experiment waits for room to write its last before it is Succeeded."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.store.quota import CheckpointQuota, tree_bytes

from tests.support.engine_builders import engine, spec

A, B = "team-a.filler", "team-b.bystander"


def put(eng, exp_id: str, **kw) -> None:
    namespace, name = exp_id.split(".")
    eng.put_experiment(exp_id, spec(**kw), namespace, name)


def tick_until_done(eng, max_ticks: int = 200) -> None:
    for _ in range(max_ticks):
        if eng.tick() is None:
            return
    raise AssertionError(f"still running after {max_ticks} ticks")


def test_a_namespace_over_its_quota_fails_alone_and_its_neighbour_finishes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    eng = engine(tiny_model_dir, root)
    put(eng, A, steps=40, every=1, keep=1000, group=2, prompts=2)  # the attack
    put(eng, B, steps=6, every=2, keep=2, group=2, prompts=2)
    eng.tick()  # A wrote step 1: one checkpoint's size
    one = tree_bytes(root / "team-a")
    assert one > 0
    eng.store.quota = CheckpointQuota(5 * one)
    tick_until_done(eng)
    a, b = eng.get_experiment(A), eng.get_experiment(B)
    assert a.phase == "Failed" and a.failure_reason == "checkpoint_error", a
    assert "quota" in (a.error or "") and "team-a" in (a.error or ""), a.error
    assert a.step == 5, a  # its sixth checkpoint was refused before it was written
    assert tree_bytes(root / "team-a") <= 5 * one
    assert b.phase == "Succeeded" and b.checkpoint is not None and b.checkpoint.step == 6, b
    assert Path(b.checkpoint.path, "adapter_model.safetensors").is_file()


@contextlib.contextmanager
def small_volume(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path``: a checkpoint volume that really runs out of room
    (ENOSPC from the kernel, not a mock)."""
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(volume: Path, leave: int) -> Path:
    """A file taking all but ``leave`` bytes of ``volume``."""
    st = os.statvfs(volume)
    filler = volume / "filler"
    filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def storage_full_gauge(eng) -> float | None:
    """``loraplex_engine_checkpoint_storage_full`` as a scrape of ``eng`` reads it."""
    metrics = EngineMetrics()
    metrics.update_capacity(eng.capacity())
    return metrics.registry.get_sample_value("loraplex_engine_checkpoint_storage_full")


def test_a_full_volume_defers_checkpoints_and_training_goes_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with small_volume(tmp_path / "ckpt", "64m") as root:
        eng = engine(tiny_model_dir, root)
        put(eng, B, steps=4, every=1, keep=2, group=2, prompts=2)
        assert eng.capacity().storage_full is None and storage_full_gauge(eng) == 0
        filler = fill(root, leave=4096)  # from outside: another writer fills the volume
        for _ in range(6):
            eng.tick()
        b = eng.get_experiment(B)
        assert b.phase == "Running" and b.step == 4, b  # trained on, never Failed
        assert b.checkpoint is None and b.checkpoint_pending, b
        full = eng.capacity().storage_full
        assert full is not None and "full" in full, full
        assert eng.capacity().to_json()["storageFull"] == full  # GET /v1/capacity's body
        assert storage_full_gauge(eng) == 1
        filler.unlink()  # the admin makes room
        tick_until_done(eng)
        b = eng.get_experiment(B)
        assert b.phase == "Succeeded" and b.checkpoint is not None and b.checkpoint.step == 4
        assert not b.checkpoint_pending, b
        assert Path(b.checkpoint.path, "adapter_model.safetensors").is_file()
        assert eng.capacity().storage_full is None and storage_full_gauge(eng) == 0
