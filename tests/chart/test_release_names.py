"""One image naming scheme everywhere a user or the release reads one (issue 33).

`make image-names` (scripts/release.sh) is the scheme: ghcr.io/loraplex/{operator,
engine,engine-cpu}:<appVersion> and the chart at oci://ghcr.io/loraplex/charts/loraplex.
The chart's rendered images, the samples' pools, the README's install command and every
image reference in the docs, Dockerfiles and Makefile must name those and nothing else:
a chart naming one image and a release pushing another ends in ImagePullBackOff.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.support.chart_helpers import CHART, REPO, by_kind, one, render
from tests.support.release_names import (
    DEFAULT_REGISTRY,
    IMAGES,
    chart_meta,
    readme_install,
    release_names,
)

APP_VERSION = chart_meta()["appVersion"]
CHART_VERSION = chart_meta()["version"]
NAMES = release_names()
ENGINES = {NAMES["engine"], NAMES["engine-cpu"]}

# Where image references are written for people and tools to use.
SCANNED = [
    REPO / "README.md",
    REPO / "Makefile",
    REPO / "operator" / "Dockerfile",
    *sorted((REPO / "trainer-image").glob("Dockerfile*")),
    *sorted((REPO / "docs").rglob("*.md")),
    *sorted((REPO / "samples").rglob("*.yaml")),
    *sorted((REPO / "scripts").glob("*.sh")),
    *sorted(p for p in CHART.rglob("*") if p.is_file() and "crds" not in p.parts),
]
# <registry path>/loraplex/<image>[:tag | @digest]; and the old dev scheme loraplex-<image>:tag.
SLASHED = re.compile(
    r"(?<![\w./-])((?:[\w.-]+(?::\d+)?/)*loraplex/(?:operator|engine(?:-[a-z0-9]+)?))(?![\w-])"
    r"(:[\w.<>-]+|@sha256:[0-9a-f]*)?"
)
DASHED = re.compile(r"(?<![\w./-])loraplex-(?:operator|engine(?:-[a-z0-9]+)?):[\w.<>-]+")


def test_the_scheme_is_one_registry_and_the_app_version() -> None:
    expected = {name: f"{DEFAULT_REGISTRY}/{name}:{APP_VERSION}" for name in IMAGES}
    expected["chart"] = f"oci://{DEFAULT_REGISTRY}/charts/loraplex:{CHART_VERSION}"
    assert expected == NAMES


def test_another_registry_moves_every_name() -> None:
    names = release_names("127.0.0.1:5000/team/")
    moved = [ref.removeprefix("oci://") for ref in names.values()]
    assert all(ref.startswith("127.0.0.1:5000/team/") for ref in moved), moved
    assert names["engine-cpu"] == f"127.0.0.1:5000/team/engine-cpu:{APP_VERSION}"


def test_the_chart_renders_the_release_images() -> None:
    docs = render({"defaultPool": {"enabled": True}})
    # the operator and the gateway both run from the operator image
    images = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["image"]
              for d in by_kind(docs, "Deployment")}  # fmt: skip
    assert len(images) == 2 and set(images.values()) == {NAMES["operator"]}, images
    (test_pod,) = [d for d in by_kind(docs, "Pod")]
    assert test_pod["spec"]["containers"][0]["image"] == NAMES["operator"]
    assert one(docs, "EnginePool")["spec"]["template"]["image"] in ENGINES


def test_every_sample_pool_runs_a_release_engine() -> None:
    pools = [
        d
        for p in sorted((REPO / "samples").glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d and d["kind"] == "EnginePool"
    ]
    assert pools
    for pool in pools:
        assert pool["spec"]["template"]["image"] in ENGINES, pool["metadata"]["name"]


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_written_image_reference_follows_the_scheme(path: Path) -> None:
    text = path.read_text()
    repositories = {NAMES[name].rsplit(":", 1)[0] for name in IMAGES}
    wrong = [m.group(0) for m in DASHED.finditer(text)]
    for m in SLASHED.finditer(text):
        repo, tag = m.group(1), m.group(2) or ""
        tag_ok = tag in ("", f":{APP_VERSION}", ":<appVersion>") or tag.startswith("@sha256:")
        if repo not in repositories or not tag_ok:
            wrong.append(m.group(0))
    assert not wrong, f"{path.name}: image references outside the release scheme: {wrong}"


def test_the_readme_installs_the_published_chart() -> None:
    argv = readme_install()
    ref = next(a for a in argv if a.startswith("oci://"))
    version = argv[argv.index("--version") + 1]
    assert f"{ref}:{version}" == NAMES["chart"]
