"""Issue 26, items 4 and 7, on a real ``loraplex-engine serve``: tenant A's reward service
answers a GiB, trickles a byte every 2 s, or A names it by an IPv6 spelling of a local
address; bystander B (team-b, a built-in reward) trains throughout.

B's step rate is measured alone right before each attack, then during it, from the same
status samples (every 0.1 s): during an attack it keeps at least 70% of its rate alone
(the issue's floor) and never goes 2 s without a step. What can differ between the two
windows is A's own rollout tick (one before its reward fails or goes pending: A's spec is
B's size), the CPU the attack costs the engine (reading up to the cap, a read every 2 s)
and the load of the machine, shared in CI: hence "right before", not once per module.

The engine allows the test's reward server by host *and port* (``--allow-reward-host
127.0.0.1:PORT``) and waits 0.3 s for a tick's rewards; the exchange bounds are the
defaults (tenancy/reward_exchange.py): a 30 s deadline, a 1 MiB answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import psutil
import pytest
from loraplex_engine.tenancy.reward_exchange import MAX_REWARD_ANSWER_BYTES, REWARD_TIMEOUT_S

from tests.support.machine import scaled
from tests.support.server_process import EngineServer, wait_until
from tests.support.step_meter import BYSTANDER, Meter
from tests.support.tenant_api import LIMITS, put, spec, status

# pace: rates compared, so `make test` runs this module alone (tests/support/pace.py)
pytestmark = [pytest.mark.slow, pytest.mark.pace]

GIB = 1 << 30
MIB = 1 << 20
FLOOR = 0.7  # of B's rate alone (the issue's)
MAX_STALL_S = 2.0
TRICKLE_EVERY_S = 2.0


class _Rewards(BaseHTTPRequestHandler):
    """/score: 1.0 each; /gib-length and /gib-chunked: a GiB announced or streamed,
    counting what got out; /trickle: one byte every TRICKLE_EVERY_S, for minutes."""

    sent: ClassVar[Counter[str]] = Counter()
    arrived: ClassVar[list[tuple[str, float]]] = []  # (path, when) of each request
    stop = threading.Event()

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        _Rewards.arrived.append((self.path, time.monotonic()))
        try:
            if self.path == "/trickle":
                self._trickle()
            elif self.path.startswith("/gib-"):
                self._flood(chunked=self.path == "/gib-chunked")
            else:
                body = json.dumps({"scores": [1.0] * len(items)}).encode()
                self._head({"Content-Length": str(len(body))})
                self.wfile.write(body)
        except OSError:  # the engine cut the connection: what the attacks expect
            pass

    def _head(self, headers: dict[str, str]) -> None:
        self.send_response(200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def _trickle(self) -> None:
        self._head({"Content-Type": "application/json", "Content-Length": "1000"})
        for _ in range(90):  # 3 minutes at most
            self.wfile.write(b" ")
            self.wfile.flush()
            if _Rewards.stop.wait(TRICKLE_EVERY_S):
                return

    def _flood(self, chunked: bool) -> None:
        self._head({"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(GIB)})
        block = b"7" * 65536
        frame = b"%x\r\n%b\r\n" % (len(block), block) if chunked else block
        while _Rewards.sent[self.path] < GIB and not _Rewards.stop.is_set():
            self.wfile.write(frame)
            _Rewards.sent[self.path] += len(block)


def arrivals(path: str) -> list[float]:
    return [t for p, t in _Rewards.arrived if p == path]


@pytest.fixture(scope="module")
def reward_port() -> Iterator[int]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Rewards)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    _Rewards.stop.set()
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, reward_port: int
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("reward-bounds")
    args = [
        *LIMITS,
        *("--allow-reward-host", f"127.0.0.1:{reward_port}"),
        *("--reward-deadline", "0.3"),
    ]
    srv = EngineServer(tiny_model_dir, work / "ckpt", max_adapters=8, workdir=work, extra_args=args)
    srv.start()
    with srv.client() as api:
        assert put(api, BYSTANDER, spec()).status_code == 201
        wait_until(lambda: status(api, BYSTANDER)["step"] >= 3)
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def api(server: EngineServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def reward_task(port: int, path: str) -> dict[str, Any]:
    return {"name": "target-token", "reward": "http", "rewardUrl": f"http://127.0.0.1:{port}{path}"}


# ---- B, measured ---------------------------------------------------------------------------


@pytest.fixture()
def alone(server: EngineServer) -> Meter:
    """B alone, measured right before the test's attack."""
    meter = Meter(server).run(min_s=4.0)
    assert meter.rate > 2, meter.steps  # B steps in tens of ms: a rate to compare to
    return meter


def assert_b_kept_pace(during: Meter, alone: Meter, what: str) -> None:
    grew = (max(during.rss) - during.rss[0]) / MIB
    print(
        f"{what}: B {during.rate:.1f} steps/s (alone {alone.rate:.1f}), longest stall "
        f"{during.longest_stall:.2f}s, engine RSS +{grew:.0f} MiB"
    )
    assert during.rate >= FLOOR * alone.rate, (what, during.rate, alone.rate)
    assert during.longest_stall <= MAX_STALL_S, (what, during.longest_stall)


# ---- item 7: egress spellings --------------------------------------------------------------


