"""Issue 15, attacks 4-6, on a real `loraplex-engine serve` process: a tenant with only the
fields of its own experiment tries to read another tenant's data, to reach local
addresses through its reward URL, and to act on another tenant's checkpoints. Each
attack is refused, and a co-tenant (team-b.good) keeps training throughout: its step
count is read before and must have risen after, with no error.

The engine runs as the pool admin would configure it for these tests: one data root with
a directory per namespace, and 127.0.0.1 allowed as a reward host (the tests' reward
server listens there), so the loopback refusals below are about the engine's own port
and the names and addresses not on that list.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from loraplex_engine.store.run_store import step_dirs

from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec

pytestmark = pytest.mark.slow

CO_TENANT = "team-b.good"
CO_RUN = "run-b"
B_SECRET_PROMPT = "B-PRIVATE-PROMPT-7f3a"
SECRET = "SECRET-INTERNAL-TOKEN-91c2"


class _Rewards(BaseHTTPRequestHandler):
    """A reward server on 127.0.0.1 that records what it is sent."""

    received: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Rewards.received.append((self.path, body))
        if self.path == "/secret":  # an internal endpoint: its body must not leak
            self._send(500, json.dumps({"detail": SECRET}).encode())
        elif self.path == "/redirect":
            self._send(307, b"", {"Location": "/score"})
        else:
            self._send(200, json.dumps({"scores": [0.5] * len(body["items"])}).encode())

    def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(scope="module")
def reward_port() -> Iterator[int]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Rewards)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _spec(target: str = "yes", checkpoint: dict[str, int] | None = None) -> dict[str, Any]:
    spec = small_spec(target)
    spec["checkpoint"] = checkpoint or spec["checkpoint"]
    return spec


def _rows(prompt: str) -> str:
    return "".join(
        json.dumps({"prompt": f"{prompt} {i}", "answer": "yes"}) + "\n" for i in range(4)
    )


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "team-a").mkdir()
    (root / "team-b").mkdir()
    (root / "team-a" / "own.jsonl").write_text(_rows("A's own prompt"))
    (root / "team-b" / "private.jsonl").write_text(_rows(B_SECRET_PROMPT))
    (root / "team-b" / "broken.jsonl").write_text("this is not JSON\n")
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, data_root: Path):
    work = tmp_path_factory.mktemp("tenants")
    trust = ["--data-root", str(data_root), "--allow-reward-host", "127.0.0.1"]
    srv = EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=3, workdir=work, extra_args=trust
    )
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def api(server: EngineServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        # Checkpoints every 5 steps, none pruned during the module: an attack that prunes
        # or overwrites one shows.
        spec = _spec("sum", {"everySteps": 5, "keep": 1000})
        r = c.put(f"/v1/experiments/{CO_TENANT}", json=put_body(CO_TENANT, spec, run_id=CO_RUN))
        assert r.status_code == 201, r.text
        wait_until(lambda: _status(c, CO_TENANT)["checkpoint"] is not None)
        yield c


def _status(api: httpx.Client, exp_id: str) -> dict[str, Any]:
    r = api.get(f"/v1/experiments/{exp_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _loaded(api: httpx.Client) -> set[str]:
    return {s["id"] for s in api.get("/v1/experiments").json()["experiments"]}


@contextmanager
def co_tenant_trains(api: httpx.Client) -> Iterator[None]:
    """The co-tenant's step count rises across the block, and it has no error."""
    before = _status(api, CO_TENANT)["step"]
    yield
    wait_until(lambda: _status(api, CO_TENANT)["step"] >= before + 3, timeout=60)
    after = _status(api, CO_TENANT)
    assert after["phase"] == "Running" and after["error"] is None


def _refused(api: httpx.Client, exp_id: str, body: dict[str, Any], url_id: str | None = None):
    r = api.put(f"/v1/experiments/{url_id or exp_id}", json=body)
    assert r.status_code == 422, r.text
    assert exp_id not in _loaded(api)
    return r.json()["error"]


def _jsonl(dataset: str, reward_url: str) -> dict[str, Any]:
    spec = small_spec()
    spec["task"] = {"name": "jsonl", "dataset": dataset, "reward": "http", "rewardUrl": reward_url}
    return spec


# --- attack 4: reading another tenant's data ------------------------------------------


