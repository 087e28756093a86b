"""`loraplex-engine run` in-process at tiny size: a one-experiment manifest and the
command's exit code with its summary.json, parsed strictly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex_engine import cli

STEPS = 6


def manifest(
    name: str, task: str, seed: int, algorithm: str = "", *, steps: int = STEPS, every: int = 4
) -> str:
    """One LoRAExperiment at tiny size: group 2, 2 prompts, 4 new tokens; ``algorithm``:
    more of its algorithm's fields (", key: value" ...); a checkpoint ``every`` steps."""
    return (
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\n"
        f"metadata: {{name: {name}}}\nspec:\n"
        "  lora: {rank: 4, alpha: 8, targetModules: [q_proj, v_proj, lm_head]}\n"
        f"  task: {task}\n"
        "  algorithm: {groupSize: 2, promptsPerStep: 2, learningRate: 0.02, "
        f"maxSteps: {steps}, seed: {seed}{algorithm}}}\n"
        "  rollout: {maxNewTokens: 4}\n"
        f"  checkpoint: {{everySteps: {every}, keep: 1}}\n"
    )


def run_cli(
    manifests: list[str], tmp_path: Path, model: Path, *flags: str
) -> tuple[int, dict[str, Any]]:
    """`loraplex-engine run` in-process; returns its exit code and summary.json, parsed
    strictly (a bare NaN or Infinity, which Python's json would accept, is an error)."""
    path = tmp_path / "experiments.yaml"
    path.write_text("---\n".join(manifests))
    out = tmp_path / "out"
    code = cli.main(["run", str(path), "--model", str(model), "--out", str(out), *flags])
    text = (out / "summary.json").read_text()
    return code, json.loads(text, parse_constant=_reject_constant)


def _reject_constant(name: str) -> None:
    raise ValueError(f"summary.json is not valid JSON: it contains {name}")
