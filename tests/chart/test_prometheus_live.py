"""Every dashboard panel shows data from a real Prometheus scraping a real engine and the
real operator while experiments train.

- The operator harness (tests/support/harness.py): kmock as the API server, a kubelet
  that runs each engine Pod the operator writes (a real `loraplex-engine serve`, tiny
  model), and the operator container as the chart renders it, with its metrics port.
- A real Prometheus (`.tools/bin/prometheus`, 127.0.0.1, scrape interval 1 s) whose
  scrape configs are translated from the chart's rendered PodMonitor (engines) and
  ServiceMonitor (operator) as the Prometheus Operator does (prometheus_process.py); the
  engine Pods the operator creates are fed to it through file-based discovery with the
  metadata Kubernetes discovery gives them. So `job`, `pool`, `pod` and `namespace` are
  the labels a cluster would have, and a PodMonitor selector that stopped matching the
  operator's engine Pods would leave the engine target out.
- One pool, experiments in two namespaces, and one more whose HTTP reward answers 500,
  so the engine fails it in its first tick: the failure panels, the failed-experiments
  table and the failure alerts see a real failure rather than being excused. Once
  Prometheus holds enough steps and checkpoints of each, the failure and its unload,
  every panel query (and every query variable) of every dashboard is evaluated through
  `/api/v1/query` with Grafana's variables set to values that exist (read from the
  variables' own queries) and must return data that is not NaN. At the end the failed
  experiment is deleted and its per-experiment operator series must go.
- Serving traffic throughout: completions for each experiment and the base model, some
  streamed, and one for a model that does not exist, so the Serving row's latency
  quantiles, errors and queue depth read real requests.
- loraplex-gateway (a real process, live_gateway.py) in front of the pool's engines,
  scraped as the chart's gateway ServiceMonitor says, with each namespace's completions
  through it (some streamed, some for a model that does not exist, some with an unknown
  key), so the Gateway row reads real requests per namespace.

`$__rate_interval`, `$__interval` and `$__range` are set to the span of the run, at least
30 s (as for a dashboard zoomed onto the run): the scheduling latency histogram only
moves when an experiment is placed, at the start, and a narrower window would make its
quantile NaN ("no data" in Grafana) through no fault of the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart_helpers import (
    ALL_ON,
    DASHBOARDS,
    METRICS_DOC,
    RULES_FILE,
    one,
    operator_deployment,
    render,
    tool,
)
from tests.support.harness import Harness
from tests.support.live_gateway import LiveGateway, serve_through
from tests.support.prometheus_process import (
    PrometheusServer,
    QueryError,
    endpoint_targets,
    pod_monitor_scrape_config,
    pod_targets,
    service_monitor_scrape_config,
    write_sd_file,
)
from tests.support.promql_names import (
    dashboard_queries,
    documented_metrics,
    exported_series_names,
    rule_exprs,
)

pytestmark = pytest.mark.slow

POOL = "pool-live"
# (namespace, name): two namespaces, so `namespace` must be the experiment's, not the pod's.
EXPERIMENTS = [("team-a", "live-a"), ("team-b", "live-b")]
# Fails in its first tick (its reward service answers 500); stays Failed until deleted.
FAILING = ("team-a", "live-fail")
FAILING_ID = f"{FAILING[0]}.{FAILING[1]}"
MIN_STEPS = 25  # per experiment, seen by Prometheus, before the panels are checked
MIN_CHECKPOINTS = 2
MIN_SAMPLES = 3  # scrapes of each experiment's series within the last 30 s
CHECKPOINT_EVERY = 5
MAX_STEPS = 100_000  # still training when the panels are checked; deleted at the end
# spec.eval on the training experiments: small (2 greedy prompts) and every 5 steps, so
# the eval series exist from the first step on (the eval at step 0 rides along step 1).
EVAL = {"everySteps": 5, "prompts": 2}
# Series this live engine does not export: the vLLM-only gap (it rolls out with torch),
# and the TIS weight (none of its experiments sets offPolicyCorrection: tis).
ABSENT_HERE = {
    "loraplex_engine_logprob_gap",
    "loraplex_engine_tis_weight_mean",
    "loraplex_pool_stalled",  # a series only while a pool is stalled; this one is healthy
    # a series only while a namespace holds samples recorded for stable_reinforce; no
    # client samples here (test_tinker_stable_reinforce.py reads it)
    "loraplex_engine_tinker_recorded_bytes",
    # per tracker the pool configures (docs/tracking.md); this pool configures none
    "loraplex_engine_tracking_records_total",
    "loraplex_engine_tracking_errors_total",
    "loraplex_engine_tracking_dropped_total",
    "loraplex_engine_tracking_up",
    "loraplex_engine_tracking_queued",
    # series only for experiments with published versions (a stable one); these have none
    "loraplex_experiment_stable_version",
    "loraplex_engine_latest_version",
}

# Queries allowed to return nothing, with the reason. Otherwise none: every counter that
# only moves on rare events (preemptions, recoveries, reconcile errors, experiment
# failures) is exported at 0 from the start, so its panel shows 0, not "no data", and the
# failed-experiments table has the FAILING experiment to show.
EXCUSED: dict[str, str] = {
    "loraplex-experiment: annotation 'Published versions'": "no experiment here publishes "
    "versions (spec.publish); tests/engine/versions/test_versions_engine.py covers the series",
}

# Alerts that must stay quiet on a healthy live system (label joins: pool, job, pod).
QUIET_ALERTS = (
    "LoraplexEngineDown",
    "LoraplexEnginesMissing",
    "LoraplexOperatorDown",
    "LoraplexRewardNaN",
    "LoraplexExperimentNoProgress",
    "LoraplexExperimentStuckPending",
    "LoraplexExperimentRestarting",
    "LoraplexCheckpointStorageFull",
    "LoraplexServingSlow",
    "LoraplexPoolStalled",
)
# Alerts the FAILING experiment must trigger, with the labels they must carry.
FAILURE_ALERTS = {
    "LoraplexExperimentFailures": {"reason": "reward_error"},
    "LoraplexFailedExperiments": {"pool": POOL},
}


class _Answers500(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def reward_url() -> Iterator[str]:
    """An HTTP reward service that answers every request with 500."""
    server = HTTPServer(("127.0.0.1", 0), _Answers500)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/score"
    finally:
        server.shutdown()
        server.server_close()


_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(?:[.:][^}]*)?\}|\$([A-Za-z_]\w*)|\[\[(\w+)\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*(\w+)\)\s*$", re.DOTALL)


def fill(query: str, variables: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in variables:
            raise KeyError(f"dashboard variable ${name} has no value (query: {query})")
        return variables[name]

    return _VAR.sub(sub, query)


class Scrapes:
    """The chart's monitors as Prometheus scrape configs + file_sd files to fill."""

    def __init__(self, workdir: Path) -> None:
        docs = render(ALL_ON)
        self.pod_monitor = one(docs, "PodMonitor")
        self.service_monitor = one(docs, "ServiceMonitor", "loraplex-operator")
        selector = self.service_monitor["spec"]["selector"]["matchLabels"]
        services = [
            d
            for d in docs
            if d["kind"] == "Service"
            and selector.items() <= (d["metadata"].get("labels") or {}).items()
        ]
        assert len(services) == 1, "the ServiceMonitor selects no (or several) Services"
        self.operator_service = services[0]
        self.operator_deployment = operator_deployment(docs)
        self.gateway = LiveGateway(workdir / "gateway", docs)
        self.engines_sd = workdir / "engines.json"
        self.engine_token_file = workdir / "engine-token"  # the PodMonitor's Secret
        self.engine_token_file.write_text("")
        self.operator_sd = workdir / "operator.json"
        write_sd_file(self.engines_sd, [])
        write_sd_file(self.operator_sd, [])

    def configs(self) -> list[dict[str, Any]]:
        return [
            pod_monitor_scrape_config(
                self.pod_monitor, self.engines_sd, "1s", self.engine_token_file
            ),
            service_monitor_scrape_config(self.service_monitor, self.operator_sd, "1s"),
            self.gateway.scrape_config("1s"),
        ]

    def set_operator(self, port: int) -> None:
        deployment = self.operator_deployment
        container = deployment["spec"]["template"]["spec"]["containers"][0]["name"]
        pod = f"{deployment['metadata']['name']}-7d9c5b6f4-x2x9q"
        write_sd_file(
            self.operator_sd,
            endpoint_targets(self.operator_service, pod, container, f"127.0.0.1:{port}"),
        )

    def set_engines(self, pods: list[dict[str, Any]], token: str) -> None:
        from loraplex_operator.manifests import engine_url

        groups, running = [], []
        for pod in pods:
            url = engine_url(pod)
            if url and (pod.get("status") or {}).get("phase") == "Running":
                groups += pod_targets(pod, url.removeprefix("http://"))
                running.append((pod["metadata"]["name"], url))
        self.engine_token_file.write_text(token)
        write_sd_file(self.engines_sd, groups)
        self.gateway.set_engines(POOL, running, token)


