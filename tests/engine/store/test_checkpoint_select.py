"""Which checkpoint a resume loads: the newest intact one of the requested one's run at or
after its step (so a checkpoint written on SIGTERM, after the operator last looked, is not
redone), or, given only a run id, the newest intact one in that run's directory. The
choice itself is pure (`resume_order`, `run_order`); the engine tries its candidates in
order, skipping broken newer ones. Each run writes and prunes only its own directory
(`<root>/<ns>/<name>/<runId>/`), so a recreated experiment never touches the old run's."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from loraplex_engine.spec.errors import BadCheckpointError, ConflictError, InvalidRequestError
from loraplex_engine.store.checkpoint import read_metadata
from loraplex_engine.store.run_store import (
    RUN_ID,
    Candidate,
    gone_as,
    resume_order,
    run_order,
    step_dirs,
    valid_run_id,
)
from safetensors.torch import load_file

from tests.support.engine_builders import engine, spec


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
    # A run id that is no safe directory name is no run id at all.
    assert _names(resume_order(_c(4, run="../r1"), [_c(6, run="../r1")])) == [4]


def test_run_order_is_that_runs_checkpoints_newest_first() -> None:
    found = [_c(2), _c(6), _c(8, run="r2"), _c(7, readable=False), _c(4), _c(9, run=None)]
    assert _names(run_order("r1", found)) == [6, 4, 2]
    assert run_order("r3", found) == []


@pytest.mark.parametrize(
    ("run", "ok"),
    [
        ("0b7c6d2e-5f1a-4c3b-9e8d-7a6b5c4d3e2f", True),  # a Kubernetes uid
        ("a", True),
        ("R.1_x-2", True),
        ("a" * 64, True),
        ("a" * 65, False),
        ("", False),
        ("..", False),
        (".hidden", False),
        ("-a", False),
        ("a/b", False),
        ("a b", False),
        (7, False),
        (None, False),
    ],
)
def test_valid_run_ids_are_safe_directory_names(run: object, ok: bool) -> None:
    assert valid_run_id(run) is ok


# --- the engine, with real checkpoints ---------------------------------------------------


def _weights(eng, exp_id: str) -> dict[str, torch.Tensor]:
    return eng.model.adapter_state_dict(exp_id)


def _assert_holds(eng, exp_id: str, ckpt: Path) -> None:
    saved = load_file(ckpt / "adapter_model.safetensors")
    got = _weights(eng, exp_id)
    assert saved.keys() == got.keys()
    for key, value in saved.items():
        assert torch.equal(got[key], value), key


def _own(name: str, checkpoint: Path) -> Path:
    """``checkpoint``'s place in experiment ``name``'s own directory (same run, same step)."""
    run_dir = checkpoint.parent
    return run_dir.parents[1] / name / run_dir.name / checkpoint.name


def _resume(eng, name: str, path: Path):
    """Resume ``name`` from ``path``'s run, copied into its own directory first (a
    resumeFrom must lie there: tenancy/trust.py)."""
    own = _own(name, path)
    shutil.copytree(path.parent, own.parent, dirs_exist_ok=True)
    small = spec(steps=20, every=2, keep=10, group=2, prompts=2)
    status, created = eng.put_experiment(f"default.{name}", small, "default", name, str(own))
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
    started, _ = first.put_experiment(
        "default.r", spec(steps=20, every=2, keep=10, group=2, prompts=2), "default", "r"
    )
    for _ in range(6):
        first.tick()
    run = started.run_id  # made at the fresh start: no runId given
    assert run
    run_dir = tmp_path / "default" / "r" / run
    step = {k: run_dir / f"step-{k:08d}" for k in (2, 4, 6)}
    assert all(p.is_dir() for p in step.values())
    assert read_metadata(step[2])[RUN_ID] == run and read_metadata(step[6])[RUN_ID] == run

    # Another run's newer checkpoint among the run's (copied there by hand) is never
    # picked up.
    shutil.copytree(step[4], run_dir / "step-00000009")
    other = json.loads((run_dir / "step-00000009" / "trainer_state.json").read_text())
    other["metadata"].update({RUN_ID: "another-run", "step": 9})
    (run_dir / "step-00000009" / "trainer_state.json").write_text(json.dumps(other))

    second = engine(tiny_model_dir, tmp_path)
    newest = _resume(second, "newest", step[2])
    assert (newest.step, newest.checkpoint.path) == (6, str(_own("newest", step[6])))
    _assert_holds(second, "default.newest", step[6])
    carried = second.checkpoint_experiment("default.newest")
    assert read_metadata(carried.path)[RUN_ID] == run  # the run id travels with the run

    # A broken newer checkpoint is skipped with a warning, and left where it is.
    (step[6] / "optimizer.safetensors").write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING, logger="loraplex_engine.store.run_store"):
        fallback = _resume(second, "fallback", step[2])
    assert (fallback.step, fallback.checkpoint.path) == (4, str(_own("fallback", step[4])))
    _assert_holds(second, "default.fallback", step[4])
    assert any(str(_own("fallback", step[6])) in r.getMessage() for r in caplog.records)
    assert (_own("fallback", step[6]) / "adapter_model.safetensors").exists()

    # A trainer state that names no run is no checkpoint of this engine's: refused.
    nameless = run_dir.parent / "elsewhere" / step[2].name
    _without_run_id(step[2], nameless)
    with pytest.raises(BadCheckpointError, match="names no valid runId") as err:
        _resume(second, "nameless", nameless)
    assert err.value.field == "resumeFrom"
    assert "default.nameless" not in second.model.adapters()

    # The requested checkpoint itself broken: the clear error, even with newer ones around.
    (step[2] / "trainer_state.json").write_text("{not json")
    with pytest.raises(BadCheckpointError, match=r"trainer_state\.json") as err:
        _resume(second, "broken", step[2])
    assert err.value.field == "resumeFrom"
    assert "default.broken" not in second.model.adapters()


# --- one directory per run -----------------------------------------------------------------


def _tiny(steps: int = 20, every: int = 1, keep: int = 1):
    return spec(steps=steps, every=every, keep=keep, group=2, prompts=2)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*.*")}


def test_a_recreated_experiment_never_prunes_or_overwrites_the_old_runs_checkpoints(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    eng = engine(tiny_model_dir, tmp_path)
    exp_dir = tmp_path / "default" / "x"
    eng.put_experiment("default.x", _tiny(), "default", "x", run_id="run-old")
    for _ in range(3):
        eng.tick()
    eng.remove_experiment("default.x")  # deleted; its checkpoints stay
    old = exp_dir / "run-old"
    assert [p.name for p in old.iterdir()] == ["step-00000003"]  # keep: 1
    before = _snapshot(old)

    # Created again under the same name: a new run, from step 0, beside the old one. With
    # keep: 1 it keeps what it just wrote, and its step 3 does not replace the old step 3.
    status, created = eng.put_experiment("default.x", _tiny(), "default", "x", run_id="run-new")
    assert created and status.step == 0 and status.checkpoint is None
    for k in (1, 2, 3):
        eng.tick()
        assert [p.name for p in (exp_dir / "run-new").iterdir()] == [f"step-{k:08d}"]
    assert read_metadata(exp_dir / "run-new" / "step-00000003")[RUN_ID] == "run-new"
    assert _snapshot(old) == before
    assert read_metadata(old / "step-00000003")[RUN_ID] == "run-old"

    # Without a runId (local runner, bench) a fresh start makes its own run directory.
    eng.remove_experiment("default.x")
    third, _ = eng.put_experiment("default.x", _tiny(), "default", "x")
    eng.tick()
    assert third.run_id not in (None, "run-old", "run-new")
    assert sorted(p.name for p in exp_dir.iterdir()) == sorted(["run-old", "run-new", third.run_id])
    assert _snapshot(old) == before


def test_put_with_a_run_id_alone_resumes_that_runs_newest_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The engine stops before anyone saw a checkpoint: none periodic yet, one on "SIGTERM".
    first = engine(tiny_model_dir, tmp_path)
    first.put_experiment("default.y", _tiny(every=10), "default", "y", run_id="uid-y")
    for _ in range(3):
        first.tick()
    sigterm = first.checkpoint_experiment("default.y")
    run_dir = tmp_path / "default" / "y" / "uid-y"
    assert Path(sigterm.path) == run_dir / "step-00000003"

    second = engine(tiny_model_dir, tmp_path)
    status, created = second.put_experiment(
        "default.y", _tiny(every=10), "default", "y", run_id="uid-y"
    )
    assert created and (status.step, status.run_id) == (3, "uid-y")
    assert status.checkpoint is not None and status.checkpoint.path == sigterm.path
    _assert_holds(second, "default.y", Path(sigterm.path))

    # Same spec and run again: a no-op; another run under the loaded id: refused.
    again, created = second.put_experiment(
        "default.y", _tiny(every=10), "default", "y", run_id="uid-y"
    )
    assert not created and again.step == 3
    with pytest.raises(ConflictError, match="uid-other"):
        second.put_experiment("default.y", _tiny(every=10), "default", "y", run_id="uid-other")

    # A run with no checkpoints starts fresh.
    fresh, created = second.put_experiment(
        "default.new", _tiny(every=10), "default", "new", run_id="uid-new"
    )
    assert created and (fresh.step, fresh.checkpoint, fresh.run_id) == (0, None, "uid-new")

    # A run whose directory holds checkpoints, none of which loads, is not restarted over
    # them (its step-1 would be pruned in favour of the broken step-3).
    broken = tmp_path / "default" / "broken" / "uid-b" / "step-00000003"
    shutil.copytree(run_dir / "step-00000003", broken)
    state = json.loads((broken / "trainer_state.json").read_text())
    state["metadata"][RUN_ID] = "uid-b"
    (broken / "trainer_state.json").write_text(json.dumps(state))
    (broken / "adapter_model.safetensors").write_bytes(b"truncated")
    with pytest.raises(BadCheckpointError, match=r"adapter_model\.safetensors") as err:
        second.put_experiment("default.broken", _tiny(), "default", "broken", run_id="uid-b")
    assert err.value.field == "runId"
    assert "default.broken" not in second.model.adapters()

    with pytest.raises(InvalidRequestError) as bad:
        second.put_experiment("default.z", _tiny(), "default", "z", run_id="../y")
    assert bad.value.field == "runId"


@pytest.mark.parametrize(
    ("path", "run_id", "want"),
    [
        ("/c/ns/x/uid-a/step-00000052", "uid-a", {RUN_ID: "uid-a", "step": 52}),
        ("/c/ns/x/uid-a/step-00000052", None, {RUN_ID: "uid-a", "step": 52}),
        ("/c/ns/x/uid-a/step-00000052", "uid-b", None),  # the path names another run
        ("/c/ns/x/uid-a/step-52", "uid-a", None),  # not a step directory's name
        ("/c/ns/x/uid-a/latest", "uid-a", None),
        ("/c/ns/x/../step-00000052", None, None),  # ".." is no run id
    ],
)
def test_a_gone_checkpoint_names_its_run_and_step_by_its_path(
    path: str, run_id: str | None, want: dict | None
) -> None:
    assert gone_as(Path(path), run_id) == want


def test_a_pruned_checkpoint_resumes_from_its_runs_newer_ones(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The operator records the checkpoint it last saw; before the engine dies the run may
    write `keep` newer ones and prune that one. The resume finds the newest of the run."""
    first = engine(tiny_model_dir, tmp_path)
    first.put_experiment("default.p", _tiny(every=1, keep=2), "default", "p", run_id="uid-p")
    first.tick()
    seen = Path(first.checkpoint_experiment("default.p").path)  # what the operator saw
    for _ in range(3):
        first.tick()
    run_dir = tmp_path / "default" / "p" / "uid-p"
    assert [p.name for p in step_dirs(run_dir)] == ["step-00000003", "step-00000004"]
    assert not seen.exists()

    second = engine(tiny_model_dir, tmp_path)
    status, created = second.put_experiment(
        "default.p", _tiny(every=1, keep=2), "default", "p", str(seen), run_id="uid-p"
    )
    assert created and status.step == 4 and status.run_id == "uid-p"
    _assert_holds(second, "default.p", run_dir / "step-00000004")

    # Gone, and nothing newer of its run: the requested one's own error, as before.
    third = engine(tiny_model_dir, tmp_path)
    missing = tmp_path / "default" / "q" / "uid-q" / "step-00000001"
    with pytest.raises(BadCheckpointError, match=r"adapter_config\.json is missing") as err:
        third.put_experiment("default.q", _tiny(), "default", "q", str(missing), run_id="uid-q")
    assert err.value.field == "resumeFrom"
    assert "default.q" not in third.model.adapters()


