"""`loraplex-engine run --resume OUT`: go on from the checkpoints a stopped run left.

A run writes ``OUT/run.json`` before its first step: each experiment's run id, which
names its checkpoint directory (``OUT/checkpoints/<namespace>/<name>/<run id>/``). A
resume adds the experiments again under those run ids, so the engine loads each run's
newest intact checkpoint (store/run_store.py), and takes the curves of the stopped run's
``summary.json`` up to that checkpoint's step: the resumed summary reads as one run's.

Run ids are readable, ``<UTC time>-<4 hex>`` (tracking/run_ids.py, as `serve` makes them):
the trackers show a run as ``<namespace>/<name>/<run id>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex_engine.local.manifests import Manifest
from loraplex_engine.spec.errors import UsageError
from loraplex_engine.tracking.run_ids import new_run_id

RUN_FILE = "run.json"
# summary.json's per-step curves, carried over on resume (Progress's field of each).
CURVES = (
    "rewards",
    "completion_tokens",
    "rollout_versions",
    "logprob_gaps",
    "tis_weight_means",
    "tis_tokens",
)


@dataclass
class RunState:
    """The run ids of a run's experiments, and what a stopped run had done."""

    run_ids: dict[str, str]
    previous: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> summary entry

    def write(self, out_dir: Path) -> None:
        (out_dir / RUN_FILE).write_text(json.dumps({"runIds": self.run_ids}, indent=2))


def fresh_state(manifests: list[Manifest]) -> RunState:
    run_id = new_run_id()  # one per command: the experiments' runs share it
    return RunState({m.id: run_id for m in manifests})


def resumed_state(out_dir: Path, manifests: list[Manifest]) -> RunState:
    """``OUT/run.json``'s run ids for these manifests; a UsageError naming ``--resume``
    when OUT holds no run or another set of experiments."""
    try:
        saved = json.loads((out_dir / RUN_FILE).read_text())["runIds"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"--resume {out_dir}: no {RUN_FILE} there (not a run's --out)") from None
    ids = [m.id for m in manifests]
    if not isinstance(saved, dict) or sorted(saved) != sorted(ids):
        raise UsageError(
            f"--resume {out_dir}: its run trained {sorted(saved)}, these manifests "
            f"{sorted(ids)}: give the stopped run's manifests, --set and --only"
        )
    return RunState({i: str(saved[i]) for i in ids}, _previous(out_dir))


def _previous(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The stopped run's summary entries, by experiment id."""
    try:
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}  # killed without one: the curves start at the resumed step
    return {e["id"]: e for e in summary.get("experiments", []) if isinstance(e, dict) and "id" in e}


def carry_over(progress: Any, state: RunState, steps: dict[str, int]) -> None:
    """Prefill ``progress`` (runner.Progress) with the stopped run's curves, cut at the
    step each experiment resumed from (a curve has one entry per step)."""
    for exp_id, entry in state.previous.items():
        step = steps.get(exp_id)
        if step is None:
            continue
        for key in CURVES:
            curve = entry.get(key) or []
            if curve:
                getattr(progress, key)[exp_id] = list(curve[:step])
        evals = [e for e in entry.get("evals") or [] if e.get("step", 0) <= step]
        if evals:
            progress.evals[exp_id] = evals