async def _poll(h: Harness, what: str, check: Any, timeout: float) -> Any:
    async def once() -> Any:
        return await asyncio.to_thread(check)

    return await h.wait_for(what, once, timeout=timeout, interval=0.5)


async def _pool_token(h: Harness) -> str:
    import base64

    from loraplex_operator.kube import SECRETS

    from tests.support.harness import ENGINE_NS, TOKEN_SECRET

    assert h.kube is not None
    secret = await h.kube.get(SECRETS, TOKEN_SECRET, ENGINE_NS)
    return base64.b64decode(secret["data"]["token"]).decode()


async def _feed_engines(h: Harness, scrapes: Scrapes) -> None:
    """The discovery loop: engine Pods of the pool → the engines' file_sd file, and the
    gateway's view."""
    token = await _pool_token(h)
    while True:
        with contextlib.suppress(Exception):
            scrapes.set_engines(await h.engine_pods(POOL), token)
        await asyncio.sleep(0.5)


async def _serve_traffic(h: Harness, sent: dict[str, int]) -> None:
    """Completions against every engine of the pool, as OpenAI clients would send them:
    each experiment and the base model (every other one streamed), and a model that does
    not exist (a 404). ``sent`` counts the answers by status."""
    import httpx
    from loraplex_operator.manifests import engine_url

    token = await _pool_token(h)
    models = [f"{ns}.{name}" for ns, name in EXPERIMENTS]
    async with httpx.AsyncClient(
        timeout=30, headers={"Authorization": f"Bearer {token}"}
    ) as client:
        for i in itertools.count():
            with contextlib.suppress(httpx.HTTPError, KeyError, IndexError):
                for pod in await h.engine_pods(POOL):
                    url = engine_url(pod)
                    if not url or (pod.get("status") or {}).get("phase") != "Running":
                        continue
                    listed = (await client.get(f"{url}/v1/models")).json()["data"]
                    base = listed[0]["id"]
                    loaded = {m["id"] for m in listed}
                    targets = [m for m in models if m in loaded] + [base]
                    if i % 5 == 0:
                        targets.append("team-a.no-such-model")
                    for model in targets:
                        body = {"model": model, "prompt": "a b", "max_tokens": 2,
                                "stream": i % 2 == 1}  # fmt: skip
                        r = await client.post(f"{url}/v1/completions", json=body)
                        sent[str(r.status_code)] = sent.get(str(r.status_code), 0) + 1
            await asyncio.sleep(0.5)


