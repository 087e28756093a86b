"""`loraplex-engine run`'s --set, --only, progress pace and --tracking-* flags."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from loraplex_engine import cli
from loraplex_engine.local.pace import Pace, duration
from loraplex_engine.spec.api_types import ExperimentStatus
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.local_runs import manifest

RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{4}$")  # <UTC time>-<4 hex>: readable


def write(tmp_path: Path, *docs: str) -> Path:
    folder = tmp_path / "manifests"
    folder.mkdir(exist_ok=True)
    path = folder / "experiments.yaml"
    path.write_text("---\n".join(docs))
    return path


def test_set_and_only_edit_the_manifests_before_the_run(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--only keeps one document; --set applies to every kept one, NAME: to one; a
    relative dataset still comes from the manifest's folder (not the working directory).
    The progress shows s/step and an ETA from step 1; --tracking-tensorboard-dir records
    each experiment as <namespace>/<name>/<run id>, the run id readable."""
    rows = tmp_path / "manifests" / "rows.jsonl"
    rows.parent.mkdir()
    rows.write_text(json.dumps({"prompt": "say yes", "answer": "yes"}) + "\n")
    path = write(
        tmp_path,
        manifest("rows", "{name: jsonl, dataset: rows.jsonl, reward: contains}", 0),
        manifest("other", "{name: target-token}", 1),
    )
    out, board = tmp_path / "out", tmp_path / "tb"
    code = cli.main(
        ["run", str(path), "--model", str(tiny_model_dir), "--out", str(out),
         "--only", "rows", "--set", "algorithm.maxSteps=3",
         "--set", "rows:rollout.maxNewTokens=2", "--tracking-tensorboard-dir", str(board)]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    [exp] = summary["experiments"]
    assert exp["name"] == "rows" and exp["steps"] == 3 == len(exp["rewards"])
    assert max(exp["completion_tokens"]) <= 2 * 2 * 2  # rows × maxNewTokens 2
    text = capsys.readouterr().out
    lines = text.splitlines()
    first = lines[next(i for i, line in enumerate(lines) if "step    1/3" in line) - 1]
    assert re.search(r"\d+\.\d+ s/step, ETA \d+s$", first), text

    assert RUN_ID.match(exp["run_id"]), exp["run_id"]
    run_dir = board / "default" / "rows" / exp["run_id"]
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--set", "algorithm.maxStep=4"], "--set algorithm.maxStep=4: spec.algorithm.maxStep"),
        (["--set", "algorithm.maxSteps=many"], "spec.algorithm.maxSteps"),
        (["--set", "lora.rank.x=1"], "spec.lora.rank is not a mapping"),
        (["--set", "nothing"], "give [NAME:]path=value"),
        (["--only", "nope"], "--only nope: "),
        (["--set", "nope:algorithm.maxSteps=4"], "no document 'nope'"),
    ],
)
def test_a_bad_set_or_only_is_a_usage_error_naming_it(
    flags: list[str],
    named: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write(tmp_path, manifest("a", "{name: target-token}", 0))
    out = str(tmp_path / "out")
    assert cli.main(["run", str(path), "--model", str(tiny_model_dir), "--out", out, *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_resume_of_a_directory_without_a_run_is_a_usage_error(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, manifest("a", "{name: target-token}", 0))
    args = ["run", str(path), "--model", str(tiny_model_dir), "--resume", str(tmp_path)]
    assert cli.main(args) == 2
    assert f"--resume {tmp_path}: no run.json" in capsys.readouterr().err


def status(step: int, max_steps: int | None, phase: str = "Running") -> ExperimentStatus:
    return ExperimentStatus.model_construct(
        id="default.a", name="a", phase=phase, step=step, max_steps=max_steps
    )


def test_the_eta_is_the_most_steps_left_times_the_recent_seconds_per_step() -> None:
    pace = Pace(last=0.0)
    assert pace.line([status(0, 10)]) == ""  # no step yet: nothing to tell
    for now in (2.0, 4.0, 7.0):
        pace.stepped(now)
    line = pace.line([status(3, 10), status(9, 10), status(10, 10, "Succeeded")])
    assert line == "  2.33 s/step, ETA 16s"  # 7 steps left × 7/3 s
    assert pace.line([status(3, None)]) == "  2.33 s/step"  # no end: no ETA
    assert [duration(s) for s in (59, 61, 3725)] == ["59s", "1m 01s", "1h 02m"]


def test_a_tracker_run_cannot_build_is_a_usage_error_before_the_model_loads(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    monkeypatch.delitem(sys.modules, "loraplex_engine.tracking.tensorboard_tracker", False)
    path = write(tmp_path, manifest("a", "{name: target-token}", 0))
    args = ["run", str(path), "--model", str(tiny_model_dir), "--out", str(tmp_path / "out")]
    assert cli.main([*args, "--tracking-tensorboard-dir", str(tmp_path / "tb")]) == 2
    captured = capsys.readouterr()
    assert "--tracking-tensorboard-dir: " in captured.err and "engine ready" not in captured.out
