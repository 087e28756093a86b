"""Which checkpoint a resume loads: the newest intact one of the requested one's run at or
after its step (so a checkpoint written on SIGTERM, after the operator last looked, is not
redone). The choice itself is pure (`resume_order`); the engine tries its candidates in
order, skipping broken newer ones."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from loraplex_engine.checkpoint import RUN_ID, Candidate, read_metadata, resume_order
from loraplex_engine.errors import BadCheckpointError
from safetensors.torch import load_file

from tests.engine.engine_builders import engine, spec


def _c(step: int, run: str | None = "r1", readable: bool = True) -> Candidate:
    meta = {"step": step, **({RUN_ID: run} if run is not None else {})}
    return Candidate(Path(f"/ckpt/ns/x/step-{step:08d}"), meta if readable else None)


def _names(paths: list[Path]) -> list[int]:
    return [int(p.name[5:]) for p in paths]


def test_same_run_newer_first_then_the_requested_one() -> None:
    siblings = [_c(2), _c(6), _c(8), _c(4)]
    assert _names(resume_order(_c(4), siblings)) == [8, 6, 4]


def test_other_runs_older_steps_and_unreadable_ones_are_not_candidates() -> None:
    siblings = [_c(9, run="r2"), _c(7, readable=False), _c(3), _c(6, run=None), _c(5)]
    assert _names(resume_order(_c(4), siblings)) == [5, 4]


def test_a_checkpoint_without_run_id_resumes_only_itself() -> None:
    assert _names(resume_order(_c(4, run=None), [_c(6, run=None), _c(8)])) == [4]
    assert _names(resume_order(_c(4, readable=False), [_c(6)])) == [4]


def test_bad_metadata_values_never_match() -> None:
    odd = [
        Candidate(Path("/ckpt/ns/x/step-00000009"), {"step": "9", RUN_ID: "r1"}),
        Candidate(Path("/ckpt/ns/x/step-00000008"), {"step": True, RUN_ID: "r1"}),
        Candidate(Path("/ckpt/ns/x/step-00000007"), {"step": 7, RUN_ID: ""}),
    ]
    assert _names(resume_order(_c(4), odd)) == [4]
    empty_run = Candidate(Path("/ckpt/ns/x/step-00000004"), {"step": 4, RUN_ID: ""})
    assert _names(resume_order(empty_run, [_c(5, run="")])) == [4]


# --- the engine, with real checkpoints ---------------------------------------------------


def _weights(eng, exp_id: str) -> dict[str, torch.Tensor]:
    return eng.model.adapter_state_dict(exp_id)


def _assert_holds(eng, exp_id: str, ckpt: Path) -> None:
    saved = load_file(ckpt / "adapter_model.safetensors")
    got = _weights(eng, exp_id)
    assert saved.keys() == got.keys()
    for key, value in saved.items():
        assert torch.equal(got[key], value), key


def _resume(eng, name: str, path: Path):
    small = spec(steps=20, every=2, keep=10, group=2, prompts=2)
    status, created = eng.put_experiment(f"default.{name}", small, "default", name, str(path))
    assert created
    return status


def _without_run_id(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    state = json.loads((dst / "trainer_state.json").read_text())
    del state["metadata"][RUN_ID]
    (dst / "trainer_state.json").write_text(json.dumps(state))


def test_engine_resumes_from_the_newest_intact_checkpoint_of_the_run(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = engine(tiny_model_dir, tmp_path)
    first.put_experiment(
        "default.r", spec(steps=20, every=2, keep=10, group=2, prompts=2), "default", "r"
    )
    for _ in range(6):
        first.tick()
    run_dir = tmp_path / "default" / "r"
    step = {k: run_dir / f"step-{k:08d}" for k in (2, 4, 6)}
    assert all(p.is_dir() for p in step.values())
    run = read_metadata(step[2])[RUN_ID]
    assert run and read_metadata(step[6])[RUN_ID] == run

    # Another run's newer checkpoint in the same directory (a deleted and recreated
    # experiment of the same name) is never picked up.
    shutil.copytree(step[4], run_dir / "step-00000009")
    other = json.loads((run_dir / "step-00000009" / "trainer_state.json").read_text())
    other["metadata"].update({RUN_ID: "another-run", "step": 9})
    (run_dir / "step-00000009" / "trainer_state.json").write_text(json.dumps(other))

    second = engine(tiny_model_dir, tmp_path)
    newest = _resume(second, "newest", step[2])
    assert (newest.step, newest.checkpoint.path) == (6, str(step[6]))
    _assert_holds(second, "default.newest", step[6])
    carried = second.checkpoint_experiment("default.newest")
    assert read_metadata(carried.path)[RUN_ID] == run  # the run id travels with the run

    # A broken newer checkpoint is skipped with a warning, and left where it is.
    (step[6] / "optimizer.safetensors").write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING, logger="loraplex_engine.engine"):
        fallback = _resume(second, "fallback", step[2])
    assert (fallback.step, fallback.checkpoint.path) == (4, str(step[4]))
    _assert_holds(second, "default.fallback", step[4])
    assert any(str(step[6]) in r.getMessage() for r in caplog.records)
    assert (step[6] / "adapter_model.safetensors").exists()

    # Checkpoints from before run ids: exactly the requested one, and a fresh run id.
    legacy_dir = tmp_path / "legacy" / "old"
    for k in (2, 4):
        _without_run_id(step[k], legacy_dir / step[k].name)
    legacy = _resume(second, "legacy", legacy_dir / step[2].name)
    assert (legacy.step, legacy.checkpoint.path) == (2, str(legacy_dir / step[2].name))
    fresh = read_metadata(second.checkpoint_experiment("default.legacy").path)[RUN_ID]
    assert fresh and fresh != run

    # The requested checkpoint itself broken: the clear error, even with newer ones around.
    (step[2] / "trainer_state.json").write_text("{not json")
    with pytest.raises(BadCheckpointError, match=r"trainer_state\.json") as err:
        _resume(second, "broken", step[2])
    assert err.value.field == "resumeFrom"
    assert "default.broken" not in second.model.adapters()
