"""`loraplex-engine plugins` lists what a spec may name without starting a server: the
built-in rewards and the reward and environment plug-ins installed for real (the test
plug-in package, pip-installed by tests/support/plugin_install.py and put on the CLI's
PYTHONPATH, as `pip install` puts a platform's package in the engine's environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import loraplex_engine
from loraplex_engine.tasks.rewards import BUILTIN_REWARDS

from tests.support.import_probe import parser_imports
from tests.support.plugin_install import with_path

SOURCE = str(Path(loraplex_engine.__file__).resolve().parents[1])


def plugins_cli(*args: str, sites: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **with_path(*sites)}
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], SOURCE])
    cmd = [sys.executable, "-m", "loraplex_engine.cli", "plugins", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_plugins_lists_the_installed_and_builtin_names(plugins_site: Path) -> None:
    done = plugins_cli("--json", sites=(plugins_site,))
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    assert listing["builtinRewards"] == sorted(BUILTIN_REWARDS)
    assert {"says-target", "raises", "broken"} <= set(listing["rewards"])
    assert {"word-tool", "never-ends"} <= set(listing["environments"])
    text = plugins_cli(sites=(plugins_site,))
    assert text.returncode == 0, text.stderr
    assert "  says-target\n" in text.stdout and "  word-tool\n" in text.stdout
    assert "  exact-match\n" in text.stdout


def test_without_the_package_its_plugins_are_not_listed() -> None:
    done = plugins_cli("--json")
    assert done.returncode == 0, done.stderr
    assert "says-target" not in json.loads(done.stdout)["rewards"]


def test_the_parser_is_built_without_importing_the_tasks() -> None:
    """`loraplex-engine --help` builds this command's parser too: the tasks package (every
    built-in task, numpy) is imported only when the command lists the built-in rewards."""
    assert parser_imports("loraplex_engine.tasks") == []
