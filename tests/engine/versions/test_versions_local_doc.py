"""docs/versions.md's local cycle, run as the page writes it: its three code blocks (a
`loraplex-engine run` with spec.publish, a `loraplex-engine serve` on its checkpoint
root, and the Python that loads, publishes, moves `stable` and samples with the official
`openai` client) are read from the page, so the page stays true, and run as real
processes in a scratch directory holding the checkout's samples, model and venv. Only
the port is changed (a free one, not 8000)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import loraplex_engine
import pytest

from tests.support import child_processes
from tests.support.server_process import wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SOURCE = str(Path(loraplex_engine.__file__).resolve().parents[1])
SECTION = "## Locally: train, serve, publish, roll back"
# Bounds on a loaded 2-core machine, not speed expectations.
RUN_S, START_S, CLIENT_S = 600.0, 300.0, 300.0


def section_blocks() -> list[tuple[str, str]]:
    """(language, text) of each code block of the page's local section, in order."""
    page = (REPO / "docs" / "versions.md").read_text()
    section = page.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shell_line(block: str) -> str:
    """A bash block as one command line (its continuations joined)."""
    return block.replace("\\\n", " ").strip()


def test_the_pages_local_cycle_publishes_aliases_and_serves(tmp_path: Path) -> None:
    blocks = section_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "python"]
    train, serve, client = (text for _, text in blocks)
    for name in ("samples", ".cache", ".venv"):  # the checkout's, as the page assumes
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "PYTHONPATH": SOURCE}
    done = subprocess.run(
        shell_line(train), shell=True, cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    versions = tmp_path / "out/versions/checkpoints/default/say-yes/_versions"
    assert sorted(p.name for p in versions.glob("v*")) == ["v1", "v2", "v3"]

    port = free_port()
    serve_line = shell_line(serve).removesuffix("&").replace("--port 8000", f"--port {port}")
    assert str(port) in serve_line
    log = (tmp_path / "serve.log").open("wb")
    out = {"stdout": log, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
    proc = child_processes.spawn(["bash", "-c", serve_line], "serve", cwd=tmp_path, env=env, **out)
    try:

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).is_success
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=START_S, interval=0.5)
        script = client.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        ran = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=CLIENT_S,
        )  # fmt: skip
    finally:
        child_processes.kill_group(proc)
        log.close()
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.splitlines()
    assert lines[:3] == [
        "loaded at step 6",
        "published v4",
        "aliases {'latest': 'v4', 'stable': 'v2'}",
    ], ran.stdout
    assert lines[3].startswith("default.say-yes@v3 ") and lines[4].startswith(
        "default.say-yes:stable "
    ), ran.stdout
    assert (versions / "v4" / "adapter_model.safetensors").is_file()
    served = (tmp_path / "serve.log").read_text()
    assert "version default.say-yes@v2#" in served and "version default.say-yes@v3#" in served
