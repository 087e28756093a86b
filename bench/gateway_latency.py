"""What loraplex-gateway adds to a request: latency (p50/p99) one request at a time, and
requests/s and latency at 100 concurrent streams, the same requests sent straight to the
upstream vs through the gateway, on loopback (issue 29). A benchmark, not a test.

    .venv/bin/python bench/gateway_latency.py [--concurrency 1,100] [--requests 400]
        [--serial-requests 200] [--rounds 2] [--max-tokens 4]
        [--out bench/results/gateway-latency.json]

Processes, each its own (so each one's CPU time is read apart, from /proc via psutil):
the bench's client (httpx.AsyncClient, one pooled client per cell, HTTP/1.1 keep-alive,
as many connections as concurrent streams), a real ``python -m loraplex_operator.gateway``
(tests/support/gateway_process.py, ``--engines-file``: the view KubeDirectory builds in a
cluster), and an upstream:

- ``engine``: a real ``loraplex-engine serve`` (tests/support/server_process.py: tiny
  model, torch rollout, 1 thread) serving one adapter, ``bench.adapter``, that trained
  one step (maxSteps 1) and then stays loaded, so the engine does nothing but serve;
- ``trivial``: this file's ``--serve-trivial`` (starlette + uvicorn, as the engine's API
  runs), which answers ``/v1/models/<id>`` and the completions routes at once with a
  fixed completion or ``--max-tokens`` stream events of the engine's shape. It isolates
  the gateway's own cost where the engine itself is the bottleneck (it is, at 100
  streams: one serving tick decodes a batch at a time).

Arms: ``direct`` (the upstream's URL, its admin token, the model's full id) and
``gateway`` (the gateway's URL, a tenant key, the model's short name: the gateway resolves
it within the key's namespace, finds the engine, which it caches, and forwards the body
with the full id). Modes: ``/v1/completions`` and ``/v1/chat/completions``, each whole
and streamed (time to first token = to the first byte of the answer's body). Each cell
(upstream, mode, concurrency, arm) warms with ``concurrency`` requests, then sends
``--requests`` (``--serial-requests`` at concurrency 1) and records every latency; the
arms alternate cell by cell, ``--rounds`` times, so the shared machine's load drifts
alike over both. Reported per cell: p50/p99 latency and TTFT over every round's requests,
requests/s (median of rounds), errors, and CPU seconds per request of the gateway, the
upstream and the client. Added latency = gateway − direct of the same percentile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers, as tests.support

NAMESPACE = "bench"
ADAPTER = f"{NAMESPACE}.adapter"
KEY = "tml-bench-gateway-0123456789"
PROMPT = "the quick brown fox"
MODES = ("completions", "completions-stream", "chat", "chat-stream")


# --- the trivial upstream ---------------------------------------------------------------


def trivial_app(max_tokens: int) -> Any:
    """An upstream that answers at once, in the engine's shapes."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def model(request: Request) -> Response:
        return JSONResponse({"id": request.path_params["id"], "object": "model"})

    async def complete(request: Request) -> Response:
        doc = json.loads(await request.body())
        chat = request.url.path.endswith("chat/completions")
        if not doc.get("stream"):
            text = "x" * max_tokens
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            choice |= (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            usage = {"prompt_tokens": 4, "completion_tokens": max_tokens}
            obj = "chat.completion" if chat else "text_completion"
            body = {"id": "cmpl-1", "object": obj, "created": 0, "model": doc["model"]}
            return JSONResponse(body | {"choices": [choice], "usage": usage})

        async def events() -> Any:
            for i in range(max_tokens):
                delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
                choice = {"index": 0, "finish_reason": "length" if i == max_tokens - 1 else None}
                chunk = {"id": "cmpl-1", "object": "chunk", "model": doc["model"]}
                yield f"data: {json.dumps(chunk | {'choices': [choice | delta]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models/{id:path}", model),
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/v1/chat/completions", complete, methods=["POST"]),
        ]
    )


