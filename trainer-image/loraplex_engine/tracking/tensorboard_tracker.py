"""Step records as TensorBoard event files (``serve --tracking-tensorboard-dir DIR``).

One directory per run, ``DIR/<namespace>/<experiment>/<run id>/``: TensorBoard shows each
as a run, and a namespace's directory can be mounted or served alone. Each step's metrics
are scalars under their METRICS names (tracking/records.py); ``run.json`` beside the event
files holds the run's name and tags. Written with TensorBoard's own event writer (no
TensorFlow), read back by its own reader in the tests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from loraplex_engine.tracking.records import RunRef, StepRecord

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _part(name: str) -> str:
    """One path component: the names are Kubernetes names and run ids already; whatever
    else is replaced, and never '.' or '..'."""
    safe = _UNSAFE.sub("_", name)[:128]
    return safe if safe.strip(".") else "_"


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, logdir: str) -> None:
        self.logdir = Path(logdir)
        self._writers: dict[tuple[str, str, str], EventFileWriter] = {}

    def run_dir(self, run: RunRef) -> Path:
        return self.logdir / _part(run.namespace) / _part(run.experiment) / _part(run.run_id)

    def log(self, records: Sequence[StepRecord]) -> None:
        touched: dict[tuple[str, str, str], EventFileWriter] = {}
        for record in records:
            writer = touched[record.run.key] = self._writer(record.run)
            if record.metrics:
                values = [Summary.Value(tag=k, simple_value=v) for k, v in record.metrics.items()]
                event = Event(
                    wall_time=record.timestamp_ms / 1000,
                    step=record.step,
                    summary=Summary(value=values),
                )
                writer.add_event(event)
            if record.end is not None:
                writer.close()
                self._writers.pop(record.run.key, None)
                touched.pop(record.run.key, None)
        for writer in touched.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def _writer(self, run: RunRef) -> EventFileWriter:
        writer = self._writers.get(run.key)
        if writer is None:
            directory = self.run_dir(run)
            directory.mkdir(parents=True, exist_ok=True)
            about = {"runName": run.run_name, "tags": run.tags}
            (directory / "run.json").write_text(json.dumps(about, indent=2, sort_keys=True))
            writer = self._writers[run.key] = EventFileWriter(str(directory))
        return writer
