"""Issue 26, items 1 and 2, on a real ``loraplex-engine serve`` process: tenant team-a
attacks with nothing but its own dataset file, and bystander team-b.bystander trains
throughout.

Each attack measures B's step rate (its status polled every 0.1 s) in a baseline window just
before the attack and during it: B keeps at least ``KEEP`` of its baseline rate and never
goes ``STALL_S`` without a step. The baseline is B alone for the attacks at admission (A is
not admitted while they are measured), and B beside A training on a benign file for the
attacks inside the tick: fair share gives a training A its share of the ticks whatever its
data, and that share is no attack. A's spec is B's (the same cost, so fair share
alternates them). What may still differ between the windows, and sets the 30% tolerance:
the test writes A's files during the attack, and the two cores are shared with other work
whose load drifts. The
engine's RSS (psutil, sampled with B) grows by less than ``RSS_GROWTH`` during a size
attack. The pure bounds are tests/engine/data/test_jsonl_bounds.py.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.jsonl_rows import jsonl_row
from tests.support.reward_server import reward_server
from tests.support.server_process import (
    EngineServer,
    engine_api_fixture,
    record_measurement,
    wait_until,
)
from tests.support.step_meter import BYSTANDER, Meter
from tests.support.tenant_api import failed, put, spec, status

# pace: rates compared, so `make test` runs this module alone (tests/support/pace.py)
pytestmark = [pytest.mark.slow, pytest.mark.pace]

B_SECRET = "B-SECRET"
KEEP = 0.7
# While the engine itself parses an attacker's file (a size attack), the parse is Python
# holding the GIL beside B's tick thread: CPython's switch interval hands the GIL to each
# runnable thread in turn, so a tick that were all Python would get half the interpreter.
# B's floor is that half; the lock-free check is proved by the stall bound, not the rate.
KEEP_BESIDE_PARSE = 0.5
STALL_S = 2.0
RSS_GROWTH = 512 << 20
# B's spec, and A's (the same cost): two new tokens, no checkpoint while measured.
B_SHAPE: dict[str, int] = {"new_tokens": 2, "every": 1000, "keep": 1}


SCORED_PROMPTS: list[str] = []  # every prompt A's reward service was sent


def _record(path: str, items: list[dict[str, Any]]) -> list[float]:
    """A's reward service: records every prompt it is sent."""
    SCORED_PROMPTS.extend(i["prompt"] for i in items)
    return [0.5] * len(items)


@pytest.fixture(scope="module")
def reward_url() -> Iterator[str]:
    with reward_server(_record) as url:
        yield f"{url}/score"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("data-attacks")
    for ns in ("team-a", "team-b"):
        (work / "data" / ns).mkdir(parents=True)
    (work / "data" / "team-b" / "private.jsonl").write_text(
        "".join(jsonl_row(f"{B_SECRET}-{i} say yes:") for i in range(50))
    )
    args = ["--max-prompt-tokens", "64", "--max-step-tokens", "10000"]
    args += ["--allow-reward-host", "127.0.0.1", "--data-root", str(work / "data")]
    srv = EngineServer(tiny_model_dir, work / "ckpt", max_adapters=4, workdir=work, extra_args=args)
    srv.start()
    with srv.client() as api:
        assert put(api, BYSTANDER, spec(**B_SHAPE)).status_code == 201
        wait_until(lambda: status(api, BYSTANDER)["step"] >= 3)
    yield srv
    srv.kill()


api = engine_api_fixture()


@pytest.fixture()
def team_a(server: EngineServer) -> Path:
    return server.workdir / "data" / "team-a"


def _jsonl(dataset: Path, reward_url: str | None = None) -> dict[str, Any]:
    task: dict[str, Any] = {"name": "jsonl", "dataset": str(dataset)}
    if reward_url:
        task |= {"reward": "http", "rewardUrl": reward_url}
    return spec(task, **B_SHAPE)  # B's shape: fair share alternates them


