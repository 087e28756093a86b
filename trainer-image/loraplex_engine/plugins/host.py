"""The engine's side of an experiment's plug-in worker (worker.py): calls with a
wall-clock bound.

Why a process per experiment, not a thread: a Python thread cannot be stopped, so a
plug-in that hangs (an endless loop, a regex gone exponential on a tenant's completion)
would hold its thread, and a spinning one a share of the GIL, for the engine's life.
A process is killed at the bound, with its process group (a plug-in's own children,
a tool's subprocess), and the experiment fails with the reason; nothing leaks. A call
costs one pipe round trip of JSON, batched: one call per experiment and tick for a
reward, per turn for an environment (measured, a loaded 2-core machine: 0.13 ms for 32
completions, 0.3 ms for a turn of 32 skyrl-gym episodes); the worker costs a Python
interpreter with the plug-in imported (18 MB RSS for a plain function, 112 MB with
skyrl-gym and its pandas), only for experiments that name a plug-in, at most one per
adapter slot. Per experiment, not shared: one tenant's
hang or crash cannot delay or fail another's calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from loraplex_engine.spec.api_types import CALL_TIMEOUT_S
from loraplex_engine.spec.errors import PluginError

START_TIMEOUT_S = 60.0  # the worker's start-up, importing the plug-in, on top of a call's
MAX_ANSWER_BYTES = 16 << 20


class PluginHost:
    """One experiment's worker for ``plugin`` (``reward:NAME`` or ``environment:NAME``):
    started at once (its import overlaps admission and is bounded by START_TIMEOUT_S, on
    top of the first call's bound), killed on a timeout, a broken answer or
    :meth:`close`. Calls are serialised."""

    def __init__(self, owner: str, plugin: str, timeout: float = CALL_TIMEOUT_S) -> None:
        self.owner, self.timeout = owner, timeout
        self._lock = threading.Lock()
        self._buf = b""
        self._dead: str | None = None
        self._ready = False
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "loraplex_engine.environments.worker", plugin],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group: killed whole
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def call(self, what: str, request: dict[str, Any]) -> dict[str, Any]:
        """The worker's answer to ``request``; ``PluginError`` naming ``what`` when the
        plug-in raised, did not answer within the bound or broke the exchange."""
        with self._lock:
            if self._dead is not None:
                raise PluginError(f"{what}: {self._dead}")
            deadline = time.monotonic() + self.timeout
            try:
                if not self._ready:
                    ready = json.loads(self._read_line(deadline + START_TIMEOUT_S, what))
                    if not ready.get("ok"):
                        raise PluginError(f"{what} failed to load: {ready.get('error')}")
                    self._ready = True
                    deadline = time.monotonic() + self.timeout  # the call's own bound
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
                answer = json.loads(self._read_line(deadline, what))
            except PluginError as e:
                self._kill(str(e).removeprefix(f"{what}: "))
                raise
            except (OSError, ValueError) as e:  # a dead pipe, a garbled answer
                self._kill(f"its worker failed ({type(e).__name__})")
                raise PluginError(f"{what}: its worker failed ({type(e).__name__})") from None
        if not isinstance(answer, dict) or not answer.get("ok"):
            error = answer.get("error") if isinstance(answer, dict) else None
            raise PluginError(f"{what} raised {error}")
        return answer

    def _read_line(self, deadline: float, what: str) -> bytes:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PluginError(f"{what} did not answer within {self.timeout:g}s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                code = self._proc.poll()
                raise PluginError(f"{what}: its worker exited (code {code})")
            self._buf += chunk
            if len(self._buf) > MAX_ANSWER_BYTES:
                raise PluginError(f"{what} answered over {MAX_ANSWER_BYTES >> 20} MiB")
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _kill(self, why: str) -> None:
        self._dead = f"its worker was stopped ({why})"
        self._signal()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()

    def _signal(self) -> None:
        # Only while not reaped: a reaped worker's id may be another process's by now.
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop the worker (a call in flight on another thread fails at once)."""
        if self._dead is None:
            self._dead = "its worker was stopped (the experiment was removed)"
        self._signal()
        with self._lock:  # the call in flight, if any, saw EOF and returned
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()
