"""Step records to an MLflow tracking server (``serve --tracking-mlflow-uri``).

Each namespace has its MLflow experiment, ``<prefix>/<namespace>``; each experiment run its
MLflow run, tagged ``loraplex.runId`` and found again by that tag after an engine restart
(so a resumed run goes on in the same MLflow run). The client is MLflow's own
(``mlflow-skinny``), with its retries off: the sink retries, with its own backoff, on its
own thread, so a request never waits out MLflow's (minutes by default).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

# Before mlflow reads them (per request); an operator's own values win.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from loraplex_engine.tracking.records import RunRef, StepRecord

MAX_BATCH_METRICS = 1000  # MLflow's log_batch limit
_PLAIN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")  # safe inside a search filter's quotes


class MlflowTracker:
    name = "mlflow"

    def __init__(self, uri: str, experiment_prefix: str) -> None:
        self.client = MlflowClient(tracking_uri=uri)
        self.prefix = experiment_prefix
        self._experiments: dict[str, str] = {}  # MLflow experiment name -> id
        self._runs: dict[tuple[str, str, str], str] = {}  # RunRef.key -> MLflow run id

    def experiment_name(self, namespace: str) -> str:
        return f"{self.prefix}/{namespace}"

    def log(self, records: Sequence[StepRecord]) -> None:
        by_run: dict[tuple[str, str, str], list[StepRecord]] = {}
        for record in records:
            by_run.setdefault(record.run.key, []).append(record)
        for recs in by_run.values():
            run_id = self._run(recs[0].run)
            metrics = [
                Metric(key, value, r.timestamp_ms, r.step)
                for r in recs
                for key, value in r.metrics.items()
            ]
            for i in range(0, len(metrics), MAX_BATCH_METRICS):
                self.client.log_batch(run_id, metrics=metrics[i : i + MAX_BATCH_METRICS])
            end = next((r.end for r in recs if r.end is not None), None)
            if end is not None:
                self.client.set_terminated(run_id, status=end)
                self._runs.pop(recs[0].run.key, None)

    def close(self) -> None:
        """Runs stay RUNNING: an experiment unloaded here goes on elsewhere or later."""

    def _run(self, run: RunRef) -> str:
        known = self._runs.get(run.key)
        if known is not None:
            return known
        experiment_id = self._experiment(self.experiment_name(run.namespace))
        run_id = self._find(experiment_id, run.run_id)
        if run_id is None:
            created = self.client.create_run(experiment_id, tags=run.tags, run_name=run.run_name)
            run_id = created.info.run_id
        self._runs[run.key] = run_id
        return run_id

    def _find(self, experiment_id: str, loraplex_run: str) -> str | None:
        """The MLflow run of this loraplex run, if an earlier engine made one."""
        if not _PLAIN_ID.fullmatch(loraplex_run):
            return None
        found = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`loraplex.runId` = '{loraplex_run}'",
            max_results=1,
        )
        if not found:
            return None
        run = found[0]
        if run.info.status != "RUNNING":  # resumed after it ended (a failed run retried)
            self.client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id

    def _experiment(self, name: str) -> str:
        known = self._experiments.get(name)
        if known is not None:
            return known
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(name)
            except Exception:  # another engine created it first
                again = self.client.get_experiment_by_name(name)
                if again is None:
                    raise
                experiment_id = again.experiment_id
        self._experiments[name] = experiment_id
        return experiment_id
