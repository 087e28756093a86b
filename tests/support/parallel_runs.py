"""`loraplex-engine run` as a child process for the data-parallel tests: the sample demo
cut short, the command line, the spawn (one thread a rank), and each experiment's
adapter gap between two runs' output directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support import child_processes
from tests.support.adapter_parity import AdapterGap, adapter_gap_of_files
from tests.support.paths import REPO_ROOT

DEMO = REPO_ROOT / "samples" / "local" / "demo.yaml"


def short_demo(tmp_path: Path, steps: int) -> Path:
    """samples/local/demo.yaml with maxSteps lowered to ``steps``."""
    docs = list(yaml.safe_load_all(DEMO.read_text()))
    for doc in docs:
        doc["spec"]["algorithm"]["maxSteps"] = steps
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def run_gaps(manifest: Path, ref: Path, got: Path) -> dict[str, AdapterGap]:
    """Per experiment of a ``run`` manifest: its adapter in ``got`` against ``ref``'s
    (two ``--out`` directories), in Adam steps of that experiment's lr."""
    gaps = {}
    for doc in yaml.safe_load_all(manifest.read_text()):
        name, algorithm = doc["metadata"]["name"], doc["spec"]["algorithm"]
        gaps[name] = adapter_gap_of_files(
            ref / "adapters" / name,
            got / "adapters" / name,
            algorithm["learningRate"],
            algorithm["maxSteps"],
        )
    return gaps


def run_cmd(manifest: Path, model: Path, out: Path, *flags: str) -> list[str]:
    cli_run = [sys.executable, "-m", "loraplex_engine.cli", "run", str(manifest)]
    return [*cli_run, "--model", str(model), "--out", str(out), *flags]


def spawn_run(cmd: list[str], stderr: Path, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two cores in CI, two ranks
    return child_processes.spawn(
        cmd, "loraplex-engine run", env=env, stderr=stderr.open("w"), text=True, **kw
    )