def _value(prom: PrometheusServer, expr: str) -> float:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else math.nan


def _resolve_variables(
    prom: PrometheusServer,
    dashboard: dict[str, Any],
    base: dict[str, str],
    prefer: dict[str, str],
    at: float,
) -> tuple[dict[str, str], list[str]]:
    """Values for the dashboard's variables, each read from its own query (in order);
    the `prefer`red value must be among those the query offers."""
    variables = dict(base)
    problems = []
    for var in dashboard.get("templating", {}).get("list", []):
        name = var["name"]
        if var.get("type") != "query":
            variables.setdefault(name, "x")
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query)
        assert m, f"variable {name}: only label_values(selector, label) is handled: {query}"
        expr, label = fill(m.group(1), variables), m.group(2)
        values = sorted({s["metric"].get(label, "") for s in prom.query(expr, at)} - {""})
        if prefer.get(name) not in values:
            problems.append(f"variable {name}: {prefer.get(name)!r} not in {values} ({expr})")
        variables[name] = prefer.get(name) if prefer.get(name) in values else values[0]
    return variables, problems


def _views(dashboard: dict[str, Any]) -> list[dict[str, str]]:
    """Variable choices to check a dashboard with: each experiment for the experiment
    view (two namespaces), the pool for the fleet view."""
    names = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    if "experiment" in names:
        return [
            {"namespace": ns, "pool": POOL, "experiment": f"{ns}.{name}"}
            for ns, name in EXPERIMENTS
        ]
    return [{"pool": POOL}]