def serve_trivial(max_tokens: int) -> None:
    import socket

    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    print(f"trivial upstream listening: url=http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(trivial_app(max_tokens), log_level="warning", access_log=False)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


class Trivial:
    """``--serve-trivial`` as a child process; ``token`` is any bearer (it checks none)."""

    token = "trivial"

    def __init__(self, max_tokens: int) -> None:
        from tests.support import child_processes

        cmd = [sys.executable, __file__, "--serve-trivial", "--max-tokens", str(max_tokens)]
        self.proc = child_processes.spawn(
            cmd, "trivial upstream", stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        self.url = line.rsplit("url=", 1)[1].strip()
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# --- the load ---------------------------------------------------------------------------


def request_for(mode: str, model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    stream = mode.endswith("-stream")
    if mode.startswith("chat"):
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
        path = "/v1/chat/completions"
    else:
        body, path = {"model": model, "prompt": PROMPT}, "/v1/completions"
    return path, body | {"max_tokens": max_tokens, "temperature": 0, "stream": stream}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


Result = tuple[float, float | None, int]  # latency, time to first byte (streams), status


async def one(client: httpx.AsyncClient, path: str, body: bytes, stream: bool) -> Result:
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(path, content=body)
        return time.perf_counter() - t0, None, r.status_code
    first = None
    async with client.stream("POST", path, content=body) as r:
        async for chunk in r.aiter_raw():
            if first is None and chunk:
                first = time.perf_counter() - t0
        seen = r.status_code
    return time.perf_counter() - t0, first, seen


async def run_cell(
    url: str, token: str, path: str, body: dict[str, Any], concurrency: int, n: int
) -> dict[str, Any]:
    payload = json.dumps(body).encode()
    stream = bool(body["stream"])
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=300) as c:
        await asyncio.gather(*(one(c, path, payload, stream) for _ in range(concurrency)))
        todo = iter(range(n))
        results: list[Result] = []

        async def worker() -> None:
            for _ in todo:
                try:
                    results.append(await one(c, path, payload, stream))
                except httpx.HTTPError:
                    results.append((0.0, None, 0))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    ok = [r for r in results if r[2] == 200]
    return {
        "latencies": [r[0] for r in ok],
        "ttfts": [r[1] for r in ok if r[1] is not None],
        "errors": len(results) - len(ok),
        "codes": sorted({r[2] for r in results}),
        "seconds": elapsed,
        "rps": len(ok) / elapsed,
    }


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


# --- the setup ---------------------------------------------------------------------------


def start_engine(workdir: Path) -> Any:
    from tests.support.server_process import EngineServer
    from tests.support.server_specs import put_body, small_spec
    from tests.support.tiny_models import tiny_model

    srv = EngineServer(tiny_model(), workdir / "ckpt", max_adapters=2, workdir=workdir)
    srv.start()
    with srv.client() as api:
        r = api.put(f"/v1/experiments/{ADAPTER}", json=put_body(ADAPTER, small_spec(max_steps=1)))
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 120
        while True:  # trained its step: the engine now only serves
            state = api.get(f"/v1/experiments/{ADAPTER}").json()
            if state.get("phase") in ("Succeeded", "Completed") or state.get("step", 0) >= 1:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.5)
        assert api.get(f"/v1/models/{ADAPTER}").status_code == 200, "the adapter is not served"
    srv.pid = srv.proc.pid
    return srv


def start_gateway(workdir: Path, upstream: Any) -> Any:
    from tests.support.gateway_process import GatewayProcess

    engine = {"name": "e0", "pool": "bench", "url": upstream.url, "token": upstream.token}
    view = {"engines": [engine], "keys": [{"namespace": NAMESPACE, "key": KEY, "role": "sample"}]}
    gw = GatewayProcess(workdir, view, "--log-level", "warning").start()
    gw.pid = gw.proc.pid
    return gw


def new_cell() -> dict[str, Any]:
    cpu = {"gateway": 0.0, "upstream": 0.0, "client": 0.0}
    return {"latencies": [], "ttfts": [], "rps": [], "errors": 0, "requests": 0, "cpu_s": cpu}


async def measure(
    upstream_name: str, upstream: Any, gw: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    arms = {
        "direct": (upstream.url, upstream.token, ADAPTER),
        "gateway": (gw.url, KEY, ADAPTER.split(".", 1)[1]),
    }
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    pids = {"gateway": gw.pid, "upstream": upstream.pid, "client": os.getpid()}
    for rnd in range(args.rounds):
        for mode in MODES:
            for conc in args.concurrency:
                n = args.serial_requests if conc == 1 else args.requests
                for arm, (url, token, model) in arms.items():
                    path, body = request_for(mode, model, args.max_tokens)
                    before = {k: cpu_s(pid) for k, pid in pids.items()}
                    got = await run_cell(url, token, path, body, conc, n)
                    cpu = {k: cpu_s(pid) - before[k] for k, pid in pids.items()}
                    cell = cells.setdefault((mode, conc, arm), new_cell())
                    cell["latencies"] += got["latencies"]
                    cell["ttfts"] += got["ttfts"]
                    cell["rps"].append(got["rps"])
                    cell["errors"] += got["errors"]
                    cell["requests"] += n
                    for k, v in cpu.items():
                        cell["cpu_s"][k] += v
                    print(
                        f"{upstream_name} round {rnd} {mode:18s} c={conc:3d} {arm:7s} "
                        f"{got['rps']:7.1f} req/s p50 {1000 * pct(got['latencies'], 0.5):7.2f} ms "
                        f"p99 {1000 * pct(got['latencies'], 0.99):7.2f} ms errors {got['errors']} "
                        f"gateway cpu {cpu['gateway']:.2f}s load {os.getloadavg()[0]:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
    return summarize(upstream_name, cells, args.concurrency)


def ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 3)


def summarize(
    upstream: str, cells: dict[tuple[str, int, str], dict[str, Any]], concurrency: list[int]
) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        for conc in concurrency:
            row: dict[str, Any] = {"upstream": upstream, "mode": mode, "concurrency": conc}
            for arm in ("direct", "gateway"):
                c = cells[(mode, conc, arm)]
                per_request = {k: 1000 * v / max(1, c["requests"]) for k, v in c["cpu_s"].items()}
                row[arm] = {
                    "requests": c["requests"],
                    "errors": c["errors"],
                    "rps_median": round(statistics.median(c["rps"]), 1),
                    "rps_rounds": [round(r, 1) for r in c["rps"]],
                    "p50_ms": ms(pct(c["latencies"], 0.5)),
                    "p99_ms": ms(pct(c["latencies"], 0.99)),
                    "ttft_p50_ms": ms(pct(c["ttfts"], 0.5)),
                    "ttft_p99_ms": ms(pct(c["ttfts"], 0.99)),
                    "cpu_ms_per_request": {k: round(v, 3) for k, v in per_request.items()},
                }
            d, g = row["direct"], row["gateway"]
            row["added_ms"] = {
                k: round(g[k] - d[k], 3)
                for k in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms")
                if g[k] is not None and d[k] is not None
            }
            row["rps_ratio"] = round(g["rps_median"] / d["rps_median"], 3)
            rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-trivial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--upstreams", default="trivial,engine")
    p.add_argument("--concurrency", default="1,100")
    p.add_argument("--requests", type=int, default=400, help="per cell and round, concurrent")
    p.add_argument("--serial-requests", type=int, default=200, help="per cell and round, c=1")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gateway-latency.json"))
    args = p.parse_args()
    if args.serve_trivial:
        serve_trivial(args.max_tokens)
        return 0
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    load_before = os.getloadavg()
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        for name in args.upstreams.split(","):
            work = Path(tmp) / name
            work.mkdir()
            upstream = start_engine(work) if name == "engine" else Trivial(args.max_tokens)
            gw = start_gateway(work, upstream)
            try:
                rows += asyncio.run(measure(name, upstream, gw, args))
            finally:
                gw.stop()
                upstream.stop()
    out = {
        "label": args.label,
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)),
        "wall_s": round(time.time() - t0, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_before": [round(v, 2) for v in load_before],
            "load_avg_after": [round(v, 2) for v in os.getloadavg()],
            "shared": "a shared 2-core machine with other jobs running",
        },
        "params": {k: v for k, v in vars(args).items() if k not in ("serve_trivial", "out")},
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        d, g = r["direct"], r["gateway"]
        print(
            f"{r['upstream']:8s} {r['mode']:18s} c={r['concurrency']:3d} "
            f"direct {d['rps_median']:7.1f}/s p50 {d['p50_ms']} p99 {d['p99_ms']} | "
            f"gateway {g['rps_median']:7.1f}/s p50 {g['p50_ms']} p99 {g['p99_ms']} | "
            f"added {r['added_ms']} gw cpu/req {g['cpu_ms_per_request']['gateway']} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
