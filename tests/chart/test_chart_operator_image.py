"""The operator image starts what the chart starts: `docker run` of operator/Dockerfile
runs the command, args and metrics port the chart renders for default values."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.chart_helpers import operator_deployment, render

DOCKERFILE = Path(__file__).resolve().parents[2] / "operator" / "Dockerfile"


def _instructions(name: str) -> list[str]:
    lines = DOCKERFILE.read_text().splitlines()
    return [ln.split(" ", 1)[1] for ln in lines if ln.startswith(f"{name} ")]


def _instruction(name: str) -> str:
    (value,) = _instructions(name)
    return value


def _chart_container() -> dict:
    deployment = operator_deployment(render({}))
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"
    ]
    return container


def test_image_entrypoint_and_cmd_are_the_charts_command_and_args() -> None:
    container = _chart_container()
    assert json.loads(_instruction("ENTRYPOINT")) == container["command"]
    assert json.loads(_instruction("CMD")) == container["args"]


def test_image_serves_metrics_and_health_on_the_charts_ports() -> None:
    container = _chart_container()
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert f"LORAPLEX_METRICS_PORT={env['LORAPLEX_METRICS_PORT']}" in _instructions("ENV")
    ports = {str(p["containerPort"]) for p in container["ports"]}
    assert set(_instruction("EXPOSE").split()) == ports
