"""Every dashboard query returns data from a real Prometheus holding the metrics of
docs/metrics.md with the labels the chart's PodMonitor/ServiceMonitor give them.

Synthetic series (one pool, one engine, two experiments) are backfilled with
`promtool tsdb create-blocks-from openmetrics`, a local Prometheus (127.0.0.1 only)
serves them, and each panel query, with Grafana's variables filled in, must return a
non-empty result. This catches label mistakes (pool, phase, state, pod joins) that a
name check cannot.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

from tests.support.chart_helpers import DASHBOARDS, RULES_FILE, tool
from tests.support.promql_names import dashboard_queries, rule_exprs

STEP_S = 15
SPAN_S = 3600
OP = {"job": "loraplex-operator", "instance": "10.0.0.1:8080", "pod": "loraplex-operator-x"}
ENGINE = {
    "job": "loraplex-engine",
    "instance": "10.0.0.2:8000",
    "pod": "pool-a-engine-0",
    "pool": "pool-a",
}
# loraplex-gateway, one of its replicas (ServiceMonitor: job relabelled, honorLabels keep
# the tenant `namespace`).
GATEWAY = {"job": "loraplex-gateway", "instance": "10.0.0.3:8080", "pod": "loraplex-gateway-x"}
EXPERIMENTS = [("team-a", "team-a.exp1"), ("team-b", "team-b.exp2")]
FAILED = ("team-a", "team-a.exp3")  # known to the operator only
BUCKETS = ["0.1", "0.5", "1", "5", "30", "120", "600", "+Inf"]
PHASES = ["rollout", "reward", "train", "sync", "checkpoint"]
VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "datasource": "x",
    "pool": "pool-a",
    "namespace": "team-a",
    "experiment": "team-a.exp1",
}


def _labels(d: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(d.items())) + "}"


def _openmetrics(end: int) -> str:
    """The synthetic data set, in OpenMetrics with timestamps."""
    times = list(range(end - SPAN_S, end, STEP_S))
    fams: dict[str, tuple[str, list[tuple[str, dict, object]]]] = {}

    def add(family: str, kind: str, sample: str, labels: dict, fn) -> None:
        fams.setdefault(family, (kind, []))[1].append((sample, labels, fn))

    def counter(name: str, labels: dict, per_s: float) -> None:
        add(name.removesuffix("_total"), "counter", name, labels, lambda i: per_s * i * STEP_S)

    def gauge(name: str, labels: dict, value: float) -> None:
        add(name, "gauge", name, labels, lambda i: value)

    def histogram(name: str, labels: dict, per_s: float, mean: float) -> None:
        for j, le in enumerate(BUCKETS):
            share = min(1.0, (j + 1) / (len(BUCKETS) - 1))
            add(name, "histogram", f"{name}_bucket", {**labels, "le": le},
                lambda i, s=share: round(per_s * i * STEP_S * s))  # fmt: skip
        add(name, "histogram", f"{name}_sum", labels, lambda i: per_s * i * STEP_S * mean)
        add(name, "histogram", f"{name}_count", labels, lambda i: round(per_s * i * STEP_S))

    pool = {"pool": "pool-a"}
    for phase, n in {"Pending": 2, "Scheduled": 0, "Running": 2, "Suspended": 0,
                     "Succeeded": 5, "Failed": 1}.items():  # fmt: skip
        gauge("loraplex_experiments", {**OP, **pool, "phase": phase}, n)
    for name in ("placements", "preemptions", "recoveries"):
        counter(f"loraplex_{name}_total", {**OP, **pool}, 0.01)
    histogram("loraplex_scheduling_latency_seconds", {**OP, **pool}, 0.01, 20)
    gauge("loraplex_pool_engines", {**OP, **pool}, 1)
    gauge("loraplex_pool_slots", {**OP, **pool, "state": "used"}, 2)
    gauge("loraplex_pool_slots", {**OP, **pool, "state": "free"}, 6)
    counter("loraplex_reconcile_errors_total", {**OP, "kind": "LoRAExperiment"}, 0.001)
    # Per experiment (honorLabels: `namespace` is the experiment's): the two training
    # ones, and one that failed.
    for ns, exp, phase, reason, restarts in (
        *((ns, exp, "Running", "Training", 0) for ns, exp in EXPERIMENTS),
        (*FAILED, "Failed", "EngineReportedFailure", 1),
    ):
        per_exp = {**OP, **pool, "namespace": ns, "experiment": exp}
        gauge("loraplex_experiment_phase", {**per_exp, "phase": phase, "reason": reason}, 1)
        gauge("loraplex_experiment_restarts", per_exp, restarts)
        gauge("loraplex_experiment_step", per_exp, 120)
        gauge("loraplex_experiment_max_steps", per_exp, 1000)

    engine_wide = {**ENGINE, "namespace": "loraplex-system"}
    for ns, exp in EXPERIMENTS:
        per_exp = {**ENGINE, "namespace": ns, "experiment": exp}
        counter("loraplex_engine_steps_total", per_exp, 0.5)
        counter("loraplex_engine_rollout_tokens_total", per_exp, 400)
        counter("loraplex_engine_train_tokens_total", per_exp, 500)
        counter("loraplex_engine_checkpoints_total", per_exp, 0.05)
        gauge("loraplex_engine_reward", per_exp, 0.5)
        # a version published every sample: the annotation's changes() always has one
        add("loraplex_engine_latest_version", "gauge", "loraplex_engine_latest_version",
            per_exp, lambda i: 1 + i)  # fmt: skip
        gauge("loraplex_engine_eval_reward", per_exp, 0.7)  # both have spec.eval
        gauge("loraplex_engine_eval_pass_at_k", per_exp, 0.6)
        counter("loraplex_engine_eval_tokens_total", per_exp, 40)
    # Serving, per the request's model: two experiments, the base, and "other" (errors).
    base = {**engine_wide, "experiment": "tiny-base"}
    other = {**engine_wide, "experiment": "other"}
    for labels in (*({**ENGINE, "namespace": ns, "experiment": e} for ns, e in EXPERIMENTS), base):
        counter("loraplex_engine_serving_requests_total", labels, 2)
        histogram("loraplex_engine_serving_request_seconds", labels, 2, 1.5)
        histogram("loraplex_engine_serving_first_token_seconds", labels, 2, 0.4)
    counter("loraplex_engine_serving_requests_total", other, 0.1)
    counter("loraplex_engine_serving_errors_total", {**other, "code": "not_found"}, 0.1)
    gauge("loraplex_engine_serving_queue_depth", engine_wide, 3)
    counter("loraplex_engine_experiment_failures_total", {**engine_wide, "reason": "nan"}, 0.001)
    histogram("loraplex_engine_tick_seconds", engine_wide, 0.5, 1.6)
    for phase in PHASES:
        histogram("loraplex_engine_phase_seconds", {**engine_wide, "phase": phase}, 0.5, 0.3)
    gauge("loraplex_engine_busy_ratio", engine_wide, 0.8)
    gauge("loraplex_engine_active_adapters", engine_wide, 2)
    gauge("loraplex_engine_free_slots", engine_wide, 6)
    gauge("loraplex_engine_memory_bytes", {**engine_wide, "kind": "rss"}, 2e9)
    gauge("loraplex_engine_memory_bytes", {**engine_wide, "kind": "device"}, 8e9)
    # The gateway: both tenants' OpenAI and Tinker calls, some refused, streams' first tokens.
    for ns, _ in EXPERIMENTS:
        for api in ("openai", "tinker"):
            per_ns = {**GATEWAY, "namespace": ns, "api": api}
            counter("loraplex_gateway_requests_total", {**per_ns, "code": "200"}, 3)
            histogram("loraplex_gateway_request_seconds", per_ns, 3, 1.2)
        refused = {**GATEWAY, "namespace": ns, "api": "openai", "code": "404"}
        counter("loraplex_gateway_requests_total", refused, 0.1)
        ttft = {**GATEWAY, "namespace": ns}
        histogram("loraplex_gateway_time_to_first_token_seconds", ttft, 1, 0.3)
    no_key = {**GATEWAY, "namespace": "", "api": "openai"}
    counter("loraplex_gateway_requests_total", {**no_key, "code": "401"}, 0.05)
    histogram("loraplex_gateway_request_seconds", no_key, 0.05, 0.001)
    for reason in ("connect", "reset", "timeout"):
        counter("loraplex_gateway_upstream_errors_total", {**GATEWAY, "reason": reason}, 0.001)
    gauge("loraplex_gateway_engines", GATEWAY, 1)
    gauge("loraplex_gateway_api_keys", GATEWAY, 2)
    # the synthetic `up` series Prometheus writes per target
    for target in (OP, engine_wide, GATEWAY):
        gauge("up", target, 1)

    lines = []
    for family, (kind, samples) in fams.items():
        lines.append(f"# TYPE {family} {kind}")
        for sample, labels, fn in samples:
            for i, t in enumerate(times):
                lines.append(f"{sample}{_labels(labels)} {fn(i)} {t}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    promtool, server = tool("promtool"), tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    end = (int(time.time()) // 60) * 60 - 120
    data = tmp / "data"
    om = tmp / "metrics.om"
    om.write_text(_openmetrics(end))
    proc = subprocess.run(
        [str(promtool), "tsdb", "create-blocks-from", "openmetrics", str(om), str(data)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp / "prometheus.yml").write_text("global: {}\n")
    port = _free_port()
    log = (tmp / "prometheus.log").open("w")
    server_proc = subprocess.Popen(
        [str(server), f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={data}", f"--web.listen-address=127.0.0.1:{port}",
         "--storage.tsdb.retention.time=30d"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server_proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start:\n{(tmp / 'prometheus.log').read_text()}")
            time.sleep(0.3)
        yield url, end
    finally:
        server_proc.terminate()
        server_proc.wait(timeout=30)
        log.close()


def _query(url: str, expr: str, at: int) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "time": str(at)})
    with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=30) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return result if isinstance(result, list) else [result]


_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(?:[.:][^}]*)?\}|\$([A-Za-z_]\w*)")


def _fill(query: str) -> str:
    return _VAR.sub(lambda m: VARIABLES[m.group(1) or m.group(2)], query)


def _cases() -> list[tuple[str, str]]:
    cases = []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for where, query in dashboard_queries(dash):
            cases.append((f"{path.stem}: {where}", query))
    return cases


@pytest.mark.parametrize(("where", "query"), _cases(), ids=[w for w, _ in _cases()])
def test_query_returns_data(prometheus: tuple[str, int], where: str, query: str) -> None:
    url, end = prometheus
    m = re.match(r"^\s*label_values\((.*),\s*(\w+)\)\s*$", query, re.DOTALL)
    expr = _fill(m.group(1) if m else query)
    result = _query(url, expr, end)
    assert result, f"{where}: no data for {expr}"
    if m:  # the variable's label must be on the series
        assert all(m.group(2) in s["metric"] for s in result), (where, result[:1])
    for series in result:
        value = float(series["value"][1])
        assert value == value, f"{where}: NaN from {expr}"  # NaN = a broken ratio/quantile


def _fleet_table(title: str) -> dict:
    fleet = json.loads(next(p for p in DASHBOARDS if p.name == "loraplex-fleet.json").read_text())
    (table,) = [p for p in fleet["panels"] if p["type"] == "table" and p["title"] == title]
    return table


def _label_sets(result: list[dict]) -> set[str]:
    return {json.dumps(s["metric"], sort_keys=True) for s in result}


def test_experiment_table_queries_join(prometheus: tuple[str, int]) -> None:
    """The fleet's tables merge their queries on identical label sets."""
    url, end = prometheus
    a, b = (
        _query(url, _fill(t["expr"]), end)
        for t in _fleet_table("Experiments on engines")["targets"]
    )
    assert _label_sets(a) == _label_sets(b)
    assert {s["metric"]["experiment"] for s in a} == {e for _, e in EXPERIMENTS}

    # Every experiment the operator knows; ETA only for those making progress.
    restarts, step, max_steps, eta = (
        _query(url, _fill(t["expr"]), end) for t in _fleet_table("Experiments")["targets"]
    )
    assert _label_sets(restarts) == _label_sets(step) == _label_sets(max_steps)
    assert _label_sets(eta) < _label_sets(restarts)
    assert {s["metric"]["experiment"] for s in restarts} == {e for _, e in [*EXPERIMENTS, FAILED]}
    assert {s["metric"]["experiment"] for s in eta} == {e for _, e in EXPERIMENTS}
    # 880 steps left at 0.5 steps/s
    assert {round(float(s["value"][1])) for s in eta} == {1760}

    failed = [
        _query(url, _fill(t["expr"]), end) for t in _fleet_table("Failed experiments")["targets"]
    ]
    for result in failed:
        assert [(s["metric"]["experiment"], s["metric"]["reason"]) for s in result] == [
            (FAILED[1], "EngineReportedFailure")
        ]


def test_alert_rules_quiet_on_healthy_data(prometheus: tuple[str, int]) -> None:
    """Healthy synthetic data: alerts that need trouble do not match (sanity of labels)."""
    url, end = prometheus
    exprs = dict(rule_exprs(RULES_FILE))
    quiet = (
        "LoraplexEngineDown",
        "LoraplexRewardNaN",
        "LoraplexExperimentNoProgress",
        "LoraplexEnginesMissing",
        "LoraplexOperatorDown",
        "LoraplexExperimentStuckPending",
        "LoraplexExperimentRestarting",
        "LoraplexCheckpointStorageFull",
        "LoraplexPoolStalled",
    )
    for name in quiet:
        assert _query(url, exprs[name], end) == [], name
