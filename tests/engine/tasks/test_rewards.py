import json
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from loraplex_engine.spec.errors import RewardError
from loraplex_engine.tasks.rewards import (
    BUILTIN_REWARDS,
    BuiltinReward,
    HttpReward,
    RewardItem,
    contains,
    coverage,
    exact_match,
    make_reward,
    prefix_overlap,
    word_fraction,
)
from loraplex_engine.tenancy.trust import Resolver, RewardEgress

ITEMS = [
    RewardItem(prompt="2 + 2 =", completion=" 4", answer="4"),
    RewardItem(prompt="say yes:", completion=" no", answer="yes"),
]


GIB = 1 << 30
CAP = 64 * 1024  # the answer cap the size tests set


class _Handler(BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []
    sent: ClassVar[Counter[str]] = Counter()  # body bytes a path got out before it was cut

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.received.append(body)
        items = body["items"]
        answers = {
            "/score": {"scores": [float(it["completion"].strip() == it["answer"]) for it in items]},
            "/nan": {"scores": [math.nan] * len(items)},
            "/text": {"scores": ["high"] * len(items)},
            "/bool": {"scores": [True] * len(items)},
            "/short": {"scores": [1.0]},
            "/noscores": {"result": 1},
        }
        if self.path == "/redirect":
            self.send_response(307)
            self.send_header("Location", "/score")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/boom":
            self._send(500, b'{"detail": "reward code raised KeyError"}')
        elif self.path == "/notjson":
            self._send(200, b"<html>oops</html>")
        elif self.path == "/slow":
            time.sleep(1.0)
            self._send(200, json.dumps({"scores": [0.0] * len(items)}).encode())
        elif self.path in ("/trickle", "/trickle-head", "/hang"):
            self._trickle()
        elif self.path in ("/gib-length", "/gib-chunked"):
            self._flood(chunked=self.path == "/gib-chunked")
        elif self.path == "/deep":
            self._send(200, b"[" * 200_000)
        else:
            self._send(200, json.dumps(answers[self.path]).encode())

    def _trickle(self) -> None:
        """One byte every 50 ms for 5 s at most: of the head too (/trickle-head), of the
        body only (/trickle), or nothing at all after the head (/hang)."""
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
        out = head if self.path == "/trickle-head" else b" " * 100
        if self.path != "/trickle-head":
            self.wfile.write(head)
        if self.path == "/hang":
            out = b""
            time.sleep(5)
        try:
            for i in range(len(out)):
                self.wfile.write(out[i : i + 1])
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:  # the client gave up: what the test wants
            pass

    def _flood(self, chunked: bool) -> None:
        """Announce (or stream chunked) a GiB; count what gets out before the client cuts."""
        self.send_response(200)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(GIB))
        self.end_headers()
        block = b"1" * 65536
        frame = b"%x\r\n%b\r\n" % (len(block), block) if chunked else block
        try:
            while _Handler.sent[self.path] < GIB:
                self.wfile.write(frame)
                _Handler.sent[self.path] += len(block)
        except OSError:
            pass

    def _send(self, status: int, payload: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except BrokenPipeError:  # the client timed out first (the /slow case)
            pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_http_reward_scores_a_batch_in_one_request(server: str) -> None:
    _Handler.received.clear()
    reward = HttpReward(f"{server}/score", timeout=5)
    assert reward.score(ITEMS) == [1.0, 0.0]
    assert len(_Handler.received) == 1
    assert _Handler.received[0] == {
        "items": [
            {"prompt": "2 + 2 =", "completion": " 4", "answer": "4"},
            {"prompt": "say yes:", "completion": " no", "answer": "yes"},
        ]
    }
    assert reward.score([]) == []
    reward.close()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/boom", r"answered HTTP 500$"),  # the body is not copied
        ("/redirect", r"answered HTTP 307$"),  # not followed
        ("/nan", "score 0 is not finite"),
        ("/text", r"score 0 is not a number \(a str\)$"),  # the value is not copied
        ("/bool", r"score 0 is not a number \(a bool\)$"),
        ("/short", "1 scores for 2 items"),
        ("/noscores", "no 'scores' list"),
        ("/notjson", "invalid JSON"),
    ],
)
def test_http_reward_failures_raise_reward_error(server: str, path: str, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        HttpReward(f"{server}{path}", timeout=5).score(ITEMS)


def test_http_reward_error_texts_carry_nothing_of_the_answer(server: str) -> None:
    _Handler.received.clear()
    for path in ("/boom", "/text", "/redirect"):
        with pytest.raises(RewardError) as info:
            HttpReward(f"{server}{path}", timeout=5).score(ITEMS)
        assert not {"KeyError", "high", "Location", "/score"} & set(str(info.value).split())
    assert len(_Handler.received) == 3  # the redirect's target was never asked


def _table(answers: dict[str, list[str]]) -> Resolver:
    """A resolver from a fixed table (a DNS server that changes its answer is what the
    test needs; no real one can be told to)."""
    return lambda host, port: list(answers[host])


def test_http_reward_connects_to_the_address_it_checked(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    answers = {"rewards.test": ["127.0.0.1"]}
    egress = RewardEgress.build(["rewards.test"], resolver=_table(answers))
    _Handler.received.clear()
    reward = HttpReward(f"http://rewards.test:{port}/score", timeout=5, egress=egress)
    assert reward.score(ITEMS) == [1.0, 0.0]  # reached by address: no real DNS asked
    assert len(_Handler.received) == 1


def test_http_reward_rechecks_the_address_on_every_request(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    answers = {"rewards.test": ["8.8.8.8"]}
    egress = RewardEgress.build(resolver=_table(answers))
    reward = HttpReward(f"http://rewards.test:{port}/score", timeout=5, egress=egress)
    answers["rewards.test"] = ["169.254.169.254"]  # DNS rebinding after admission
    _Handler.received.clear()
    with pytest.raises(RewardError, match="link-local or metadata address"):
        reward.score(ITEMS)
    answers["rewards.test"] = ["127.0.0.1"]
    with pytest.raises(RewardError, match="loopback"):
        reward.score(ITEMS)
    assert _Handler.received == []


def test_http_reward_timeout_and_unreachable(server: str) -> None:
    with pytest.raises(RewardError, match=r"within its deadline of 0\.2s"):
        HttpReward(f"{server}/slow", timeout=0.2).score(ITEMS)
    with pytest.raises(RewardError, match="unreachable"):
        HttpReward("http://127.0.0.1:9/score", timeout=1).score(ITEMS)


@pytest.mark.parametrize("path", ["/trickle", "/trickle-head"])
def test_a_trickling_answer_fails_at_the_deadline_of_the_whole_exchange(
    server: str, path: str
) -> None:
    # A byte every 50 ms never trips a 0.5 s per-read timeout; the answer takes 5 s.
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"did not answer in full within its deadline of 0\.5s"):
        HttpReward(f"{server}{path}", timeout=0.5).score(ITEMS)
    assert 0.45 < time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("path", ["/gib-length", "/gib-chunked"])
def test_an_answer_over_the_cap_is_refused_before_it_is_read(server: str, path: str) -> None:
    _Handler.sent[path] = 0
    with pytest.raises(RewardError, match=f"answered more than the limit of {CAP} bytes"):
        HttpReward(f"{server}{path}", timeout=20, max_bytes=CAP).score(ITEMS)
    # The server stops once the connection is dropped: what it got out is the cap plus
    # what loopback's socket buffers hold (a few MiB), not the GiB it announced.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        before = _Handler.sent[path]
        time.sleep(0.2)
        if _Handler.sent[path] == before:
            break
    assert _Handler.sent[path] < 64 * 1024 * 1024, _Handler.sent[path]


def test_an_answer_nested_too_deep_is_invalid_json_not_a_crash(server: str) -> None:
    with pytest.raises(RewardError, match="invalid JSON"):
        HttpReward(f"{server}/deep", timeout=5).score(ITEMS)


def test_close_ends_a_call_blocked_on_the_service(server: str) -> None:
    reward = HttpReward(f"{server}/hang", timeout=30)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            reward.score(ITEMS)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)  # the request is out; the service sends its head, then nothing
    t0 = time.monotonic()
    reward.close()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - t0 < 1.0
    assert len(errors) == 1 and "was closed" in str(errors[0]), errors
    with pytest.raises(RewardError, match="was closed"):
        reward.score(ITEMS)  # and nothing is sent once closed


def test_builtin_scores() -> None:
    assert exact_match(" 42 ", "42") == 1.0 and exact_match("42 43", "42") == 0.0
    assert contains("the answer is 42.", "42") == 1.0 and contains("4 2", "42") == 0.0
    assert prefix_overlap(" abd", "abc") == pytest.approx(2 / 3)
    assert prefix_overlap(" xbc", "abc") == pytest.approx(2 / 3)  # in place, not prefix-only
    assert prefix_overlap("", "abc") == 0.0
    assert word_fraction(" yes no yes yes", "yes") == 0.75 and word_fraction("", "yes") == 0.0
    assert coverage(" yes yes", "yes") == 1.0
    assert coverage(" yesxyz", "yes") == 0.5 and coverage("   ", "yes") == 0.0


def test_builtin_reward_rejects_non_finite_scores() -> None:
    bad = BuiltinReward("bad", lambda c, a: math.inf)
    with pytest.raises(RewardError, match="reward bad: score 0 is not finite"):
        bad.score(ITEMS)


def test_make_reward() -> None:
    assert make_reward("contains").score(ITEMS) == [1.0, 0.0]
    assert isinstance(make_reward("http", "http://x/score"), HttpReward)
    assert set(BUILTIN_REWARDS) >= {"exact-match", "contains", "prefix-overlap"}
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        make_reward("nope")
    with pytest.raises(ValueError, match="needs a rewardUrl"):
        make_reward("http")