def test_resume_from_must_belong_to_the_run_id(tiny_model_dir: Path, tmp_path: Path) -> None:
    eng = engine(tiny_model_dir, tmp_path)
    eng.put_experiment("default.m", _tiny(every=2, keep=5), "default", "m", run_id="uid-a")
    for _ in range(4):
        eng.tick()
    eng.remove_experiment("default.m")
    step2 = tmp_path / "default" / "m" / "uid-a" / "step-00000002"

    with pytest.raises(BadCheckpointError) as err:
        eng.put_experiment("default.m", _tiny(), "default", "m", str(step2), run_id="uid-b")
    assert err.value.field == "resumeFrom"
    assert "'uid-a'" in err.value.message and "'uid-b'" in err.value.message
    assert "default.m" not in eng.model.adapters()

    # Its own run: the newest checkpoint of the run at or after the requested one.
    status, _ = eng.put_experiment("default.m", _tiny(), "default", "m", str(step2), "uid-a")
    assert (status.step, status.run_id) == (4, "uid-a")


def test_a_resume_restores_the_global_rng_only_onto_an_empty_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """torch's global RNG (dropout masks) is every tenant's: a resume next to a running
    experiment leaves it alone; onto an empty engine it restores the checkpoint's."""
    eng = engine(tiny_model_dir, tmp_path)
    eng.put_experiment("default.a", spec(steps=9, every=1, group=2, prompts=1), "default", "a")
    eng.tick()
    saved = eng.checkpoint_experiment("default.a")
    saved_rng = torch.get_rng_state()
    eng.remove_experiment("default.a")

    torch.manual_seed(1234)
    eng.put_experiment("default.b", spec(steps=9, group=2, prompts=1), "default", "b")
    before = torch.get_rng_state()
    eng.put_experiment("default.a", spec(steps=9, group=2, prompts=1), "default", "a", saved.path)
    assert torch.equal(torch.get_rng_state(), before)  # b's masks are not reshuffled

    alone = engine(tiny_model_dir, tmp_path / "alone")
    copied = tmp_path / "alone" / Path(saved.path).relative_to(tmp_path)  # its own root
    shutil.copytree(saved.path, copied)
    torch.manual_seed(1234)
    alone.put_experiment(
        "default.a", spec(steps=9, group=2, prompts=1), "default", "a", str(copied)
    )
    assert torch.equal(torch.get_rng_state(), saved_rng)


def test_a_starting_engine_leaves_other_runs_writes_in_progress_alone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Engines of a pool share one checkpoint root: a write in progress on one engine looks
    # like a crash's leftover to another. Only the run's own engine clears its leftovers.
    busy = tmp_path / "default" / "busy" / "run-busy"
    in_progress = busy / ".step-00000143.tmp-abc123"
    in_progress.mkdir(parents=True)
    (in_progress / "adapter_model.safetensors").write_bytes(b"half")
    eng = engine(tiny_model_dir, tmp_path)  # a replacement engine starting beside it
    assert in_progress.exists()

    mine = tmp_path / "default" / "z" / "run-z"
    crashed = mine / ".step-00000001.tmp-dead00"
    crashed.mkdir(parents=True)
    eng.put_experiment("default.z", _tiny(), "default", "z", run_id="run-z")
    eng.tick()
    assert not crashed.exists()  # its own run: a crash's leftover, removed on save
    assert [p.name for p in mine.iterdir()] == ["step-00000001"]
    assert in_progress.exists()
