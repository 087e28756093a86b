"""loraplex-gateway in test_prometheus_live.py: a real gateway process in front of the
harness's engines, scraped as the chart's gateway ServiceMonitor says, with tenants'
traffic through it.

The gateway reads its view from ``--engines-file`` (tests/support/gateway_process.py): the
engine pods of the pool (their URLs, the pool's token) and one key per namespace, the
view KubeDirectory builds from the cluster (its API calls are tests/chart/
test_gateway_rbac.py's). Its `/metrics` is scraped through file-based discovery with the
metadata the gateway Service's endpoints give in a cluster, so `job` comes from the
ServiceMonitor's relabelling and `namespace` from the gateway (honorLabels).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path
from typing import Any

import httpx

from tests.support.chart_helpers import component
from tests.support.gateway_process import GatewayProcess
from tests.support.prometheus_process import (
    endpoint_targets,
    service_monitor_scrape_config,
    write_sd_file,
)

KEYS = {"team-a": "tml-live-team-a-0123456789", "team-b": "tml-live-team-b-0123456789"}


class LiveGateway:
    """The gateway process, its scrape config and its view of the pool's engines."""

    def __init__(self, workdir: Path, docs: list[dict[str, Any]]) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        [self.monitor] = component(docs, "ServiceMonitor", "gateway")
        selector = self.monitor["spec"]["selector"]["matchLabels"]
        services = [
            d
            for d in docs
            if d["kind"] == "Service"
            and selector.items() <= (d["metadata"].get("labels") or {}).items()
        ]
        assert len(services) == 1, "the gateway ServiceMonitor selects no (or several) Services"
        self.service = services[0]
        [self.deployment] = component(docs, "Deployment", "gateway")
        self.sd = workdir / "gateway-sd.json"
        write_sd_file(self.sd, [])
        self.keys = [{"namespace": ns, "key": k, "role": "train"} for ns, k in KEYS.items()]
        self.process = GatewayProcess(workdir, {"engines": [], "keys": self.keys})

    def scrape_config(self, interval: str) -> dict[str, Any]:
        return service_monitor_scrape_config(self.monitor, self.sd, interval)

    def start(self) -> None:
        self.process.start()
        port = self.process.url.rsplit(":", 1)[1]
        container = self.deployment["spec"]["template"]["spec"]["containers"][0]["name"]
        pod = f"{self.deployment['metadata']['name']}-5f7d8c9b6-k4v2m"
        write_sd_file(self.sd, endpoint_targets(self.service, pod, container, f"127.0.0.1:{port}"))

    def stop(self) -> None:
        self.process.stop()

    def set_engines(self, pool: str, engines: list[tuple[str, str]], token: str) -> None:
        """(pod name, URL) of the pool's running engines, called with the pool's token."""
        view = [{"name": n, "pool": pool, "url": u, "token": token} for n, u in engines]
        self.process.write({"engines": view, "keys": self.keys})


async def serve_through(gateway: LiveGateway, models: dict[str, str], sent: dict[str, int]) -> None:
    """Tenants' completions through the gateway, as OpenAI clients send them: each
    namespace's experiment by its short name with that namespace's key, every other one
    streamed; now and then a model that does not exist (404) and an unknown key (401).
    ``models``: namespace → the experiment's name; ``sent`` counts answers by status."""
    url = gateway.process.url
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for i in itertools.count():
            for ns, name in models.items():
                targets = [name] + (["no-such-model"] if i % 5 == 0 else [])
                for model in targets:
                    body = {"model": model, "prompt": "a b", "max_tokens": 2}
                    body["stream"] = i % 2 == 1
                    with contextlib.suppress(httpx.HTTPError):
                        r = await client.post(
                            "/v1/completions",
                            json=body,
                            headers={"Authorization": f"Bearer {KEYS[ns]}"},
                        )
                        sent[str(r.status_code)] = sent.get(str(r.status_code), 0) + 1
            if i % 5 == 0:
                with contextlib.suppress(httpx.HTTPError):
                    r = await client.get("/v1/models", headers={"X-API-Key": "tml-nobody-000000"})
                    sent[str(r.status_code)] = sent.get(str(r.status_code), 0) + 1
            await asyncio.sleep(0.5)
