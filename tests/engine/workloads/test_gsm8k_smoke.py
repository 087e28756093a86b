"""The GSM8K smoke run, as docs/workloads.md tells a newcomer to start it: the command is
read from the page's code block (so the page stays true), checked to be what `make
demo-gsm8k` runs, and run as a real `loraplex-engine run` process on the tiny model. All
three ways into the workload (generated problems with the math-verify plug-in, the
calculator environment, GSM8K-format rows from a file) train every step and end
Succeeded. The tiny random model never answers right, so rewards are not asserted."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import loraplex_engine
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SOURCE = str(Path(loraplex_engine.__file__).resolve().parents[1])
COMMAND = ".venv/bin/loraplex-engine run samples/local/gsm8k-smoke.yaml"
RUN_S = 900.0  # a bound on a loaded 2-core machine, not a speed expectation
EXPERIMENTS = {"gsm8k-easy", "gsm8k-calculator", "gsm8k-rows"}


def documented_command() -> str:
    """The page's command line for the smoke run (from a code block)."""
    page = (REPO / "docs" / "workloads.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", page, re.S)
    lines = [ln.strip() for b in blocks for ln in b.splitlines() if ln.startswith(COMMAND)]
    assert len(lines) == 1, f"docs/workloads.md shows {COMMAND!r} {len(lines)} times"
    return lines[0]


def make_recipe() -> str:
    """`make demo-gsm8k`'s command, its variables spelt out."""
    makefile = (REPO / "Makefile").read_text()
    (recipe,) = re.findall(r"^demo-gsm8k:.*\n\t(.+)$", makefile, re.M)
    return recipe.replace("$(VENV)", ".venv").replace("$(TINY_MODEL)", ".cache/models/tiny-llama")


def test_the_documented_smoke_run_trains_every_way_into_gsm8k(tmp_path: Path) -> None:
    command = documented_command()
    assert command == make_recipe()
    argv = shlex.split(command)
    out = tmp_path / "out"
    argv[argv.index("--out") + 1] = str(out)  # not the checkout's out/
    done = subprocess.run(
        argv,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        env={**os.environ, "PYTHONPATH": SOURCE},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done in" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is False
    experiments = {e["name"]: e for e in summary["experiments"]}
    assert set(experiments) == EXPERIMENTS
    for name, e in experiments.items():
        assert e["phase"] == "Succeeded", (name, e.get("error"))
        assert e["steps"] == 3 and len(e["rewards"]) == 3, name
        assert all(n > 0 for n in e["completion_tokens"]), name  # every step sampled
        assert (out / "adapters" / name / "adapter_model.safetensors").is_file()
    print(f"smoke run: {summary['wall_seconds']:.1f}s of training")