def _rules_after(prom: PrometheusServer, at: float) -> list[dict[str, Any]] | None:
    """The loaded rules, once every one of them has been evaluated after `at`."""
    rules = prom.rules()

    def evaluated(rule: dict[str, Any]) -> float:
        # RFC 3339 with nanoseconds: "2026-12-02T18:21:30.123456789Z"
        stamp = re.sub(r"(\.\d{6})\d*", r"\1", rule.get("lastEvaluation", ""))
        try:
            return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return 0.0

    return rules if rules and all(evaluated(r) > at for r in rules) else None


def _check_panels(prom: PrometheusServer, window: str, at: float) -> tuple[list[str], int, int]:
    """Problems, panel queries checked, and how many of them returned data."""
    problems: list[str] = []
    checked = ok = 0
    base = {"__rate_interval": window, "__interval": window, "__range": window}
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for prefer in _views(dashboard):
            view = f"{path.stem} ({', '.join(f'{k}={v}' for k, v in prefer.items())})"
            try:
                variables, var_problems = _resolve_variables(prom, dashboard, base, prefer, at)
            except (AssertionError, IndexError) as e:
                problems.append(f"{view}: variables: {e}")
                continue
            problems += [f"{view}: {p}" for p in var_problems]
            for where, query in dashboard_queries(dashboard):
                if where.startswith("variable "):
                    continue  # resolved above
                checked += 1
                expr = fill(query, variables)
                try:
                    result = prom.query(expr, at)
                except QueryError as e:
                    problems.append(f"{view}: {where}: {e}")
                    continue
                if not result:
                    if f"{path.stem}: {where}" not in EXCUSED:
                        problems.append(f"{view}: {where}: no data for {expr}")
                    continue
                nan = [s["metric"] for s in result if math.isnan(float(s["value"][1]))]
                if nan:
                    problems.append(f"{view}: {where}: NaN for {nan} from {expr}")
                else:
                    ok += 1
    return problems, checked, ok


def _fleet_table(title: str) -> dict[str, Any]:
    fleet = json.loads(next(p for p in DASHBOARDS if p.name == "loraplex-fleet.json").read_text())
    (table,) = [p for p in fleet["panels"] if p["type"] == "table" and p["title"] == title]
    return table


def _table_results(prom: PrometheusServer, title: str, at: float) -> list[list[dict[str, Any]]]:
    variables = {"pool": POOL, "__rate_interval": "1m"}
    return [prom.query(fill(t["expr"], variables), at) for t in _fleet_table(title)["targets"]]


