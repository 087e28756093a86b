"""One tenant cannot stop, starve or leak into another (issue 15, the engine's part).

Each test attacks a real ``loraplex-engine serve`` process with nothing but the fields of
its own experiment, and measures a co-tenant that trains throughout: its step count keeps
rising while the attack runs. The engine runs with small limits so the attacks are cheap:
``--max-prompt-tokens 64 --max-step-tokens 10000 --reward-deadline 0.3``; datasets lie
under its data root (``<root>/team-a/``) and the loopback reward server is an allowed
reward host, as a pool admin would configure them (the trust checks themselves are
tests/engine/tenancy/test_tenant_boundaries.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.reward_server import reward_server
from tests.support.server_process import EngineServer, wait_until
from tests.support.tenant_api import LIMITS, failed, put, spec, status

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
COTENANT = "default.cotenant"
SLOW_REWARD_S = 3.0
STALL_S = 25.0
REWARD_DEADLINE_S = 0.3
ALLOW_LOOPBACK_REWARDS = ["--allow-reward-host", "127.0.0.1"]


def free_slots(api: httpx.Client) -> int:
    return api.get("/v1/capacity").json()["freeSlots"]


# ---- the co-tenant, measured -------------------------------------------------------------


@contextmanager
def cotenant_keeps_training(server: EngineServer, window_s: float = 3.0) -> Iterator[list]:
    """Sample the co-tenant's step every 0.2 s while the block runs; on exit assert that
    its step rose within every ``window_s`` of the block (and rose overall)."""
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        with server.client() as c:
            while not stop.is_set():
                samples.append((time.monotonic(), status(c, COTENANT)["step"]))
                stop.wait(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
        time.sleep(window_s)  # one more full window after the attack is contained
    finally:
        stop.set()
        thread.join(10)
    assert samples[-1][1] > samples[0][1], f"co-tenant did not train: {samples}"
    for t, step in samples:
        later = [s for u, s in samples if u >= t + window_s]
        if later:
            assert later[0] > step, f"co-tenant stalled for {window_s}s at step {step}"


# ---- servers -----------------------------------------------------------------------------


def _score(path: str, items: list[dict[str, Any]]) -> list[int | float]:
    """/huge: scores of 401 digits; /slow: 1.0 each after SLOW_REWARD_S seconds; /stall:
    after STALL_S (under the reward client's 30 s timeout)."""
    time.sleep({"/slow": SLOW_REWARD_S, "/stall": STALL_S}.get(path, 0.0))
    return [10**400 if path == "/huge" else 1.0] * len(items)


@pytest.fixture(scope="module")
def reward_url() -> Iterator[str]:
    with reward_server(_score) as url:
        yield url


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("isolation")
    (work / "data" / "team-a").mkdir(parents=True)
    args = [
        *LIMITS,
        *ALLOW_LOOPBACK_REWARDS,
        "--reward-deadline",
        str(REWARD_DEADLINE_S),
        "--data-root",
        str(work / "data"),
    ]
    srv = EngineServer(tiny_model_dir, work / "ckpt", max_adapters=8, workdir=work, extra_args=args)
    srv.start()
    with srv.client() as api:
        assert put(api, COTENANT, spec()).status_code == 201
        wait_until(lambda: status(api, COTENANT)["step"] >= 1)
    yield srv
    srv.kill()


@pytest.fixture()
def team_a_data(server: EngineServer) -> Path:
    """Tenant team-a's directory under the engine's data root."""
    return server.workdir / "data" / "team-a"


@pytest.fixture()
def api(server: EngineServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def jsonl_task(path: Path) -> dict[str, Any]:
    return {"name": "jsonl", "dataset": str(path)}


# ---- attack 1: one tenant stops the engine for all ---------------------------------------


def test_empty_or_deleted_dataset_fails_only_its_experiment(server, api, team_a_data) -> None:
    empty = team_a_data / "empty.jsonl"
    empty.write_text("")
    deleted = team_a_data / "deleted.jsonl"
    deleted.write_text('{"prompt": "say yes:", "answer": "yes"}\n')
    with cotenant_keeps_training(server):
        assert put(api, "team-a.empty", spec(jsonl_task(empty))).status_code == 201
        assert put(api, "team-a.deleted", spec(jsonl_task(deleted))).status_code == 201
        deleted.unlink()
        for exp_id, what in (("team-a.empty", "has no rows"), ("team-a.deleted", "task failed")):
            st = failed(api, exp_id)
            assert what in st["error"], st["error"]
            assert st["failureReason"] == "task_error" and st["deterministicFailure"] is True
        # Many more bad tenants than the loop's tick-error budget (5): none fails a tick.
        for i in range(6):
            assert put(api, f"team-a.empty-{i}", spec(jsonl_task(empty))).status_code == 201
            failed(api, f"team-a.empty-{i}")
            api.delete(f"/v1/experiments/team-a.empty-{i}")
        assert httpx.get(f"{server.url}/healthz").status_code == 200
    for exp_id in ("team-a.empty", "team-a.deleted"):
        assert api.delete(f"/v1/experiments/{exp_id}").status_code == 200


def test_reward_of_401_digits_fails_only_its_experiment(server, api, reward_url) -> None:
    task = {"name": "target-token", "reward": "http", "rewardUrl": f"{reward_url}/huge"}
    with cotenant_keeps_training(server):
        assert put(api, "team-a.huge", spec(task)).status_code == 201
        st = failed(api, "team-a.huge")
        assert "not finite" in st["error"] and st["failureReason"] == "reward_error", st
        assert st["step"] == 0
        assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert api.delete("/v1/experiments/team-a.huge").status_code == 200


# ---- attack 2: co-tenants starve -----------------------------------------------------------


def test_slow_reward_paces_its_experiment_not_the_tick(server, api, reward_url) -> None:
    task = {"name": "target-token", "reward": "http", "rewardUrl": f"{reward_url}/slow"}
    window = 4 * SLOW_REWARD_S
    with cotenant_keeps_training(server) as samples:
        assert put(api, "team-a.slow", spec(task)).status_code == 201
        start = status(api, COTENANT)["step"]
        time.sleep(window)
        cotenant_steps = status(api, COTENANT)["step"] - start
        slow = status(api, "team-a.slow")
    # A tick held by the reward would give the co-tenant one step per SLOW_REWARD_S.
    assert cotenant_steps > 5 * window / SLOW_REWARD_S, (cotenant_steps, samples[-5:])
    # The slow experiment is not failed: it steps at its reward's pace.
    assert slow["phase"] == "Running" and 2 <= slow["step"] <= window / SLOW_REWARD_S + 1, slow
    assert api.delete("/v1/experiments/team-a.slow").status_code == 200


def test_maximal_spec_is_refused_at_admission_and_an_allowed_big_one_is_paced(server, api) -> None:
    crd_max = spec(group=256, prompts=32, new_tokens=128)
    r = put(api, "team-a.max", crd_max)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_spec" and err["field"] == "spec.algorithm.promptsPerStep"
    assert "limit of 10000" in err["message"] and "prompt limit 64" in err["message"]
    # A completion request is bounded by the same limits.
    r = api.post("/v1/completions", json={"model": COTENANT, "prompt": "x " * 200})
    assert r.status_code == 400 and r.json()["error"]["field"] == "prompt", r.text  # OpenAI route
    # A spec near the limits (64 rows x (64 + 64) tokens) steps less often.
    with cotenant_keeps_training(server, window_s=5.0):
        assert put(api, "team-a.big", spec(group=16, prompts=4, new_tokens=64)).status_code == 201
        start = status(api, COTENANT)["step"]
        wait_until(lambda: status(api, "team-a.big")["step"] >= 2, timeout=120)
        cotenant_steps = status(api, COTENANT)["step"] - start
    assert cotenant_steps >= 10, cotenant_steps  # lockstep would give it about 2
    assert api.delete("/v1/experiments/team-a.big").status_code == 200


def test_long_prompt_fails_its_experiment_naming_the_line(server, api, team_a_data) -> None:
    data = team_a_data / "long.jsonl"
    data.write_text(json.dumps({"prompt": "word " * 2400, "answer": "yes"}) + "\n")
    with cotenant_keeps_training(server):
        assert put(api, "team-a.long", spec(jsonl_task(data))).status_code == 201
        st = failed(api, "team-a.long")
    assert "dataset line 1 has" in st["error"] and "limit of 64" in st["error"], st["error"]
    assert st["failureReason"] == "task_error" and st["step"] == 0
    assert api.delete("/v1/experiments/team-a.long").status_code == 200


# ---- attack 7: a corrupt checkpoint leaks a slot -------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("rolloutTokens", "abc"), ("promptRng", [1, 2]), ("trainTokens", None)],
)
def test_corrupt_checkpoint_is_refused_and_leaks_no_slot(server, api, field, value) -> None:
    exp_id = f"team-a.victim-{field.lower()}"
    assert put(api, exp_id, spec()).status_code == 201
    wait_until(lambda: status(api, exp_id)["step"] >= 2)
    gone = api.delete(f"/v1/experiments/{exp_id}").json()
    ckpt, run_id = Path(gone["checkpoint"]["path"]), gone["runId"]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["metadata"][field] = value
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    free = free_slots(api)
    with cotenant_keeps_training(server):
        for _ in range(free + 1):  # more refusals than free slots: a leak would show
            r = put(api, exp_id, spec(), resumeFrom=str(ckpt), runId=run_id)
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["code"] == "bad_checkpoint" and field in err["message"], err
            assert free_slots(api) == free
    assert put(api, exp_id, spec()).status_code == 201  # a fresh start still finds a slot
    assert api.delete(f"/v1/experiments/{exp_id}").status_code == 200


# ---- attack 3: queued completions are lost ------------------------------------------------


def _complete_until_refused(server: EngineServer, codes: list[int], until: float) -> None:
    """Send completions one after another until one is refused or ``until`` passes."""
    with server.client() as c:
        while time.monotonic() < until:
            r = c.post("/v1/completions", json={"model": COTENANT, "prompt": "hi", "max_tokens": 2})
            codes.append(r.status_code)
            if r.status_code != 200:
                return


def test_failed_ticks_answer_their_completions_and_sigterm_still_exits(
    tiny_model_dir, tmp_path, reward_url
) -> None:
    faults = tmp_path / "faults"
    ckpt = tmp_path / "ckpt"
    leftover = ckpt / "default" / "old" / "run1" / ".step-00000004.tmp-abc123"
    leftover.mkdir(parents=True)
    two_hours_ago = time.time() - 7200
    os.utime(leftover, (two_hours_ago, two_hours_ago))  # a crash's, long ago
    in_progress = ckpt / "default" / "busy" / "run2" / ".step-00000007.tmp-def456"
    in_progress.mkdir(parents=True)  # another engine's write, now (the root is shared)
    srv = EngineServer(
        tiny_model_dir,
        ckpt,
        max_adapters=4,
        workdir=tmp_path,
        command=[sys.executable, "-m", "tests.support.faulty_engine"],
        extra_args=[*LIMITS, *ALLOW_LOOPBACK_REWARDS],
        env={
            "LORAPLEX_TEST_FAULTS": str(faults),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
    )
    with srv:
        assert not leftover.exists()  # a crash's half-written checkpoint is gone at start-up
        assert in_progress.exists()  # but not another engine's write in progress
        api = srv.client()
        assert put(api, COTENANT, spec()).status_code == 201
        wait_until(lambda: status(api, COTENANT)["step"] >= 1)
        # A reward that hangs is in flight through all of this, up to SIGTERM.
        stall = {"name": "target-token", "reward": "http", "rewardUrl": f"{reward_url}/stall"}
        assert put(api, "team-a.stall", spec(stall)).status_code == 201
        # Three failed ticks (under the loop's budget of five): their jobs are answered.
        codes: list[int] = []
        with cotenant_keeps_training(srv, window_s=5.0):
            faults.write_text("3")
            until = time.monotonic() + 30
            threads = [
                threading.Thread(target=_complete_until_refused, args=(srv, codes, until))
                for _ in range(8)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a completion hung"
            assert 503 in codes and set(codes) <= {200, 503}, codes
        # Then faults until the loop gives up: every waiting completion is answered.
        faults.write_text("1000")
        codes = []
        threads = [
            threading.Thread(
                target=_complete_until_refused, args=(srv, codes, time.monotonic() + 60)
            )
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        wait_until(lambda: httpx.get(f"{srv.url}/healthz").status_code == 503, timeout=60)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a completion hung after the loop stopped"
        r = api.post("/v1/completions", json={"model": COTENANT, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        api.close()
        t0 = time.monotonic()
        rc = srv.stop(timeout=60)
        took = time.monotonic() - t0
    # A pod's default grace is 30 s; the hung reward (STALL_S) must not hold the exit.
    assert rc == 0 and took < STALL_S - 5, (rc, took, srv.log_tail())
