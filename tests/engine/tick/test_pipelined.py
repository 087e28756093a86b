"""The pipelined schedule (tick/pipelined.py, docs/design/pipeline.md) on the real engine.

- ``maxStaleness: 0``: every experiment's updates are the sync schedule's: the same
  rewards step by step and the same adapter weights at the end, though each tick trains
  a different cohort (other batch shapes, so float sums in another order).
- ``maxStaleness: 1``: every trained step reports the weights version its rollout was
  sampled with, and none is more than one step behind; some are (the overlap happened).
- the cohort logic (who may roll out, the first tick's split) directly.

The torch rollout (the trainer's own model) runs the stages one after the other; the
overlap with vLLM in its own process is the benchmark's (bench/throughput.py
``pipelined``), as starting vLLM here costs minutes.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loraplex_engine.spec.errors import UsageError
from loraplex_engine.tick.pipelined import (
    Lane,
    PipelinedTick,
    fill_split,
    may_roll_out,
    tick_class,
)
from loraplex_engine.tick.tick import Tick

from tests.support.engine_builders import engine, spec
from tests.support.pipelined_specs import STEPS, TARGETS, flat, slot_weights, staleness_specs


def run(model_dir: Path, root: Path, schedule: str, staleness: int) -> tuple[Any, Any, Any]:
    """The engine after its experiments end, each tick's experiment reports, and each
    adapter's weights before the first step."""
    eng = engine(model_dir, root, schedule=schedule)
    for exp_id, s in staleness_specs(staleness).items():
        eng.put_experiment(exp_id, s)
    start = {exp_id: slot_weights(eng, exp_id) for exp_id in staleness_specs(staleness)}
    ticks = []
    for _ in range(10 * STEPS):
        report = eng.tick()
        if report is None:
            return eng, ticks, start
        ticks.append(report.experiments)
    raise AssertionError("still running")


def test_on_policy_pipelined_updates_equal_the_sync_runs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sync, sync_reports, _ = run(tiny_model_dir, tmp_path / "s", "sync", 0)
    piped, piped_reports, piped_start = run(tiny_model_dir, tmp_path / "p", "pipelined", 0)
    assert isinstance(piped._tick, PipelinedTick) and type(sync._tick) is Tick
    sync_ticks = [t for r in sync_reports for t in r]
    piped_ticks = [t for r in piped_reports for t in r]
    for exp_id in staleness_specs(0):
        mine = [t for t in piped_ticks if t.id == exp_id]
        theirs = [t for t in sync_ticks if t.id == exp_id]
        assert [t.step for t in mine] == list(range(1, STEPS + 1))
        # On-policy: each step's rollout was sampled with the weights of the step before.
        assert [t.rollout_version for t in mine] == [t.step - 1 for t in mine]
        assert [t.rollout_version for t in theirs] == [t.step - 1 for t in theirs]
        # Same sampled tokens (the reward is a function of them) and the same updates:
        # the weights differ only by float reassociation over other batch shapes. fp32
        # sums in another order differ by ~1e-7 relative; Adam divides each coordinate by
        # its gradient's RMS, so a coordinate whose gradient is near zero can carry more of
        # it: bounded at 1e-3 of how far the updates moved the weights (measured ~1e-4).
        assert [t.reward for t in mine] == [t.reward for t in theirs], exp_id
        assert [t.rollout_tokens for t in mine] == [t.rollout_tokens for t in theirs]
        a, b = flat(slot_weights(piped, exp_id)), flat(slot_weights(sync, exp_id))
        moved = (b - flat(piped_start[exp_id])).norm()
        assert moved > 0 and (a - b).norm() <= 1e-3 * moved, exp_id
        assert piped.get_experiment(exp_id).phase == "Succeeded"
    # Cohorts: the first tick rolled out two of the three, so no tick trained all three
    # (the sync schedule trains all three in every tick).
    assert max(len(r) for r in piped_reports) < len(TARGETS) == min(len(r) for r in sync_reports)