def _check_table_join(prom: PrometheusServer, at: float) -> list[str]:
    a, b = _table_results(prom, "Experiments on engines", at)
    keys_a = {json.dumps(s["metric"], sort_keys=True) for s in a}
    keys_b = {json.dumps(s["metric"], sort_keys=True) for s in b}
    problems = []
    if keys_a != keys_b:
        problems.append(f"fleet table: the two queries' label sets differ: {keys_a ^ keys_b}")
    want = {f"{ns}.{name}" for ns, name in EXPERIMENTS}
    got = {s["metric"].get("experiment") for s in a}
    if got != want:
        problems.append(f"fleet table: experiments {got}, expected {want}")
    for s in a:
        if s["metric"].get("namespace") not in {ns for ns, _ in EXPERIMENTS}:
            problems.append(f"fleet table: namespace should be the experiment's: {s['metric']}")

    # The operator's view: every experiment with its phase; ETA for the training ones.
    restarts, step, max_steps, eta = _table_results(prom, "Experiments", at)
    rows = {
        (s["metric"].get("namespace"), s["metric"]["experiment"], s["metric"]["phase"])
        for s in restarts
    }
    want_rows = {(ns, f"{ns}.{name}", "Running") for ns, name in EXPERIMENTS}
    want_rows.add((FAILING[0], FAILING_ID, "Failed"))
    if rows != want_rows:
        problems.append(f"experiments table: {rows}, expected {want_rows}")
    keys = [
        {json.dumps(s["metric"], sort_keys=True) for s in r} for r in (restarts, step, max_steps)
    ]
    if not keys[0] == keys[1] == keys[2]:
        problems.append(f"experiments table: the queries' label sets differ: {keys}")
    if {s["metric"]["experiment"] for s in eta} != want:
        problems.append(f"experiments table: ETA for {[s['metric'] for s in eta]}, expected {want}")
    for s in eta:
        if not 0 < float(s["value"][1]) < math.inf:
            problems.append(f"experiments table: ETA {s['value'][1]} for {s['metric']}")

    for result in _table_results(prom, "Failed experiments", at):
        got_failed = [(s["metric"]["experiment"], s["metric"]["reason"]) for s in result]
        if got_failed != [(FAILING_ID, "EngineReportedFailure")]:
            problems.append(f"failed experiments table: {got_failed}")
    return problems


