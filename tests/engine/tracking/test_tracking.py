"""Experiment tracking off the training path (loraplex_engine/tracking/): the records a
tick report becomes, the queue that never blocks the loop (dropping the oldest when full),
the retry with backoff of a tracker that fails, and the files the TensorBoard and
offline W&B trackers write, read back with each tool's own reader.

The sink tests drive a real Sink thread with small in-test trackers (a list that records,
one that blocks until released, one that fails n times): the tracker is the part under the
sink's control, and what a real one does is the live test's (test_tracking_live.py).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from loraplex_engine.settings.commands import ServeSettings
from loraplex_engine.spec.api_types import ExperimentTick, TickReport
from loraplex_engine.spec.errors import UsageError
from loraplex_engine.spec.tracking import Tag, TrackingSpec
from loraplex_engine.tracking.hub import Tracking, build_trackers
from loraplex_engine.tracking.records import METRICS, RunRef, StepRecord, records_of
from loraplex_engine.tracking.sink import LogLimiter, Sink, backoff_s
from prometheus_client import CollectorRegistry

WAIT_S = 30.0  # a bound on waiting for the sink's thread, never a speed expectation


def tick(**kw: object) -> ExperimentTick:
    base: dict[str, object] = {
        "id": "team-a.exp",
        "namespace": "team-a",
        "step": 3,
        "reward": 0.5,
        "rollout_tokens": 40,
        "train_tokens": 90,
        "name": "exp",
        "run_id": "uid-1",
    }
    base["rollout_version"] = int(kw.get("step", 3)) - 1  # type: ignore[call-overload]
    return ExperimentTick(**(base | kw))  # type: ignore[arg-type]


def report(*ticks: ExperimentTick, seconds: float = 0.25) -> TickReport:
    return TickReport(seconds, {}, list(ticks))


# --- records ---------------------------------------------------------------------------


def test_a_step_becomes_one_record_with_every_known_metric() -> None:
    t = tick(reward_std=0.1, kl=0.02, entropy=1.5, clip_fraction=0.25, response_tokens=5.0)
    (rec,) = records_of(report(t), "pool-a", 1234)
    assert (rec.step, rec.timestamp_ms, rec.end) == (3, 1234, None)
    assert rec.metrics == {
        "reward_mean": 0.5,
        "reward_std": 0.1,
        "kl": 0.02,
        "entropy": 1.5,
        "clip_fraction": 0.25,
        "response_length": 5.0,
        "step_seconds": 0.25,
        "rollout_tokens": 40.0,
        "train_tokens": 90.0,
        "dropped_groups": 0.0,
        "rollout_version": 2.0,
        "rollout_staleness": 0.0,
    }
    assert set(rec.metrics) <= set(METRICS)
    # A pipelined step sampled with older weights records which ones, and the lag.
    (rec,) = records_of(report(tick(rollout_version=0)), "pool-a", 0)
    assert (rec.metrics["rollout_version"], rec.metrics["rollout_staleness"]) == (0.0, 2.0)


def test_unknown_and_non_finite_metrics_are_left_out() -> None:
    (rec,) = records_of(report(tick(kl=math.nan, entropy=None)), "p", 0)
    assert "kl" not in rec.metrics and "entropy" not in rec.metrics


def test_the_run_is_named_by_the_tenant_and_tagged_by_the_system_last() -> None:
    spec = TrackingSpec.model_validate(
        {"runName": "lr-1", "tags": [{"name": "sweep", "value": "lr"}]}
    )
    (rec,) = records_of(report(tick(tracking=spec)), "pool-a", 0)
    assert rec.run == RunRef("team-a", "exp", "uid-1", "lr-1")
    assert rec.run.tags == {
        "sweep": "lr",
        "loraplex.namespace": "team-a",
        "loraplex.experiment": "exp",
        "loraplex.runId": "uid-1",
        "loraplex.pool": "pool-a",
    }
    (plain,) = records_of(report(tick()), "pool-a", 0)
    assert plain.run.run_name == "exp"  # no runName: the experiment's name


def test_a_tenant_tag_cannot_stand_in_for_a_system_tag() -> None:
    # The spec refuses dotted names; were one to get through, the system's value wins.
    tags = [Tag.model_construct(name=n, value="x") for n in ("loraplex.namespace", "loraplex.x")]
    forged = TrackingSpec.model_construct(run_name=None, tags=tags)
    (rec,) = records_of(report(tick(tracking=forged)), "p", 0)
    assert rec.run.tags["loraplex.namespace"] == "team-a" and "loraplex.x" not in rec.run.tags


def test_a_failed_experiment_closes_its_run_and_a_finished_one_ends_it() -> None:
    failed, done = tick(failed_reason="reward_error"), tick(id="team-a.b", name="b", finished=True)
    recs = records_of(report(failed, done), "p", 0)
    assert [(r.run.experiment, r.end, bool(r.metrics)) for r in recs] == [
        ("exp", "FAILED", False),
        ("b", "FINISHED", True),
    ]


# --- policies --------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(n, 1.0, 10.0) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert backoff_s(10_000, 1.0, 60.0) == 60.0  # no overflow after a long outage


def test_the_log_limiter_lets_one_line_a_minute_through_and_counts_the_rest() -> None:
    limiter = LogLimiter(every_s=60.0)
    assert limiter.allow(0.0) == (True, 0)
    assert limiter.allow(10.0) == (False, 0) and limiter.allow(59.0) == (False, 0)
    assert limiter.allow(60.0) == (True, 2)


# --- the sink ----------------------------------------------------------------------------


class Events:
    def __init__(self) -> None:
        self.counts = {"sent": 0, "dropped": 0, "failed": 0}
        self.ups: list[bool] = []

    def sent(self, tracker: str, n: int) -> None:
        self.counts["sent"] += n

    def dropped(self, tracker: str, n: int) -> None:
        self.counts["dropped"] += n

    def failed(self, tracker: str) -> None:
        self.counts["failed"] += 1

    def up(self, tracker: str, ok: bool) -> None:
        self.ups.append(ok)


class Recording:
    name = "recording"

    def __init__(self, fail_first: int = 0, gate: threading.Event | None = None) -> None:
        self.steps: list[int] = []
        self.fail_first = fail_first
        self.calls = 0
        self.gate = gate
        self.closed = False
        self.changed = threading.Condition()
        self.entered = threading.Event()  # log() was called

    def log(self, records: Sequence[StepRecord]) -> None:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        with self.changed:
            self.calls += 1
            self.changed.notify_all()
            if self.calls <= self.fail_first:
                raise ConnectionError("tracker down")
            self.steps += [r.step for r in records]
            self.changed.notify_all()

    def close(self) -> None:
        self.closed = True

    def wait_for(self, steps: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.steps) >= steps, WAIT_S), self.steps


def rec(step: int) -> StepRecord:
    return StepRecord(RunRef("ns", "exp", "r", "exp"), step, 0, {"reward_mean": 1.0})


def test_a_full_queue_drops_the_oldest_and_never_waits() -> None:
    gate = threading.Event()  # the tracker hangs until released
    tracker, events = Recording(gate=gate), Events()
    sink = Sink(tracker, events, capacity=5)
    sink.put([rec(0)])  # taken by the thread, which then hangs in log()
    assert tracker.entered.wait(WAIT_S)
    for step in range(1, 21):  # 20 more while it hangs: put() returns each time
        sink.put([rec(step)])
    assert sink.queued == 5 and events.counts["dropped"] == 15
    gate.set()
    tracker.wait_for(1 + 5)
    assert sink.close(WAIT_S) and tracker.closed
    assert tracker.steps[-5:] == [16, 17, 18, 19, 20]  # the newest kept, in order
    assert tracker.steps == [0, 16, 17, 18, 19, 20]


def test_a_failing_tracker_is_retried_and_loses_nothing_it_had_room_for() -> None:
    tracker, events = Recording(fail_first=3), Events()
    sink = Sink(tracker, events, capacity=100, backoff=lambda n: 0.01)
    sink.put([rec(1), rec(2)])
    sink.put([rec(3)])
    tracker.wait_for(3)
    assert tracker.steps == [1, 2, 3]
    assert events.counts == {"sent": 3, "dropped": 0, "failed": 3}
    assert events.ups[:3] == [False] * 3 and events.ups[-1] is True
    assert sink.close(WAIT_S)


def test_closing_gives_a_hung_tracker_a_bounded_time() -> None:
    gate = threading.Event()
    sink = Sink(Recording(gate=gate), Events(), capacity=10)
    sink.put([rec(1)])
    assert sink.close(0.2) is False  # returns; the daemon thread is abandoned
    gate.set()


def test_closing_a_down_tracker_tries_once_and_ends() -> None:
    tracker = Recording(fail_first=10**6)
    sink = Sink(tracker, Events(), capacity=10, backoff=lambda n: 3600.0)
    sink.put([rec(1)])
    with tracker.changed:
        assert tracker.changed.wait_for(lambda: tracker.calls >= 1, WAIT_S)
    assert sink.close(WAIT_S) and tracker.closed and tracker.calls == 2


def test_tracking_never_raises_into_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    tracking = Tracking([Recording()], CollectorRegistry(), 10, "p")
    tracking.observe_tick(None)  # type: ignore[arg-type]  # a broken report
    assert "could not queue" in caplog.text
    tracking.close(WAIT_S)


# --- configuration ---------------------------------------------------------------------


def test_no_tracker_is_built_unless_the_pool_asks() -> None:
    assert build_trackers(ServeSettings(model="/m"), "/ckpt") == []


def test_a_tracker_whose_client_is_missing_is_a_usage_error_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    monkeypatch.delitem(sys.modules, "loraplex_engine.tracking.tensorboard_tracker", False)
    settings = ServeSettings(model="/m", tracking_tensorboard_dir="/tb")
    with pytest.raises(UsageError, match=r"--tracking-tensorboard-dir: .*tensorboard package"):
        build_trackers(settings, "/ckpt")


# --- file trackers, read back with their own tools --------------------------------------


def test_tensorboard_event_files_hold_each_metric_by_step(tmp_path: Path) -> None:
    from loraplex_engine.tracking.tensorboard_tracker import TensorBoardTracker

    from tests.support.event_reader import scalars

    spec = TrackingSpec.model_validate({"runName": "r1", "tags": [{"name": "k", "value": "v"}]})
    tb = TensorBoardTracker(str(tmp_path))
    for step in (1, 2):
        t = tick(step=step, reward=0.25 * step, kl=0.01 * step, tracking=spec)
        tb.log(records_of(report(t), "p", 1000 * step))
    tb.close()
    run_dir = tmp_path / "team-a" / "exp" / "uid-1"
    got = scalars(run_dir)
    assert got["reward_mean"] == [(1, 0.25), (2, 0.5)]
    assert got["kl"] == [(1, pytest.approx(0.01)), (2, pytest.approx(0.02))]
    assert set(got) == {
        "reward_mean", "kl", "step_seconds", "rollout_tokens", "train_tokens", "dropped_groups",
        "rollout_version", "rollout_staleness",
    }  # fmt: skip
    assert '"runName": "r1"' in (run_dir / "run.json").read_text()


def test_wandb_offline_run_files_hold_the_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplex_engine.tracking.wandb_tracker import WandbTracker

    from tests.support.event_reader import wandb_history

    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))  # the tracker sets them if unset
    tracker = WandbTracker("offline", "loraplex-test", None, str(tmp_path))
    for step in (1, 2, 3):
        tracker.log(records_of(report(tick(step=step, reward=step / 4)), "p", 0))
    tracker.close()
    history = wandb_history(tmp_path, wait_s=0.0)  # close() waits for W&B's own writer
    assert [(h["_step"], h["reward_mean"]) for h in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
