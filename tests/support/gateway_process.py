"""Start ``python -m loraplex_operator.gateway`` as a real subprocess on 127.0.0.1 (port 0,
the port it got read from its ``listening`` line) with an ``--engines-file``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support import child_processes
from tests.support.paths import REPO_ROOT

LISTEN_RE = re.compile(rb"loraplex-gateway listening: url=(\S+)")


class GatewayProcess:
    def __init__(self, workdir: Path, view: dict[str, Any], *extra: str) -> None:
        self.workdir = workdir
        self.file = workdir / "engines.json"
        self.extra = list(extra)
        self.write(view)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.lines: list[bytes] = []

    def write(self, view: dict[str, Any]) -> None:
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(view))
        os.replace(tmp, self.file)

    def start(self) -> GatewayProcess:
        path = os.pathsep.join(str(REPO_ROOT / p) for p in ("operator", "trainer-image", "."))
        cmd = [sys.executable, "-m", "loraplex_operator.gateway", "--host", "127.0.0.1"]
        cmd += ["--port", "0", "--engines-file", str(self.file), *self.extra]
        self.proc = child_processes.spawn(
            cmd,
            "gateway " + str(self.workdir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
            cwd=str(self.workdir),
        )
        found = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = LISTEN_RE.search(line)
                if m and not found.is_set():
                    self.url = m.group(1).decode()
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(60):
            self.stop()
            raise RuntimeError(b"".join(self.lines[-40:]).decode(errors="replace"))
        deadline = time.monotonic() + 30
        while httpx.get(self.url + "/readyz").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("gateway not ready")
            time.sleep(0.1)
        return self

    def log(self) -> str:
        return b"".join(self.lines).decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