def test_stale_by_one_pipelined_rollouts_are_at_most_one_step_behind(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    eng, reports, _ = run(tiny_model_dir, tmp_path, "pipelined", 1)
    trained = [t for r in reports for t in r if t.failed_reason is None]
    assert len(trained) == STEPS * len(TARGETS)
    staleness = [t.step - 1 - t.rollout_version for t in trained]
    assert all(0 <= s <= 1 for s in staleness), staleness
    assert staleness.count(1) >= len(TARGETS) * (STEPS - 2)  # the overlap happened
    for exp_id in staleness_specs(1):
        status = eng.get_experiment(exp_id)
        assert status.phase == "Succeeded" and status.step == STEPS


def _exp(staleness: int, step: int = 0, max_steps: int = 5, eval_due: bool = False) -> Any:
    alg = SimpleNamespace(max_staleness=staleness)
    return SimpleNamespace(
        plan=SimpleNamespace(algorithm=alg),
        step=step,
        max_steps=max_steps,
        finished_steps=max_steps > 0 and step >= max_steps,
        eval_due=lambda: eval_due,
    )


def test_who_may_roll_out() -> None:
    # pending: the experiment's updates not landed yet (this rollout would be that stale)
    assert may_roll_out(_exp(0), pending=0)
    assert not may_roll_out(_exp(0), pending=1)  # waits for its own update
    assert may_roll_out(_exp(1), pending=1)
    assert not may_roll_out(_exp(1), pending=2)
    assert may_roll_out(_exp(3), pending=3) and not may_roll_out(_exp(3), pending=4)
    assert may_roll_out(_exp(16, max_steps=0), pending=16)  # continual
    assert not may_roll_out(_exp(1, step=4), pending=1)  # that update is its last
    assert may_roll_out(_exp(3, step=2), pending=2)  # step 4 of 5 would be its last
    assert not may_roll_out(_exp(3, step=2), pending=3)  # a 6th step of 5
    assert not may_roll_out(_exp(0, step=5), pending=0)  # finished
    assert may_roll_out(_exp(0, step=5, eval_due=True), pending=0)  # its last eval
    assert not may_roll_out(_exp(2, step=5, eval_due=True), pending=1)  # after its updates


def test_a_lane_trains_its_rollouts_in_the_order_they_started() -> None:
    exp = _exp(2)
    lane = Lane(exp)  # type: ignore[arg-type]
    lane.started.extend([3, 4, 5])
    scored = {t: SimpleNamespace(rollout=SimpleNamespace(planned_tick=t)) for t in (3, 4, 5, 9)}
    assert lane.file(scored[4]) and lane.file(scored[5])  # type: ignore[arg-type]
    assert lane.take_head() is None  # tick 3's reward is late: 4 and 5 wait behind it
    assert not lane.file(scored[9])  # type: ignore[arg-type]  # not started in this lane
    assert lane.file(scored[3])  # type: ignore[arg-type]
    assert [lane.take_head() for _ in range(4)] == [scored[3], scored[4], scored[5], None]
    assert not lane.started and not lane.scored


def test_the_first_tick_rolls_out_half_the_on_policy_experiments() -> None:
    strict = [_exp(0) for _ in range(5)]
    stale = [_exp(1) for _ in range(2)]
    chosen = fill_split(strict + stale)
    assert chosen == strict[:3] + stale
    assert fill_split(strict[:1]) == strict[:1]


def test_schedule_names() -> None:
    assert tick_class("sync") is Tick and tick_class("pipelined") is PipelinedTick
    with pytest.raises(UsageError, match="one of sync, pipelined"):
        tick_class("fast")
    with pytest.raises(UsageError, match="data parallelism"):
        tick_class("pipelined", world=object())  # type: ignore[arg-type]


def test_run_command_takes_the_schedule_and_records_versions(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`loraplex-engine run --schedule pipelined`: one experiment on-policy, one allowing
    one step of staleness; summary.json records each step's rollout version."""
    from tests.support.local_runs import manifest, run_cli

    yes, no = "{name: target-token, params: {target: 'yes'}}", "{name: target-token, params: {}}"
    code, summary = run_cli(
        [manifest("strict", yes, 0), manifest("stale", no, 1, ", maxStaleness: 1")],
        tmp_path,
        tiny_model_dir,
        "--schedule",
        "pipelined",
    )
    assert code == 0
    strict, stale = summary["experiments"]
    steps = strict["steps"]
    assert strict["phase"] == stale["phase"] == "Succeeded" and stale["steps"] == steps
    assert strict["rollout_versions"] == list(range(steps))  # on-policy
    lag = [i - v for i, v in enumerate(stale["rollout_versions"])]
    assert len(lag) == steps and set(lag) <= {0, 1} and 1 in lag, lag


class _RewardThenFault(BaseHTTPRequestHandler):
    """Scores its first batch (0.5 each), answers 500 to every later one."""

    calls = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        if type(self).calls > 1:
            self.send_response(500)
            self.end_headers()
            return
        answer = json.dumps({"scores": [0.5] * len(body["items"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


def test_a_stale_experiment_failing_in_its_next_rollout_does_not_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """maxStaleness 1: its second rollout's reward fails while its first trains. It fails
    alone, without the step (its update is not reported, no checkpoint is written)."""
    server = HTTPServer(("127.0.0.1", 0), _RewardThenFault)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/score"
        eng = engine(tiny_model_dir, tmp_path, schedule="pipelined")
        specs = staleness_specs(1)
        flaky = {"name": "target-token", "reward": "http", "rewardUrl": url}
        bad = spec(flaky, steps=STEPS, group=4, prompts=2)
        alg = bad.algorithm.model_copy(update={"max_staleness": 1})
        eng.put_experiment("good", specs["exp0"])
        eng.put_experiment("bad", bad.model_copy(update={"algorithm": alg}))
        reports = [t for _ in range(10 * STEPS) if (r := eng.tick()) for t in r.experiments]
    finally:
        server.shutdown()
    status = eng.get_experiment("bad")
    assert status.phase == "Failed" and "reward failed" in status.error and status.step == 0
    assert [t.failed_reason for t in reports if t.id == "bad"] == ["reward_error"]
    assert eng.get_experiment("good").phase == "Succeeded"


class _HeldReward(BaseHTTPRequestHandler):
    """A reward service that holds its first ``held`` calls until all of them have come
    (then answers every call at once): an experiment allowed that much staleness keeps
    starting rollouts while its rewards are out, and no other tenant is held."""

    held = 0
    calls = 0
    lock = threading.Lock()
    all_in = threading.Event()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.calls += 1
            if cls.calls >= cls.held:
                cls.all_in.set()
        cls.all_in.wait(60)  # bounded: a broken pipeline fails the test, not hangs it
        scores = [float(len(item["completion"]) % 3) for item in body["items"]]
        answer = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


def _drive(eng: Any, ids: list[str], limit_s: float = 240.0) -> list[Any]:
    """Tick until none of ``ids`` runs, waiting for late rewards as the engine loop does."""
    reports: list[Any] = []
    deadline = time.monotonic() + limit_s
    while any(eng.get_experiment(i).phase == "Running" for i in ids):
        assert time.monotonic() < deadline, "still running"
        report = eng.tick()
        if report is None:
            eng.work_available.wait(1.0)
            continue
        reports += report.experiments
    return reports


@pytest.mark.parametrize("k", [2, 4])
def test_stale_by_k_rollouts_are_at_most_k_steps_behind(
    tiny_model_dir: Path, tmp_path: Path, k: int
) -> None:
    """maxStaleness k with a reward service slower than the engine's reward deadline:
    the experiment starts a rollout each tick while its rewards are out, until k of its
    updates are pending, and then waits. Its steps' recorded versions: the first rollout
    on-policy, then one step more behind each, up to k and never more; an on-policy
    experiment beside it stays on-policy and is not held back."""
    steps = k + 4
    _HeldReward.held, _HeldReward.calls = k + 1, 0
    _HeldReward.all_in.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HeldReward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/score"
        eng = engine(tiny_model_dir, tmp_path, schedule="pipelined", reward_deadline=0.05)
        held = {"name": "target-token", "reward": "http", "rewardUrl": url}
        slow = spec(held, steps=steps, group=4, prompts=2)  # the size of strict's: same pace
        alg = slow.algorithm.model_copy(update={"max_staleness": k})
        eng.put_experiment("slow", slow.model_copy(update={"algorithm": alg}))
        eng.put_experiment("strict", staleness_specs(0)["exp0"])
        reports = _drive(eng, ["slow", "strict"])
    finally:
        server.shutdown()
    mine = [t for t in reports if t.id == "slow"]
    assert [t.failed_reason for t in mine] == [None] * steps
    lag = [t.step - 1 - t.rollout_version for t in mine]
    # k + 1 rollouts (versions 0) went out before the first reward came back; each later
    # one started with k updates pending. Without the bound the held rewards would let
    # it start one a tick: lag k + 1 and more.
    assert lag == list(range(k + 1)) + [k] * (steps - k - 1), lag
    strict = [t for t in reports if t.id == "strict"]
    assert [t.rollout_version for t in strict] == [t.step - 1 for t in strict]
    assert len(strict) == STEPS and eng.get_experiment("slow").phase == "Succeeded"
