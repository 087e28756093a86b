"""Shared helpers for the chart tests: tool paths, `helm template`, scenarios."""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.paths import REPO_ROOT as REPO  # the name its importers use

CHART = REPO / "charts" / "loraplex"
TOOLS_BIN = REPO / ".tools" / "bin"
METRICS_DOC = REPO / "docs" / "metrics.md"
RULES_FILE = CHART / "rules" / "loraplex-rules.yaml"
RULES_TEST = REPO / "tests" / "chart" / "rules_test.yaml"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
CONTRACT = CHART / "rbac-contract.yaml"
RELEASE = "loraplex"
NAMESPACE = "loraplex-system"

# Kubernetes versions the chart supports (Chart.yaml kubeVersion >=1.29); rendered
# manifests are validated against the oldest and the newest schemas kubernetes-validate
# ships for that range.
KUBE_VERSIONS = ("1.29.0", "1.37.0")

# Kinds that kubernetes-validate has no schema for (custom resources).
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "EnginePool"}


def tool(name: str) -> Path:
    """Path of an installed tool; fails the test with what to do when it is missing."""
    path = TOOLS_BIN / name
    if not (path.exists() and path.stat().st_mode & 0o111):
        pytest.fail(
            f"{name} is not installed at {path}: run `make tools` (scripts/install-tools.sh) first",
            pytrace=False,
        )
    return path


ALL_ON: dict[str, Any] = {
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "dashboards": {"enabled": True, "annotations": {"grafana_folder": "loraplex"}},
    },
    "networkPolicy": {"enabled": True},
    "defaultPool": {"enabled": True},
}
NAMESPACED: dict[str, Any] = {"rbac": {"scope": "namespaced", "namespaces": ["team-b", "team-a"]}}


def merge(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        _merge_into(out, copy.deepcopy(part))
    return out


def _merge_into(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge_into(dst[key], value)
        else:
            dst[key] = value


# The toggle combinations that matter (name → values).
SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "all-on": ALL_ON,
    "namespaced": NAMESPACED,
    "namespaced-all-on": merge(NAMESPACED, ALL_ON),
    "monitoring-only": {"monitoring": ALL_ON["monitoring"]},
    "netpol-only": {"networkPolicy": {"enabled": True}},
    "pool-only": {"defaultPool": {"enabled": True}},
    "existing-secret": merge(
        ALL_ON, {"engines": {"token": {"existingSecret": "my-engine-token", "key": "tok"}}}
    ),
    "engines-elsewhere": merge(NAMESPACED, ALL_ON, {"engines": {"namespace": "gpu-engines"}}),
    "minimal": {
        "rbac": {"create": False, "aggregateToDefaultRoles": False},
        "tests": {"enabled": False},
        "serviceAccount": {"create": False, "name": "preexisting-sa"},
        "gateway": {"serviceAccount": {"create": False, "name": "preexisting-gateway-sa"}},
        "metrics": {"service": {"enabled": False}},
        "engines": {"metricsService": {"enabled": False}},
    },
    "no-gateway": {"gateway": {"enabled": False}},
    # AIBrix ModelAdapters for published aliases (operator/loraplex_operator/aibrix.py).
    "aibrix": {"aibrix": {"enabled": True, "podSelector": {"model.aibrix.ai/name": "base"}}},
    "aibrix-namespaced": merge(
        NAMESPACED, {"aibrix": {"enabled": True, "podSelector": {"app": "vllm"}}}
    ),
    # The vLLM serving fleet (templates/fleet.yaml, tests/chart/test_chart_fleet.py).
    "fleet": {
        "fleet": {
            "enabled": True,
            "experiments": ["team-a/support-bot", "team-b/summarise"],
            "model": "/models/base",
            "maxLoraRank": 32,
            "maxLoras": 4,
            "port": 8100,
            "pollSeconds": 0.5,
            "checkpoint": {
                "root": "/var/lib/loraplex/ckpt",
                "volume": {"persistentVolumeClaim": {"claimName": "loraplex-ckpt"}},
            },
        }
    },
    "digest-debug": {
        "operator": {"image": {"digest": "sha256:" + "a" * 64}, "logLevel": "debug"},
        "fullnameOverride": "lp",
    },
}


def _helm_template(values_json: str, kube_version: str | None, include_crds: bool) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(values_json)
        f.flush()
        cmd = [str(tool("helm")), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        cmd += ["-f", f.name]
        if kube_version:
            cmd += ["--kube-version", kube_version]
        if include_crds:
            cmd.append("--include-crds")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise HelmError(proc.stderr.strip())
    return proc.stdout


class HelmError(Exception):
    """helm failed; the message is its stderr."""


@functools.lru_cache(maxsize=128)
def _render_cached(values_json: str, kube_version: str | None, include_crds: bool) -> str:
    return _helm_template(values_json, kube_version, include_crds)


def render(
    values: dict[str, Any] | None = None,
    *,
    kube_version: str | None = None,
    include_crds: bool = False,
) -> list[dict[str, Any]]:
    """`helm template` → list of manifests (fresh copies; safe to mutate)."""
    text = _render_cached(json.dumps(values or {}, sort_keys=True), kube_version, include_crds)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_error(values: dict[str, Any]) -> str:
    """stderr of a `helm template` that must fail."""
    try:
        _helm_template(json.dumps(values), None, False)
    except HelmError as e:
        return str(e)
    raise AssertionError(f"helm template accepted bad values {values}")


def render_notes(values: dict[str, Any] | None = None) -> str:
    """NOTES.txt rendered with `values` (helm template skips NOTES; render it via tpl)."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "loraplex"
        shutil.copytree(CHART, chart)
        (chart / "NOTES.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
        (chart / "templates" / "NOTES.txt").unlink()
        (chart / "templates" / "zz-notes-check.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
            'data:\n  notes: {{ tpl (.Files.Get "NOTES.txt") . | quote }}\n'
        )
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(json.dumps(values or {}))
            f.flush()
            cmd = [str(tool("helm")), "template", RELEASE, str(chart), "-n", NAMESPACE]
            cmd += ["-f", f.name, "--show-only", "templates/zz-notes-check.yaml"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)["data"]["notes"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def component(docs: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    """The `kind`s of one component (label app.kubernetes.io/component: operator,
    gateway): the chart renders a Deployment, ServiceAccount, RBAC and Service for each."""
    return [
        d
        for d in by_kind(docs, kind)
        if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == name
    ]


def operator_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The operator's Deployment (the chart also renders the gateway's, by default)."""
    found = component(docs, "Deployment", "operator")
    assert len(found) == 1, f"expected one operator Deployment, got {len(found)}"
    return found[0]


def crd_files() -> list[Path]:
    return sorted((REPO / "crds").glob("*.yaml")) if (REPO / "crds").is_dir() else []
