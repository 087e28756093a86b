"""The operator as `helm install` deploys it takes an experiment to Succeeded.

The operator process is the chart's operator container exactly as `helm template`
renders it (command, args, env), with only the image's `kopf` mapped to the local
install; the only values set are the two ports (the defaults may be taken on a shared
test machine), so the operator runs with the chart's default intervals. The engine is
the Pod spec the operator wrote, run by the test kubelet (its command, args and env;
volumes as local directories, the token Secret as a file). Health and metrics are read
where the chart's probes and ServiceMonitor look.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from loraplex_operator import manifests

from tests.support.harness import ENGINE_NS, Harness, operator_calls_in
from tests.support.measurements import record_seconds
from tests.support.pod_runtime import VENV_BIN

pytestmark = pytest.mark.slow

MODES = {
    "default": None,
    # ... and JSON logs (operator.logFormat): every line of its log must parse, and of
    # its engines' (engines.logFormat empty: the operator's format).
    "namespaced": {
        "rbac": {"scope": "namespaced", "namespaces": ["team-a"]},
        "operator": {"logFormat": "json"},
    },
}
MEASURE_FILE = Path("out/operator-measurements.json")


def _record(name: str, seconds: float) -> None:
    record_seconds(MEASURE_FILE, name, seconds)


def _ran_exactly_the_rendered_container(h: Harness) -> None:
    assert h.operator is not None
    container = h.operator.rendered.container
    assert container["command"] == ["kopf"]
    assert h.operator.argv == [str(VENV_BIN / "kopf"), *container["args"]]
    assert h.operator.argv[-2:] == ["-m", "loraplex_operator.handlers"]


def _ran_the_pod_spec(h: Harness, pod: dict[str, Any]) -> None:
    """The engine's command line is the Pod's, with only volumes and image paths local."""
    assert h.kubelet is not None
    engine = h.kubelet.processes[pod["metadata"]["name"]]
    container = pod["spec"]["containers"][0]
    want = container["command"] + container["args"]
    assert len(engine.argv) == len(want)
    assert Path(engine.argv[0]).name == want[0]
    token_dir = engine.volumes[manifests.TOKEN_VOLUME]
    for got, wrote in zip(engine.argv[1:], want[1:], strict=True):
        if wrote == manifests.TOKEN_FILE:
            assert got == str(token_dir / "token")
        elif wrote.startswith("/"):
            assert got != wrote and Path(got).exists(), (wrote, got)  # a local mount
        elif wrote == str(manifests.ENGINE_PORT):
            assert got == "0"  # every Pod shares the loopback: a free port
        else:
            assert got == wrote
    assert (token_dir / "token").stat().st_mode & 0o777 == 0o400  # the volume's defaultMode
    assert engine.environment["LORAPLEX_ENGINE"] == pod["metadata"]["name"]  # downward API
    assert engine.environment["LORAPLEX_POOL"] == "pool-chart"


@pytest.mark.parametrize("mode", MODES)
async def test_rendered_operator_takes_an_experiment_to_succeeded(
    tmp_path: Path, tiny_model_dir: Path, mode: str
) -> None:
    async with Harness(tmp_path, tiny_model_dir, chart_values=MODES[mode], tuned=False) as h:
        _ran_exactly_the_rendered_container(h)
        assert h.operator is not None
        async with httpx.AsyncClient(timeout=10) as c:

            async def healthy() -> bool:
                try:
                    return (await c.get(h.operator.health_url)).status_code == 200
                except httpx.TransportError:
                    return False

            await h.wait_for("the operator's readiness probe", healthy, timeout=60)
            await h.apply(h.pool_obj("pool-chart", slots=2, max_rank=8, replicas=(0, 1)))
            t0 = time.monotonic()
            await h.apply(h.experiment_obj("chart-exp", "pool-chart", max_steps=4, every=2))
            status = await h.wait_phase("team-a", "chart-exp", "Succeeded", timeout=300)
            _record(f"chart_{mode}_cold_pool_apply_to_succeeded_s", time.monotonic() - t0)
            assert status["step"] == 4
            pods = await h.engine_pods("pool-chart")
            assert len(pods) == 1 and pods[0]["metadata"]["namespace"] == ENGINE_NS
            _ran_the_pod_spec(h, pods[0])
            _engine_logged(h, pods[0], json_lines=mode == "namespaced")
            metrics = (await c.get(h.operator.metrics_url)).text
            assert "loraplex_experiment_phase{" in metrics and "chart-exp" in metrics
            assert (await c.get(h.operator.rendered.probe_url("livenessProbe"))).is_success
        _logged_well(h.operator.log_text(), json_lines=mode == "namespaced")
        if mode == "namespaced":  # kopf found team-a by listing and watching namespaces
            assert h.api is not None
            calls = operator_calls_in(h.api)
            assert {("", "namespaces", "list", None), ("", "namespaces", "watch", None)} <= calls


def _engine_logged(h: Harness, pod: dict[str, Any], *, json_lines: bool) -> None:
    """The engine pod runs `serve --log-format json` where the chart's values chose json
    (text: no flag, the engine's default), and its log is in that format (JSON: every
    line an object with the engine's fields)."""
    assert h.kubelet is not None
    args = pod["spec"]["containers"][0]["args"]
    if json_lines:
        assert args[args.index("--log-format") + 1] == "json"
    else:
        assert "--log-format" not in args
    log = h.kubelet.processes[pod["metadata"]["name"]].log_text()
    lines = [ln for ln in log.splitlines() if ln.strip()]
    assert any("loraplex-engine listening" in ln for ln in lines)
    for line in lines:
        if json_lines:
            assert {"time", "level", "logger", "message"} <= set(json.loads(line)), line
        else:
            assert not line.startswith("{"), line


def _logged_well(text: str, *, json_lines: bool) -> None:
    """No per-request httpx lines (the engine polls); with JSON, one object per line."""
    assert "HTTP Request:" not in text
    if json_lines:
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines
        for line in lines:
            record = json.loads(line)
            assert {"time", "level", "logger", "message"} <= set(record), record
