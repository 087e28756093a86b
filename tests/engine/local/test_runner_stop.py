"""`loraplex-engine run` stopped by Ctrl-C: a real subprocess gets SIGINT after step k
shows in its progress, checkpoints every experiment, writes its adapters and an
``interrupted`` summary.json, exits 130; ``--resume`` then ends on the very adapters an
uninterrupted run gives (exactly equal, as test_checkpoint_resume.py holds a resume to)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.local_runs import manifest

STEPS = 12
K = 1  # SIGINT once step K shows (the first step's line prints at once, then every 2 s)
NAMES = ("say-yes", "copy-ab")
ROOT = Path(__file__).resolve().parents[3]


def command(path: Path, model: Path, *flags: str) -> list[str]:
    return [sys.executable, "-u", "-m", "loraplex_engine.cli", "run", str(path),
            "--model", str(model), *flags]  # fmt: skip


def env() -> dict[str, str]:
    here = [str(ROOT / "trainer-image"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(here)}


def interrupt_after_step(argv: list[str], k: int) -> tuple[int, str]:
    """Start ``argv``, SIGINT it once a progress line shows step ``k`` (or later)."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env()
    )
    assert proc.stdout is not None
    seen: list[str] = []
    step = re.compile(r"step\s+(\d+)/")
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        seen.append(line)
        found = step.search(line)
        if found and int(found.group(1)) >= k:
            proc.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(seen)
    rest, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + rest


def adapters(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {n: load_file(out / "adapters" / n / "adapter_model.safetensors") for n in NAMES}


def test_sigint_checkpoints_and_resume_matches_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "experiments.yaml"
    # A checkpoint interval larger than the steps done: the stop's checkpoint is the only one.
    one_checkpoint = {"steps": STEPS, "every": 100}
    path.write_text(
        manifest("say-yes", "{name: target-token, params: {target: 'yes'}}", 0, **one_checkpoint)
        + "---\n"
        + manifest(
            "copy-ab", "{name: copy, params: {length: '2', alphabet: ab}}", 1, **one_checkpoint
        )
    )
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    subprocess.run(
        command(path, tiny_model_dir, "--out", str(whole)), check=True, env=env(), timeout=120
    )

    code, output = interrupt_after_step(command(path, tiny_model_dir, "--out", str(stopped)), K)
    assert code == 130, output
    assert "Traceback" not in output and "go on with --resume" in output, output
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["interrupted"] is True
    done = [e["steps"] for e in summary["experiments"]]
    assert all(K <= s < STEPS for s in done), (done, output)  # stopped mid-way
    for exp in summary["experiments"]:
        assert len(exp["rewards"]) == exp["steps"]
        # the adapter written is the checkpoint taken at the step it stopped at
        assert exp["adapter_path"] and Path(exp["adapter_path"]).is_dir()
        run_dir = stopped / "checkpoints" / "default" / exp["name"] / exp["run_id"]
        assert [p.name for p in run_dir.iterdir()] == [f"step-{exp['steps']:08d}"]

    resumed = subprocess.run(
        command(path, tiny_model_dir, "--resume", str(stopped)),
        env=env(), timeout=120, capture_output=True, text=True,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"at step {done[0]}" in resumed.stdout
    final = json.loads((stopped / "summary.json").read_text())
    reference = json.loads((whole / "summary.json").read_text())
    assert final["interrupted"] is False
    for got, want in zip(final["experiments"], reference["experiments"], strict=True):
        assert got["steps"] == want["steps"] == STEPS
        assert got["rewards"] == want["rewards"]  # the curve reads as one run's
    want, got = adapters(whole), adapters(stopped)
    for name in NAMES:
        assert got[name].keys() == want[name].keys()
        for key, tensor in want[name].items():
            assert torch.equal(got[name][key], tensor), (name, key)


def test_a_first_signal_while_training_asks_a_second_one_stops_now() -> None:
    """SIGTERM (a timeout, a scheduler) the same as SIGINT, with the shell's 143; before
    training, or asked twice, :class:`Interrupted` ends the command at once."""
    from loraplex_engine.local.stop import Interrupted, StopRequest

    stop = StopRequest()
    with pytest.raises(Interrupted) as before:
        stop.handle(signal.SIGTERM, None)
    assert before.value.exit_status == 143 and not stop.requested
    stop.armed = True
    stop.handle(signal.SIGTERM, None)
    assert stop.requested and stop.exit_status == 143
    with pytest.raises(Interrupted):
        stop.handle(signal.SIGINT, None)
