"""`serve` names a run in TensorBoard as `run` does: ``<namespace>/<name>/<run id>``, the
run id readable (``<UTC time>-<4 hex>``, tracking/run_ids.py), not 32 hex digits. A real
engine (the tiny model, in this process) takes a PUT without a run id, as serve's route
passes it, trains a step, and its tick's records go to TensorBoard's own event writer."""

from __future__ import annotations

import re
from pathlib import Path

from loraplex_engine.local.manifests import Manifest
from loraplex_engine.local.resume import fresh_state
from loraplex_engine.tracking.records import records_of
from loraplex_engine.tracking.tensorboard_tracker import TensorBoardTracker

from tests.support.engine_builders import engine, spec
from tests.support.event_reader import scalars

READABLE = re.compile(r"\d{8}-\d{6}-[0-9a-f]{4}")


def test_serve_labels_a_tensorboard_run_by_namespace_name_and_a_readable_run_id(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    eng = engine(tiny_model_dir, tmp_path / "ckpt")
    tb = TensorBoardTracker(str(tmp_path / "tb"))
    try:
        status, _ = eng.put_experiment("team-a.say-yes", spec(steps=1), "team-a", "say-yes")
        report = eng.tick()
        assert report is not None
        tb.log(records_of(report, "pool-t", 1000))
    finally:
        tb.close()
        eng.close()
    assert READABLE.fullmatch(status.run_id), status.run_id
    (run_dir,) = (tmp_path / "tb").glob("*/*/*")
    assert run_dir.relative_to(tmp_path / "tb").parts == ("team-a", "say-yes", status.run_id)
    assert scalars(run_dir)["reward_mean"], "the step is recorded under that run"


def test_run_and_serve_make_run_ids_alike() -> None:
    """`run`'s run ids come from the same function: one shape for both doors."""
    from loraplex_engine.spec.experiment import parse_spec

    m = Manifest("say-yes", "default", parse_spec({"task": {"name": "copy"}}))
    (run_id,) = fresh_state([m]).run_ids.values()
    assert READABLE.fullmatch(run_id), run_id
