"""The test plug-in package (tests/plugins/loraplex_test_plugins) installed for real: ``pip
install --target`` a directory, as a platform's image installs its own package (there
into site-packages), and the engine under test gets that directory on its PYTHONPATH, so
``importlib.metadata`` finds its entry points the way it finds any installed package's.
The ``plugins_site`` fixture (tests/conftest.py): a directory per test session, not the
shared venv: no other test's engine sees these plug-ins (hostile ones among them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "tests" / "plugins" / "loraplex_test_plugins"
SAMPLE = REPO_ROOT / "samples" / "plugins" / "acme_rewards"
ENGINE = REPO_ROOT / "trainer-image"


def install(work: Path, package: Path = PACKAGE) -> Path:
    """Install ``package`` under ``work``; returns the directory to put on PYTHONPATH."""
    source, target = work / "source", work / "site"
    # A copy: building in place would leave build/ and egg-info in the repository.
    shutil.copytree(
        package, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    flags = ["--no-deps", "--no-build-isolation", "--no-index", "--target", str(target)]
    subprocess.run([*pip, *flags, str(source)], check=True, timeout=300)
    return target


def install_engine_metadata(work: Path) -> Path:
    """The engine's own distribution as this tree declares it (its first-party plug-ins'
    entry points, trainer-image/pyproject.toml), installed under ``work`` with its code
    removed: what an editable install is, metadata here and the code where PYTHONPATH
    finds it. The shared venv's install may predate this tree's entry points; first on
    the path, this one is what ``importlib.metadata`` reads."""
    site = install(work, ENGINE)
    shutil.rmtree(site / "loraplex_engine")
    shutil.rmtree(site / "bin", ignore_errors=True)
    return site


def with_path(*sites: Path) -> dict[str, str]:
    """Environment variables for an engine process that sees the installed plug-ins."""
    paths = [str(site) for site in sites]
    return {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
