"""Start ``loraplex-engine serve`` as a real subprocess on 127.0.0.1 and stop it.

Used by the engine server tests and (later) by operator tests that need a live engine::

    with EngineServer(model_dir, tmp_path / "ckpt", max_adapters=4) as srv:
        httpx.get(f"{srv.url}/v1/capacity", headers=srv.headers)

The server binds port 0 itself and prints the port it got, so parallel tests never race
for a port. Start-up waits on conditions only: the ``listening`` line on stderr, then the
``ready`` line, then one ``/readyz`` 200 (bounded by ``ready_timeout``); it fails fast,
with the log tail, if the process exits first. Output goes to ``<workdir>/server.log``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import child_processes
from tests.support.measurements import OUT, record_value

LISTEN_RE = re.compile(r"loraplex-engine listening: url=([^\s\"]+)")  # text or JSON line
READY_RE = re.compile(r"loraplex-engine ready: url=([^\s\"]+) startup_s=([0-9.]+)")


def engine_command() -> list[str]:
    exe = Path(sys.executable).with_name("loraplex-engine")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "loraplex_engine.cli"]


class EngineServer:
    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        checkpoint_root: str | os.PathLike[str],
        *,
        max_adapters: int | None = 4,
        max_rank: int | None = 16,
        token: str | None = None,
        auth: bool = True,
        rollout_backend: str = "torch",
        command: list[str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        threads: int = 1,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 120.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.checkpoint_root = Path(checkpoint_root)
        self.workdir = Path(workdir) if workdir else self.checkpoint_root.parent
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.auth = auth
        self.rollout_backend = rollout_backend
        self.command = command or engine_command()
        self.token = token or secrets.token_urlsafe(24)
        self.threads = threads
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.startup_s: float | None = None  # process start -> /readyz 200, seen from here
        self.reported_startup_s: float | None = None  # the server's own measure
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self.starts = 0

    # --- lifecycle ---

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.auth else {}

    @property
    def log_path(self) -> Path:
        return self.workdir / f"server-{self.starts}.log"

    def start(self) -> EngineServer:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        cmd, env = self.command_line(), self.process_env()
        with self._cond:
            self._lines = []
        self.url = ""
        t0 = time.monotonic()
        self.proc = child_processes.spawn(
            cmd,
            "engine " + str(self.workdir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(self.workdir),
        )
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        try:
            self.url = self._wait_for(LISTEN_RE, t0).group(1)
            ready = self._wait_for(READY_RE, t0)
            self.reported_startup_s = float(ready.group(2))
            self._wait_readyz(t0)
        except BaseException:
            self.kill()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def command_line(self) -> list[str]:
        """`loraplex-engine serve` with this server's flags (binds a free port itself)."""
        if self.auth:
            token_file = self.workdir / "token"
            token_file.write_text(self.token + "\n")
            token_file.chmod(0o600)
            auth_args = ["--token-file", str(token_file)]
        else:
            auth_args = ["--insecure-no-auth"]
        sizes = []
        if self.max_adapters is not None:
            sizes += ["--max-adapters", str(self.max_adapters)]
        if self.max_rank is not None:
            sizes += ["--max-rank", str(self.max_rank)]
        return [
            *self.command,
            "serve",
            "--model", str(self.model_dir),
            "--host", "127.0.0.1",
            "--port", "0",
            *auth_args,
            "--checkpoint-root", str(self.checkpoint_root),
            *sizes,
            "--rollout-backend", self.rollout_backend,
            "--device", "cpu",
            "--threads", str(self.threads),
            *self.extra_args,
        ]  # fmt: skip

    def process_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as log:
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace")
                log.write(line)
                log.flush()
                with self._cond:
                    self._lines.append(line)
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _wait_for(self, pattern: re.Pattern[str], t0: float) -> re.Match[str]:
        deadline = t0 + self.ready_timeout
        seen = 0
        with self._cond:
            while True:
                for line in self._lines[seen:]:
                    m = pattern.search(line)
                    if m:
                        return m
                seen = len(self._lines)
                if self.proc is None or self.proc.poll() is not None:
                    if self._reader is not None and self._reader.is_alive():
                        self._cond.wait(0.5)  # let the reader drain the last lines
                        if len(self._lines) > seen:
                            continue
                    raise RuntimeError(f"engine server exited early:\n{self.log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {pattern.pattern!r} in time:\n{self.log_tail()}")
                self._cond.wait(min(left, 1.0))

    def _wait_readyz(self, t0: float) -> None:
        # The ready line is printed after the loop started, so this answers at once; the
        # short retry only covers the line racing the first probe.
        delay = 0.01
        while True:
            r = httpx.get(f"{self.url}/readyz", timeout=10)
            if r.status_code == 200:
                return
            if time.monotonic() - t0 > self.ready_timeout:
                raise TimeoutError(f"/readyz stayed {r.status_code}:\n{self.log_tail()}")
            with self._cond:
                self._cond.wait(delay)
            delay = min(delay * 2, 0.5)

    def log_tail(self, n: int = 60) -> str:
        with self._cond:
            return "".join(self._lines[-n:])

    def log_text(self) -> str:
        with self._cond:
            return "".join(self._lines)

    def kill(self) -> None:
        """SIGKILL (kill -9) to the engine and anything it forked: no shutdown code runs,
        as when a node dies."""
        if self.proc is not None:
            child_processes.kill_group(self.proc)
        self._join_reader()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, as Kubernetes does; waits for a graceful exit, then kills."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        child_processes.kill_group(self.proc)  # past the grace period, or what it forked
        self._join_reader()
        return self.proc.returncode

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(10)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.kill()

    # --- HTTP helpers ---

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kw)


