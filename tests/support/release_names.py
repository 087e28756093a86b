"""The release names as scripts/release.sh gives them (through `make image-names`, the
Makefile's own path to it): image name → reference, and the chart's OCI reference; and the
README's `helm install` command that must name them."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import yaml

from tests.support.chart_helpers import CHART, REPO

DEFAULT_REGISTRY = "ghcr.io/loraplex"
IMAGES = ("operator", "engine", "engine-cpu")


def chart_meta() -> dict[str, str]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def release_names(registry: str | None = None) -> dict[str, str]:
    """`make -s image-names [REGISTRY=...]` as {name: reference} (no prerequisites run)."""
    cmd = ["make", "-s", "--no-print-directory", "image-names"]
    if registry is not None:
        cmd.append(f"REGISTRY={registry}")
    env = {k: v for k, v in os.environ.items() if k not in ("REGISTRY", "IMAGE_TAG")}
    out = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if line)


def readme_install() -> list[str]:
    """The README's `helm install ... oci://...` command, as argv (continuations joined)."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if re.match(r"\s*helm install \S+ oci://", ln)]
    return shlex.split(line.split("#")[0])