# ---- B, measured -------------------------------------------------------------------------


def _baseline(server: EngineServer) -> float:
    return Meter(server).run(min_s=4.0).rate


def _b_kept_up(name: str, baseline: float, during: Meter, size_attack: bool = False) -> None:
    note = f"B baseline {baseline:.1f} steps/s; longest stall {during.longest_stall:.2f}s"
    record_measurement(f"data_attack.{name}.b_rate_ratio", during.rate / baseline, note)
    if size_attack:
        growth = during.rss_growth / 2**20
        record_measurement(f"data_attack.{name}.rss_growth_mb", growth, "engine RSS, psutil")
        assert during.rss_growth < RSS_GROWTH, f"engine RSS grew {growth:.0f} MB"
    keep = KEEP_BESIDE_PARSE if size_attack else KEEP
    assert during.rate >= keep * baseline, f"B {during.rate:.1f} vs {baseline:.1f} steps/s"
    assert during.longest_stall <= STALL_S, note


# ---- item 1: the dataset swapped for a symlink to team-b's file ----------------------------


def test_a_dataset_swapped_for_a_symlink_never_leaks_b_rows(server, api, team_a, reward_url):
    data = team_a / "race.jsonl"
    own = "".join(jsonl_row(f"A-OWN-{i} say yes:") for i in range(20))
    data.write_text(own)
    b_file = server.workdir / "data" / "team-b" / "private.jsonl"
    swaps, stop = [0], threading.Event()

    def swap() -> None:
        """Replace the file by a link to B's file and back, a new inode each time."""
        link, fresh = team_a / ".link", team_a / ".fresh"
        while not stop.is_set():
            link.unlink(missing_ok=True)
            link.symlink_to(b_file)
            os.replace(link, data)
            time.sleep(0.02)
            fresh.write_text(own)
            os.replace(fresh, data)
            swaps[0] += 1
            time.sleep(0.12)  # mostly A's own file: some PUTs are admitted and train

    SCORED_PROMPTS.clear()
    assert put(api, "team-a.race", _jsonl(data, reward_url)).status_code == 201
    baseline = _baseline(server)  # beside A on its own file
    api.delete("/v1/experiments/team-a.race")
    puts = failures = 0
    with Meter(server).running(min_s=3.0) as during:
        swapper = threading.Thread(target=swap, daemon=True)
        swapper.start()
        deadline = time.monotonic() + 60
        while (swaps[0] < 55 or puts < 12) and time.monotonic() < deadline:
            r = put(api, "team-a.race", _jsonl(data, reward_url))
            puts += 1
            if r.status_code == 201:  # trains until it meets the link, then fails
                st = failed(api, "team-a.race", timeout=30)
                assert "symbolic link" in st["error"] or "not allowed" in st["error"], st
                failures += 1
            else:  # admission resolved the link: refused as any path out of team-a
                assert r.status_code == 422 and "not allowed" in r.text, r.text
            api.delete("/v1/experiments/team-a.race")
            time.sleep(0.25)  # a tenant's PUT/DELETE pace, not the data path, is not measured
        stop.set()
        swapper.join(10)
    record_measurement("data_attack.symlink_race.swaps", swaps[0], f"{puts} PUTs")
    assert swaps[0] >= 50 and puts >= 12 and failures >= 1, (swaps, puts, failures)
    assert any(p.startswith("A-OWN") for p in SCORED_PROMPTS)  # the race was run
    assert not [p for p in SCORED_PROMPTS if B_SECRET in p]
    _b_kept_up("symlink_race", baseline, during)


# ---- item 2: sizes --------------------------------------------------------------------------