def test_ipv6_spellings_of_local_addresses_and_other_ports_are_refused(
    api: httpx.Client, reward_port: int
) -> None:
    attacks = {
        f"http://[::127.0.0.1]:{reward_port}/score": "loopback",
        f"http://[::ffff:127.0.0.1]:{reward_port}/score": "loopback",
        "http://[64:ff9b::a9fe:a9fe]/latest/meta-data/": "metadata",
        "http://[2002:a9fe:a9fe::]/latest/meta-data/": "metadata",
        f"http://127.0.0.1:{reward_port + 1}/score": "loopback",  # the allowed host, not port
    }
    for url, why in attacks.items():
        task = {"name": "target-token", "reward": "http", "rewardUrl": url}
        r = put(api, "team-a.ssrf", spec(task))
        assert r.status_code == 422, (url, r.text)
        error = r.json()["error"]
        assert error["field"] == "spec.task.rewardUrl" and why in error["message"], (url, error)
    # The allowed host and port: admitted, and it trains.
    assert put(api, "team-a.ok", spec(reward_task(reward_port, "/score"))).status_code == 201
    wait_until(lambda: status(api, "team-a.ok")["step"] >= 2)
    assert api.delete("/v1/experiments/team-a.ok").status_code == 200


# ---- item 4: a GiB answer ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/gib-length", "/gib-chunked"])
def test_a_gib_answer_is_refused_at_the_cap(
    server: EngineServer, api: httpx.Client, reward_port: int, alone: Meter, path: str
) -> None:
    exp_id = f"team-a.flood{path.replace('/gib', '')}"
    _Rewards.sent[path] = 0

    def attack() -> None:
        assert put(api, exp_id, spec(reward_task(reward_port, path))).status_code == 201
        failed = wait_until(lambda: (s := status(api, exp_id))["phase"] == "Failed" and s)
        assert (
            f"answered more than the limit of {MAX_REWARD_ANSWER_BYTES} bytes" in (failed["error"])
        ), failed
        assert failed["failureReason"] == "reward_error"

    during = Meter(server).run(attack)
    # The server stops once the engine drops the connection: what got out is the cap
    # (none with Content-Length) plus loopback's socket buffers, not the GiB.
    wait_until(lambda: _settled(path), timeout=10)
    print(f"{path}: the server got {_Rewards.sent[path] / MIB:.1f} MiB out of {GIB / MIB:.0f}")
    assert _Rewards.sent[path] < 64 * MIB
    assert max(during.rss) - during.rss[0] < 512 * MIB
    assert_b_kept_pace(during, alone, path)
    assert api.delete(f"/v1/experiments/{exp_id}").status_code == 200


def _settled(path: str) -> bool:
    before = _Rewards.sent[path]
    time.sleep(0.3)
    return _Rewards.sent[path] == before


# ---- item 4: a trickle ---------------------------------------------------------------------


def test_a_trickling_reward_fails_at_its_deadline_and_b_keeps_its_pace(
    server: EngineServer, api: httpx.Client, reward_port: int, alone: Meter
) -> None:
    asked = len(arrivals("/trickle"))
    failed_at: list[float] = []

    def attack() -> None:
        assert (
            put(api, "team-a.trickle", spec(reward_task(reward_port, "/trickle"))).status_code
            == 201
        )
        st = wait_until(
            lambda: (s := status(api, "team-a.trickle"))["phase"] == "Failed" and s,
            timeout=REWARD_TIMEOUT_S + 15,
            interval=0.5,  # light: B's sampler is the only other client
        )
        failed_at.append(time.monotonic())
        assert f"within its deadline of {REWARD_TIMEOUT_S:g}s" in st["error"], st

    during = Meter(server).run(attack)
    sent_at = arrivals("/trickle")[asked]
    took = failed_at[0] - sent_at
    print(f"trickle: A failed {took:.1f}s after its request reached the service")
    # The deadline counts from before the connect; the failure is seen by the next tick
    # and this 0.5 s poll.
    assert REWARD_TIMEOUT_S - 0.5 <= took <= REWARD_TIMEOUT_S + 3, took
    assert_b_kept_pace(during, alone, "trickle")
    assert api.delete("/v1/experiments/team-a.trickle").status_code == 200


def test_deleting_experiments_with_trickling_rewards_leaves_no_thread_or_socket(
    server: EngineServer, api: httpx.Client, reward_port: int
) -> None:
    engine = psutil.Process(server.proc.pid if server.proc else 0)

    def to_rewards() -> int:
        return sum(
            1 for c in engine.net_connections("tcp") if c.raddr and c.raddr.port == reward_port
        )

    def cycle(i: int) -> None:
        asked = len(arrivals("/trickle"))
        exp_id = f"team-a.cycle-{i}"
        assert put(api, exp_id, spec(reward_task(reward_port, "/trickle"))).status_code == 201
        wait_until(lambda: len(arrivals("/trickle")) > asked, timeout=10)  # the call is out
        assert api.delete(f"/v1/experiments/{exp_id}").status_code == 200

    # Closed well inside the calls' 30 s deadline: 5 s of an idle machine, at most 20.
    closed_within = min(scaled(5.0), 20.0)
    cycle(0)  # the request path's own threads exist from here on
    wait_until(lambda: to_rewards() == 0, timeout=closed_within)
    threads0, sockets0 = engine.num_threads(), len(engine.net_connections("inet"))
    peak = threads0
    for i in range(1, 16):
        cycle(i)
        peak = max(peak, engine.num_threads())
    # Each DELETE closed its reward: no call outlives it (the deadline is 30 s away).
    wait_until(
        lambda: to_rewards() == 0 and engine.num_threads() <= threads0, timeout=closed_within
    )
    sockets = len(engine.net_connections("inet"))
    print(
        f"cycles: threads {threads0} -> peak {peak} -> {engine.num_threads()}, inet sockets "
        f"{sockets0} -> {sockets}"
    )
    assert sockets <= sockets0
    assert len(arrivals("/trickle")) >= 16
