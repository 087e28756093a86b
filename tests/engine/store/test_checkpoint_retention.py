"""Retention across runs: an experiment deleted and created again under the same name is a
new run with a directory of its own (<root>/<ns>/<name>/<runId>/). Each name keeps its
newest ``keep_runs`` runs (serve --checkpoint-keep-runs, default 3): when a run writes,
the name's other runs past the newest ``keep_runs - 1`` are removed, oldest first; never
the writing run (a resumed old one included), nothing of another name or namespace. So a
tenant recreating an experiment over and over neither grows the volume without bound nor,
under a quota, blocks its own new checkpoints with its old runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from loraplex_engine.settings.engine import EngineSettings
from loraplex_engine.spec.api_types import DEFAULT_KEEP_RUNS
from loraplex_engine.store.quota import CheckpointQuota, tree_bytes
from loraplex_engine.store.run_store import runs_to_prune
from pydantic import ValidationError

from tests.support.engine_builders import engine, spec

# ---- which runs go (pure) ---------------------------------------------------------------


def test_the_oldest_runs_past_keep_go_oldest_first() -> None:
    runs = {"r1": 10.0, "r2": 20.0, "r3": 30.0, "r4": 40.0, "new": 50.0}
    assert runs_to_prune(runs, "new", 3) == ["r1", "r2"]


def test_the_writing_run_is_kept_and_counted_however_old() -> None:
    runs = {"old": 1.0, "r2": 20.0, "r3": 30.0, "r4": 40.0}
    assert runs_to_prune(runs, "old", 3) == ["r2"]  # resuming "old": it stays, r3 and r4 too
    assert runs_to_prune(runs, "old", 1) == ["r2", "r3", "r4"]


def test_within_keep_nothing_goes() -> None:
    assert runs_to_prune({"r1": 1.0, "new": 2.0}, "new", 3) == []
    assert runs_to_prune({}, "new", 3) == []
    assert runs_to_prune({"new": 2.0}, "new", 1) == []


def test_a_writing_run_without_a_directory_yet_still_counts() -> None:
    """Its first checkpoint prunes before it writes: the directory may not exist yet."""
    assert runs_to_prune({"r1": 1.0, "r2": 2.0, "r3": 3.0}, "new", 3) == ["r1"]


def test_ties_go_by_run_id() -> None:
    assert runs_to_prune({"b": 5.0, "a": 5.0, "c": 5.0}, "new", 2) == ["a", "b"]


def test_keep_runs_is_at_least_one() -> None:
    assert EngineSettings().checkpoint_keep_runs == DEFAULT_KEEP_RUNS == 3
    with pytest.raises(ValidationError, match="at least 1"):
        EngineSettings(checkpoint_keep_runs=0)


# ---- on disk ----------------------------------------------------------------------------


def _tiny():
    return spec(steps=20, every=1, keep=1, group=2, prompts=2)


def _run(eng, exp_id: str, run_id: str, ticks: int = 1) -> None:
    """One run of ``exp_id``: created (or resumed) as ``run_id``, ticked, deleted."""
    namespace, name = exp_id.split(".")
    eng.put_experiment(exp_id, _tiny(), namespace, name, run_id=run_id)
    for _ in range(ticks):
        eng.tick()
    eng.remove_experiment(exp_id)


def _runs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_recreated_experiment_keeps_its_newest_runs_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    eng = engine(tiny_model_dir, tmp_path, checkpoint_keep_runs=2)
    x, neighbour = tmp_path / "team-a" / "x", tmp_path / "team-b" / "x"
    _run(eng, "team-b.x", "b-run-1")  # the same name in another namespace
    _run(eng, "team-a.y", "y-run-1")  # another name in the same namespace
    (x / "not-a-run.txt").parent.mkdir(parents=True)
    (x / "not-a-run.txt").write_text("left alone")
    (x / ".hidden").mkdir()
    for run in ("run-1", "run-2"):
        _run(eng, "team-a.x", run)
    assert _runs(x) == [".hidden", "not-a-run.txt", "run-1", "run-2"]
    _run(eng, "team-a.x", "run-3")  # its first checkpoint removes the oldest run
    assert _runs(x) == [".hidden", "not-a-run.txt", "run-2", "run-3"]
    # Resuming the older of the two: it is the writing run, so both stay.
    os.utime(x / "run-2", (1, 1))  # the oldest by far
    _run(eng, "team-a.x", "run-2")
    assert _runs(x) == [".hidden", "not-a-run.txt", "run-2", "run-3"]
    # A new run now removes run-3, which run-2's resume made the older one.
    _run(eng, "team-a.x", "run-4")
    assert _runs(x) == [".hidden", "not-a-run.txt", "run-2", "run-4"]
    assert _runs(neighbour) == ["b-run-1"] and _runs(tmp_path / "team-a" / "y") == ["y-run-1"]


def test_old_runs_no_longer_block_a_tenants_new_checkpoints_under_its_quota(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    eng = engine(tiny_model_dir, tmp_path)  # the default: 3 runs
    _run(eng, "team-a.x", "run-0")
    one = tree_bytes(tmp_path / "team-a")  # one run of one checkpoint (keep: 1)
    eng.store.quota = CheckpointQuota(4 * one)  # room for 3 runs and a write
    for k in range(1, 8):
        _run(eng, "team-a.x", f"run-{k}")
        assert len(_runs(tmp_path / "team-a" / "x")) <= DEFAULT_KEEP_RUNS
    eng.put_experiment("team-a.x", _tiny(), "team-a", "x", run_id="run-8")
    eng.tick()
    status = eng.get_experiment("team-a.x")
    assert status.phase == "Running" and status.checkpoint is not None, status
    assert _runs(tmp_path / "team-a" / "x") == ["run-6", "run-7", "run-8"]
