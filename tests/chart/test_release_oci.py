"""The chart's release path against a real OCI registry on loopback (issue 33).

Debian's `docker-registry` (distribution v2, installed by `make tools`) serves plain HTTP
on 127.0.0.1 with its storage in tmp and no auth. `make release-chart` packages the chart
and `helm push`es it there; then the registry's own API lists it, `helm pull` fetches it,
and `helm template oci://...` renders it: the images it runs are the ones the release
names for that registry (`make image-names`), and the README's install command works
against it. Image pushing itself needs a container engine, which no build machine here
has (`make release` says so; tests/chart/test_release_names.py checks the names).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart_helpers import CHART, REPO, by_kind, one, tool
from tests.support.release_names import chart_meta, readme_install, release_names

HELM_CONFIG_MEDIA_TYPE = "application/vnd.cncf.helm.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, accept: str = "application/json") -> Any:
    req = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """host:port of a fresh registry (a port taken between probe and bind: try again)."""
    exe = tool("docker-registry")
    tmp = tmp_path_factory.mktemp("registry")
    for _ in range(5):
        port = _free_port()
        config = {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(tmp / "data")}},
            "http": {"addr": f"127.0.0.1:{port}"},
        }
        (tmp / "config.yml").write_text(yaml.safe_dump(config))
        log = (tmp / "registry.log").open("w")
        proc = subprocess.Popen([str(exe), "serve", str(tmp / "config.yml")], stderr=log)
        try:
            if _wait_up(proc, f"http://127.0.0.1:{port}/v2/"):
                yield f"127.0.0.1:{port}"
                return
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()
    pytest.fail(f"docker-registry did not start: {(tmp / 'registry.log').read_text()[-2000:]}")


def _wait_up(proc: subprocess.Popen[bytes], url: str) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return _get(url) == {}
        except OSError:
            time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm's config, cache and registry logins in tmp, not the user's."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {k: v for k, v in os.environ.items() if k not in ("REGISTRY", "IMAGE_TAG")}
    for var in ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())
    env["HELM_REGISTRY_CONFIG"] = str(home / "registry.json")
    return env


@pytest.fixture(scope="module")
def published(
    registry: str, helm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> str:
    """`make release-chart` into the loopback registry; the registry prefix it used."""
    prefix = f"{registry}/loraplex"
    out = tmp_path_factory.mktemp("release-out")
    proc = subprocess.run(
        ["make", "-s", "--no-print-directory", "release-chart", f"REGISTRY={prefix}",
         "HELM_PUSH_FLAGS=--plain-http", f"OUT={out}"],
        cwd=REPO, env=helm_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Pushed: {prefix}/charts/loraplex:{chart_meta()['version']}" in proc.stderr
    return prefix


def _helm(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        [str(tool("helm")), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_registry_holds_the_chart_as_a_helm_artifact(registry: str, published: str) -> None:
    repo = "loraplex/charts/loraplex"
    assert repo in _get(f"http://{registry}/v2/_catalog")["repositories"]
    assert _get(f"http://{registry}/v2/{repo}/tags/list")["tags"] == [chart_meta()["version"]]
    manifest = _get(f"http://{registry}/v2/{repo}/manifests/{chart_meta()['version']}", MANIFEST)
    assert manifest["config"]["mediaType"] == HELM_CONFIG_MEDIA_TYPE


def test_helm_pull_gets_the_chart_naming_the_registry_images(
    published: str, helm_env: dict[str, str], tmp_path: Path
) -> None:
    version = chart_meta()["version"]
    ref = f"oci://{published}/charts/loraplex"
    _helm(helm_env, "pull", ref, "--version", version, "--plain-http", "-d", str(tmp_path))
    with tarfile.open(tmp_path / f"loraplex-{version}.tgz") as tgz:
        chart = yaml.safe_load(tgz.extractfile("loraplex/Chart.yaml").read())
        values = yaml.safe_load(tgz.extractfile("loraplex/values.yaml").read())
        crds = {n for n in tgz.getnames() if n.startswith("loraplex/crds/")}
    assert (chart["version"], chart["appVersion"]) == (version, chart_meta()["appVersion"])
    assert values["operator"]["image"]["repository"] == f"{published}/operator"
    assert values["defaultPool"]["spec"]["template"]["image"] == f"{published}/engine"
    assert crds == {f"loraplex/crds/{p.name}" for p in (CHART / "crds").glob("*.yaml")}


def test_helm_template_from_the_registry_runs_the_released_images(
    published: str, helm_env: dict[str, str]
) -> None:
    """The README's install command, as `helm template` against the loopback registry."""
    argv = readme_install()
    assert argv[:2] == ["helm", "install"]
    ref = next(a for a in argv if a.startswith("oci://"))
    local = ref.replace("oci://ghcr.io/loraplex", f"oci://{published}")
    assert local != ref
    args = ["template", *[local if a == ref else a for a in argv[2:]], "--plain-http"]
    rendered = _helm(helm_env, *args, "--set", "defaultPool.enabled=true")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    names = release_names(published)
    deployments = by_kind(docs, "Deployment")  # the operator's and the gateway's
    images = {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in deployments}
    assert len(deployments) == 2 and images == {names["operator"]}, images
    assert one(docs, "EnginePool")["spec"]["template"]["image"] == names["engine"]
    assert by_kind(docs, "PrometheusRule") and by_kind(docs, "ServiceMonitor")  # README's --set


def test_release_without_a_container_engine_stops_before_the_chart(
    registry: str, helm_env: dict[str, str], tmp_path: Path
) -> None:
    """`make release` with no engine to build images with (CONTAINER_TOOL names one that
    does not exist, as on every build machine here): it says so, and pushes no chart
    that would name images never pushed."""
    prefix = f"{registry}/no-images"
    proc = subprocess.run(
        ["make", "-s", "--no-print-directory", "release", f"REGISTRY={prefix}",
         "HELM_PUSH_FLAGS=--plain-http", f"OUT={tmp_path}",
         "CONTAINER_TOOL=no-such-container-engine"],
        cwd=REPO, env=helm_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "no container engine to build images with" in proc.stderr
    assert "Nothing was built or pushed" in proc.stderr
    catalog = _get(f"http://{registry}/v2/_catalog")["repositories"]
    assert not [r for r in catalog if r.startswith("no-images/")], catalog