def test_a_tenant_cannot_train_on_another_tenants_data(
    api: httpx.Client, data_root: Path, reward_port: int
) -> None:
    score = f"http://127.0.0.1:{reward_port}/score"
    b_dir = data_root / "team-b"
    link = data_root / "team-a" / "link.jsonl"
    link.symlink_to(b_dir / "private.jsonl")
    _Rewards.received.clear()
    with co_tenant_trains(api):
        texts = {}
        for name in ("private.jsonl", "nope.jsonl", "broken.jsonl"):
            e = _refused(
                api, "team-a.reader", put_body("team-a.reader", _jsonl(str(b_dir / name), score))
            )
            assert e["field"] == "spec.task.dataset" and "not allowed" in e["message"]
            texts[name] = e["message"].replace(name, "NAME")
        # Existing, missing and invalid files of B answer alike: no oracle.
        assert len(set(texts.values())) == 1, texts
        for sneaky in ("../team-b/private.jsonl", "link.jsonl", "/etc/passwd"):
            e = _refused(api, "team-a.reader", put_body("team-a.reader", _jsonl(sneaky, score)))
            assert e["field"] == "spec.task.dataset" and "not allowed" in e["message"]
            assert "root:" not in e["message"]
    assert not any(B_SECRET_PROMPT in json.dumps(body) for _, body in _Rewards.received)

    # A's own file, by a relative name: it trains, and its reward server sees A's rows.
    r = api.put(
        "/v1/experiments/team-a.reader", json=put_body("team-a.reader", _jsonl("own.jsonl", score))
    )
    assert r.status_code == 201, r.text
    wait_until(lambda: any("A's own prompt" in json.dumps(b) for _, b in _Rewards.received))
    assert not any(B_SECRET_PROMPT in json.dumps(body) for _, body in _Rewards.received)
    assert api.delete("/v1/experiments/team-a.reader").status_code == 200


# --- attack 5: SSRF through rewardUrl ------------------------------------------------


def _http_reward(url: str) -> dict[str, Any]:
    spec = small_spec()
    spec["task"] = {
        "name": "target-token",
        "params": {"target": "yes"},
        "reward": "http",
        "rewardUrl": url,
    }
    return spec


def test_reward_urls_to_local_addresses_are_refused(
    server: EngineServer, api: httpx.Client, reward_port: int
) -> None:
    engine_port = server.url.rsplit(":", 1)[1]
    attacks = {
        f"http://127.0.0.1:{engine_port}/v1/experiments": "own port",
        "http://169.254.169.254/latest/meta-data/": "metadata",
        f"http://localhost:{reward_port}/score": "loopback",
        f"http://[::1]:{reward_port}/score": "loopback",
        f"http://0.0.0.0:{engine_port}/metrics": "own port",
    }
    with co_tenant_trains(api):
        for url, why in attacks.items():
            e = _refused(api, "team-a.ssrf", put_body("team-a.ssrf", _http_reward(url)))
            assert e["field"] == "spec.task.rewardUrl" and why in e["message"], (url, e)


@pytest.mark.parametrize(("path", "status"), [("/secret", 500), ("/redirect", 307)])
def test_a_reward_servers_answer_reaches_status_only_as_its_status_code(
    api: httpx.Client, reward_port: int, path: str, status: int
) -> None:
    _Rewards.received.clear()
    url = f"http://127.0.0.1:{reward_port}{path}"
    with co_tenant_trains(api):
        r = api.put(
            "/v1/experiments/team-a.probe", json=put_body("team-a.probe", _http_reward(url))
        )
        assert r.status_code == 201, r.text
        failed = wait_until(lambda: (s := _status(api, "team-a.probe"))["phase"] == "Failed" and s)
    assert failed["error"].endswith(f"answered HTTP {status}"), failed["error"]
    assert SECRET not in json.dumps(failed) and "Location" not in failed["error"]
    assert {p for p, _ in _Rewards.received} == {path}  # the redirect was not followed
    assert api.delete("/v1/experiments/team-a.probe").status_code == 200


# --- attack 6: cross-tenant control -------------------------------------------------


def _b_checkpoints(server: EngineServer) -> set[str]:
    """The co-tenant's finished checkpoints (not one it is writing: that one is renamed)."""
    return {p.name for p in step_dirs(server.checkpoint_root / "team-b" / "good" / CO_RUN)}


def test_an_id_that_is_not_the_bodys_namespace_and_name_is_refused(
    server: EngineServer, api: httpx.Client
) -> None:
    before = _b_checkpoints(server)
    assert before
    body = put_body("team-b.good", _spec(checkpoint={"everySteps": 1, "keep": 1}), run_id=CO_RUN)
    with co_tenant_trains(api):
        e = _refused(api, "team-a.x", body, url_id="team-a.x")
        assert e["field"] == "name" and "team-b.good" in e["message"]
    assert before <= _b_checkpoints(server)  # none pruned or replaced
    assert _status(api, CO_TENANT)["runId"] == CO_RUN


def test_resume_from_another_tenants_checkpoint_is_refused(
    server: EngineServer, api: httpx.Client
) -> None:
    b_newest = _status(api, CO_TENANT)["checkpoint"]["path"]
    own = server.checkpoint_root / "team-a" / "thief" / "r"
    own.mkdir(parents=True)
    (own / "step-00000001").symlink_to(b_newest)
    with co_tenant_trains(api):
        for resume in (
            b_newest,
            str(own / "step-00000001"),
            str(own / ".." / ".." / ".." / "team-b"),
        ):
            body = put_body("team-a.thief", small_spec("sum"), resume_from=resume)
            e = _refused(api, "team-a.thief", body)
            assert e["field"] == "resumeFrom" and "not allowed" in e["message"], e
