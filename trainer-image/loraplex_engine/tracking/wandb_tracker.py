"""Step records to Weights & Biases (``serve --tracking-wandb offline|online``).

One W&B run per experiment run, in the pool's project (and entity), grouped by namespace.
Its id is derived from the namespace, experiment and run id, so an engine that resumes
the run goes on in the same W&B run (``resume="allow"``); the tenant's run name is its
display name, its tags and the system tags the run's config (``loraplex``) and its tags
(``name=value``, which W&B shows and filters). Offline, the run files land under the
pool's directory for ``wandb sync``; online needs ``WANDB_API_KEY`` in the environment.
Several runs are open at once in this one process (``reinit="create_new"``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import wandb

from loraplex_engine.tracking.records import RunRef, StepRecord

MAX_TAG = 64  # W&B's limit on one tag


def wandb_id(run: RunRef) -> str:
    """A W&B run id (letters and digits) that is the same for the same run on any engine."""
    digest = hashlib.sha256("\0".join(run.key).encode()).hexdigest()
    return f"lx{digest[:30]}"


class WandbTracker:
    name = "wandb"

    def __init__(self, mode: str, project: str, entity: str | None, directory: str) -> None:
        self.mode = mode
        self.project = project
        self.entity = entity
        self.directory = directory
        self._runs: dict[tuple[str, str, str], Any] = {}
        # W&B keeps a cache, config and data directory under $HOME by default, which an
        # engine pod may not have writable: under the pool's directory, unless set.
        for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                         ("WANDB_DATA_DIR", "data")):  # fmt: skip
            os.environ.setdefault(var, os.path.join(directory, sub))

    def log(self, records: Sequence[StepRecord]) -> None:
        for record in records:
            run = self._run(record.run)
            if record.metrics:
                run.log(record.metrics, step=record.step)
            if record.end is not None:
                run.finish(exit_code=0 if record.end == "FINISHED" else 1)
                del self._runs[record.run.key]

    def close(self) -> None:
        """Each open run's files are written out; the run itself is not over (another
        engine, or this one restarted, resumes it under the same id)."""
        for run in self._runs.values():
            run.finish()
        self._runs.clear()
        # W&B's core process writes the run files after finish() returns; wait for it,
        # or a pod's last steps may never reach the offline files.
        wandb.teardown()

    def _run(self, ref: RunRef) -> Any:
        run = self._runs.get(ref.key)
        if run is None:
            os.makedirs(self.directory, exist_ok=True)
            tags = [f"{k}={v}"[:MAX_TAG] for k, v in ref.tags.items()]
            run = wandb.init(
                project=self.project,
                entity=self.entity,
                dir=self.directory,
                mode=self.mode,  # type: ignore[arg-type]
                id=wandb_id(ref),
                name=ref.run_name,
                group=ref.namespace,
                job_type=ref.experiment,
                tags=tags,
                config={"loraplex": dict(ref.tags)},
                resume="allow",
                reinit="create_new",
                settings=wandb.Settings(
                    silent=True, console="off", x_disable_stats=True, save_code=False
                ),
            )
            self._runs[ref.key] = run
        return run