@contextlib.contextmanager
def tinker_engine(
    model_dir: Path,
    work: Path,
    keys: dict[str, str],
    *,
    max_adapters: int = 4,
    flags: Sequence[str] = (),
) -> Iterator[EngineServer]:
    """A real engine serving the Tinker API to the official SDK: ``keys`` (namespace ->
    its API key) in its ``--tinker-keys`` file, checkpoints and log under ``work``."""
    key_file = work / "keys.txt"
    key_file.write_text("".join(f"{ns} {key}\n" for ns, key in keys.items()))
    args = ["--tinker-keys", str(key_file), *flags]
    with EngineServer(
        model_dir, work / "ckpt", max_adapters=max_adapters, workdir=work, extra_args=args
    ) as srv:
        yield srv


def tinker_engine_fixture(
    name: str, keys: dict[str, str], *, max_adapters: int = 4, flags: Sequence[str] = ()
) -> Any:
    """A module's ``server`` fixture: one :func:`tinker_engine` for all the module's tests,
    under a temp dir ``name``."""

    @pytest.fixture(scope="module", name="server")
    def server(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[EngineServer]:
        work = tmp_path_factory.mktemp(name)
        with tinker_engine(
            tiny_model_dir, work, keys, max_adapters=max_adapters, flags=flags
        ) as srv:
            yield srv

    return server


def engine_api_fixture() -> Any:
    """A module's ``api`` fixture: an HTTP client of the engine its ``server`` fixture runs,
    one a test."""

    @pytest.fixture(name="api")
    def api(server: EngineServer) -> Iterator[httpx.Client]:
        with server.client() as c:
            yield c

    return api


def wait_until(
    condition: Callable[[], Any], *, timeout: float = 60.0, interval: float = 0.05
) -> Any:
    """Poll ``condition`` (e.g. a status read over HTTP) until truthy; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)


MEASUREMENTS = OUT / "engine-server-measurements.json"


def record_measurement(name: str, value: float | None, note: str = "") -> None:
    """Keep a number for the report (out/engine-server-measurements.json)."""
    record_value(MEASUREMENTS, name, value, note)