def test_a_20mb_line_is_never_tokenised(server, api, team_a):
    data = team_a / "huge.jsonl"
    huge = jsonl_row("word " * (4 << 20))  # 20 MB
    data.write_text(jsonl_row("ok say yes:") + huge)
    baseline = _baseline(server)
    with Meter(server).running(min_s=3.0) as during:
        r = put(api, "team-a.huge", _jsonl(data))
        assert r.status_code == 422, r.text
        assert "huge.jsonl:2: line " in r.json()["error"]["message"], r.text
        assert "over the limit of 262144 bytes" in r.text
        # The same line appended after admission fails A alone, in the tick.
        data.write_text(jsonl_row("ok say yes:"))
        assert put(api, "team-a.huge", _jsonl(data)).status_code == 201
        with data.open("a") as f:
            f.write(huge)
        st = failed(api, "team-a.huge", timeout=30)
        assert "huge.jsonl:2: line " in st["error"] and st["failureReason"] == "task_error"
        # A prompt under the line bound but over 32 characters a token: not tokenised.
        data.write_text(jsonl_row("word " * 20_000))
        api.delete("/v1/experiments/team-a.huge")
        assert put(api, "team-a.huge", _jsonl(data)).status_code == 201
        st = failed(api, "team-a.huge", timeout=30)
        assert "dataset line 1 has 100000 characters" in st["error"], st
    api.delete("/v1/experiments/team-a.huge")
    _b_kept_up("line_20mb", baseline, during, size_attack=True)


def _many_rows(path: Path, rows: int, last: str = "") -> None:
    with path.open("w") as f:
        for start in range(0, rows, 100_000):
            f.write("".join(jsonl_row(f"r{i} say yes:") for i in range(start, start + 100_000)))
        f.write(last)


def test_a_million_rows_are_checked_outside_the_lock(server, api, team_a):
    data = team_a / "million.jsonl"
    _many_rows(data, 1_000_000)
    baseline = _baseline(server)
    with Meter(server).running(min_s=0.0) as during:  # the PUT: A not admitted yet
        t0 = time.monotonic()
        r = put(api, "team-a.million", _jsonl(data))
        took = time.monotonic() - t0
        assert r.status_code == 201, r.text
    wait_until(lambda: status(api, "team-a.million")["step"] >= 2, timeout=30)
    record_measurement("data_attack.million_rows.put_s", took, f"{data.stat().st_size} bytes")
    api.delete("/v1/experiments/team-a.million")
    _b_kept_up("million_rows", baseline, during, size_attack=True)


def test_a_deeply_nested_line_after_a_million_rows_is_a_4xx_naming_it(server, api, team_a):
    data = team_a / "deep.jsonl"
    _many_rows(data, 1_000_000, "[" * 100_000 + "]" * 100_000 + "\n")
    baseline = _baseline(server)
    with Meter(server).running(min_s=3.0) as during:
        for _ in range(3):  # refused alike every time, and each PUT holds no tick
            r = put(api, "team-a.deep", _jsonl(data))
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["field"] == "spec.task.dataset", err
            assert "deep.jsonl:1000001: invalid JSON (nested too deeply)" in err["message"]
        data.write_text("[" * 200_000 + "]" * 200_000 + "\n")  # over the line bound
        r = put(api, "team-a.deep", _jsonl(data))
        assert r.status_code == 422 and "deep.jsonl:1: line " in r.text, r.text
    _b_kept_up("deep_nesting", baseline, during, size_attack=True)


def test_a_dataset_growing_300k_rows_every_2s_does_not_stall_b(server, api, team_a):
    data = team_a / "growing.jsonl"
    data.write_text(jsonl_row("seed say yes:"))
    batch = "".join(jsonl_row(f"g{i} say yes:") for i in range(300_000))
    assert put(api, "team-a.growing", _jsonl(data)).status_code == 201
    baseline = _baseline(server)  # beside A on its one row
    with Meter(server).running(min_s=10.0) as during:
        for _ in range(5):
            with data.open("a") as f:
                f.write(batch)
            time.sleep(2.0)
    st = status(api, "team-a.growing")
    assert st["phase"] == "Running" and st["step"] >= 5, st
    api.delete("/v1/experiments/team-a.growing")
    _b_kept_up("growing", baseline, during, size_attack=True)