async def test_dashboards_show_data_from_live_engine_and_operator(
    tmp_path: Path, tiny_model_dir: Path, reward_url: str
) -> None:
    t_start = time.monotonic()
    binary = tool("prometheus")
    scrapes = Scrapes(tmp_path)
    prom = PrometheusServer(
        binary, tmp_path / "prometheus", scrapes.configs(), rule_files=[RULES_FILE]
    )
    async with Harness(tmp_path / "cluster", tiny_model_dir) as h:
        assert h.operator is not None
        await asyncio.to_thread(prom.start)
        await asyncio.to_thread(scrapes.gateway.start)
        feeder = asyncio.create_task(_feed_engines(h, scrapes))
        traffic: asyncio.Task[None] | None = None
        gateway_traffic: asyncio.Task[None] | None = None
        sent: dict[str, int] = {}
        through_gateway: dict[str, int] = {}
        try:
            scrapes.set_operator(h.operator.metrics_port)
            # One engine from the start (min 1), so it loads while the operator settles.
            pool = h.pool_obj(POOL, slots=4, max_rank=8, replicas=(1, 1))
            # The failing experiment's reward server listens on loopback: the pool allows it.
            pool["spec"]["rewardHosts"] = ["127.0.0.1"]
            await h.apply(pool)
            await _poll(h, "operator target up", lambda: prom.up_targets("loraplex-operator"), 60)
            # The pool's counters exist at 0 before the first placement, so rate() and
            # the latency histogram see that placement.
            await _poll(
                h,
                "pool counters at 0 in Prometheus",
                lambda: prom.query(f'loraplex_scheduling_latency_seconds_count{{pool="{POOL}"}}'),
                60,
            )
            await _poll(h, "engine target up", lambda: prom.up_targets("loraplex-engine"), 150)
            for i, (ns, name) in enumerate(EXPERIMENTS):
                obj = h.experiment_obj(
                    name, POOL, max_steps=MAX_STEPS, every=CHECKPOINT_EVERY, seed=i, namespace=ns
                )
                obj["spec"]["eval"] = EVAL  # the eval series and the dashboard's Eval panel
                await h.apply(obj)
            failing = h.experiment_obj(FAILING[1], POOL, max_steps=MAX_STEPS, namespace=FAILING[0])
            failing["spec"]["task"].update(reward="http", rewardUrl=reward_url)
            await h.apply(failing)
            traffic = asyncio.create_task(_serve_traffic(h, sent))
            gateway_traffic = asyncio.create_task(
                serve_through(scrapes.gateway, dict(EXPERIMENTS), through_gateway)
            )

            def trained() -> bool:
                for ns, name in EXPERIMENTS:
                    sel = f'namespace="{ns}", experiment="{ns}.{name}", job="loraplex-engine"'
                    steps = _value(prom, f"loraplex_engine_steps_total{{{sel}}}")
                    checkpoints = _value(prom, f"loraplex_engine_checkpoints_total{{{sel}}}")
                    if not (steps >= MIN_STEPS and checkpoints >= MIN_CHECKPOINTS):
                        return False
                    # rate() over the panels' shortest window needs two samples in it; a
                    # busy engine on a loaded box misses 1 s scrapes, so count them.
                    samples = f"count_over_time(loraplex_engine_steps_total{{{sel}}}[30s])"
                    if not _value(prom, samples) >= MIN_SAMPLES:
                        return False
                running = f'loraplex_experiments{{pool="{POOL}", phase="Running"}}'
                if _value(prom, running) != len(EXPERIMENTS):
                    return False
                # Serving: first tokens of each experiment and of the base, and an error.
                tokens = "loraplex_engine_serving_first_token_seconds_count"
                served = f'count({tokens}{{job="loraplex-engine", experiment!="other"}} > 0)'
                errors = 'sum(loraplex_engine_serving_errors_total{job="loraplex-engine"})'
                if not (_value(prom, served) >= len(EXPERIMENTS) + 1 and _value(prom, errors) > 0):
                    return False
                # Through the gateway: each namespace's streamed answers, a 404 and a 401.
                # (an increase within the panels' shortest window: a namespace's series
                # appears with its first stream, whose count its first sample already holds)
                gw_tokens = "loraplex_gateway_time_to_first_token_seconds_count"
                gw_served = f'count(increase({gw_tokens}{{job="loraplex-gateway"}}[30s]) > 0)'
                codes = 'count(sum by (code) (loraplex_gateway_requests_total{code=~"401|404"}))'
                return _value(prom, gw_served) >= len(EXPERIMENTS) and _value(prom, codes) == 2

            def failed_and_unloaded() -> bool:
                sel = f'namespace="{FAILING[0]}", experiment="{FAILING_ID}"'
                failed = f'loraplex_experiment_phase{{{sel}, phase="Failed"}}'
                # unloaded: its engine series are gone (the "Experiments on engines" table)
                on_engine = f"loraplex_engine_steps_total{{{sel}}}"
                return _value(prom, failed) == 1 and not prom.query(on_engine)

            await _poll(h, f"{MIN_STEPS} steps of each experiment in Prometheus", trained, 120)
            await _poll(
                h, f"{FAILING_ID} Failed and unloaded in Prometheus", failed_and_unloaded, 60
            )

            at = time.time()
            window = f"{max(30, math.ceil(at - prom.started_at) + 5)}s"
            problems, checked, with_data = await asyncio.to_thread(_check_panels, prom, window, at)
            problems += await asyncio.to_thread(_check_table_join, prom, at)

            # The gateway's series carry the tenants' namespaces (honorLabels), not its own.
            by_ns = 'group by (namespace) (loraplex_gateway_requests_total{job="loraplex-gateway"})'
            tenants = {s["metric"].get("namespace", "") for s in prom.query(by_ns, at)}
            if tenants != {ns for ns, _ in EXPERIMENTS} | {""}:
                problems.append(f"gateway series by namespace: {tenants}")

            exprs = dict(rule_exprs(RULES_FILE))
            for alert in QUIET_ALERTS:
                firing = await asyncio.to_thread(prom.query, exprs[alert], at)
                if firing:
                    problems.append(f"alert {alert} matches on healthy data: {firing[:2]}")
            for alert, labels in FAILURE_ALERTS.items():
                firing = await asyncio.to_thread(prom.query, exprs[alert], at)
                if [s["metric"] for s in firing] != [labels]:
                    problems.append(f"alert {alert} should match {labels} once: {firing}")
            # The deployed rules file, loaded as is, evaluates on the live series without
            # errors (e.g. many-to-many joins, which only real label sets can reveal). The
            # states are read from an evaluation after `at`: one from before may still hold
            # a pending NoProgress from the moment the failed experiment sat on its engine
            # without a step (legitimate then, gone once it was unloaded).
            rules = await _poll(
                h, "a rule evaluation after the checked instant", lambda: _rules_after(prom, at), 60
            )
            if {r["name"] for r in rules} != set(exprs):
                problems.append(f"rules loaded: {sorted(r['name'] for r in rules)}")
            for rule in rules:
                if rule.get("health") != "ok":
                    problems.append(
                        f"rule {rule['name']}: {rule.get('health')} {rule.get('lastError')}"
                    )
                elif rule["name"] in QUIET_ALERTS and rule.get("state") != "inactive":
                    problems.append(
                        f"alert {rule['name']} is {rule.get('state')} on healthy data: "
                        f"{rule.get('alerts')}"
                    )

            # Every documented series exists in the live data (counters at 0 included).
            present = {
                s["metric"]["__name__"]
                for s in await asyncio.to_thread(
                    prom.query, 'group by (__name__) ({__name__=~"loraplex_.+"})', at
                )
            }
            missing = exported_series_names(documented_metrics(METRICS_DOC)) - present - ABSENT_HERE
            if missing:
                problems.append(f"documented series absent from the live data: {sorted(missing)}")

            want_ids = {f"{ns}.{name}" for ns, name in EXPERIMENTS}
            # Deleted: every per-experiment series of the operator goes (no stale series).
            await h.delete(*FAILING)
            gone = f'{{__name__=~"loraplex_experiment_.+", experiment="{FAILING_ID}"}}'
            await _poll(h, f"{FAILING_ID}'s series gone", lambda: not prom.query(gone), 60)
            others = await asyncio.to_thread(prom.query, "loraplex_experiment_phase")
            if {s["metric"]["experiment"] for s in others} != want_ids:
                problems.append(f"after the delete: phase series {others}")
        finally:
            for task in (feeder, traffic, gateway_traffic):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            prom.stop()
            await asyncio.to_thread(scrapes.gateway.stop)
            for ns, name in [*EXPERIMENTS, FAILING]:
                with contextlib.suppress(Exception):
                    await h.delete(ns, name)
        print(
            f"live prometheus check: {with_data}/{checked} panel queries with data, "
            f"{time.monotonic() - t_start:.1f}s, window {window}, completions by status {sent}, "
            f"through the gateway {through_gateway}"
        )
        assert not problems, "\n".join(problems)
        panels = sum(
            len([w for w, _ in dashboard_queries(d) if not w.startswith("variable ")])
            * len(_views(d))
            for d in (json.loads(p.read_text()) for p in DASHBOARDS)
        )
        assert checked == panels > 0


def test_generated_scrape_config_is_valid(tmp_path: Path) -> None:
    """The config the live test runs Prometheus with passes `promtool check config`."""
    scrapes = Scrapes(tmp_path)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump({"rule_files": [str(RULES_FILE)], "scrape_configs": scrapes.configs()})
    )
    proc = subprocess.run(
        [str(tool("promtool")), "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = {c["job_name"] for c in scrapes.configs()}
    assert jobs == {
        "podMonitor/loraplex-system/loraplex-engines/0",
        "serviceMonitor/loraplex-system/loraplex-operator/0",
        "serviceMonitor/loraplex-system/loraplex-gateway/0",
    }
