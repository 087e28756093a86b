"""One experiment's HTTP exchanges with its tenant's reward service, bounded in time,
size and lifetime (docs/architecture.md, "Tenancy and trust"):

- **a deadline for the whole exchange** (``timeout_s``, default REWARD_TIMEOUT_S):
  connect, send, headers and body together. A per-read timeout is no bound: a service
  that trickles one byte a second never trips it. Every socket operation here waits at
  most for what is left of the deadline, so no watchdog thread is needed;
- **a size cap on the answer** (``max_bytes``, default MAX_REWARD_ANSWER_BYTES): a
  Content-Length over it is refused before the body is read, a chunked body as soon as
  the cap is passed; the body is never decompressed (no Accept-Encoding is sent);
- **close() ends a call in flight**: it shuts the sockets down (``shutdown``, not just
  ``close``: on Linux only a shutdown wakes a thread blocked in ``recv``), so the thread
  of a deleted experiment's reward returns now instead of when its service lets go.

httpcore directly, not httpx: its public NetworkBackend hook is what lets every socket
operation see the deadline and lets close() find the sockets.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import httpcore

from loraplex_engine.spec.errors import ExchangeError

REWARD_TIMEOUT_S = 30.0
# Scores for the largest step (--max-step-tokens bounds its rows to thousands) are tens of
# kilobytes of JSON; a mebibyte leaves room for an answer that echoes its items.
MAX_REWARD_ANSWER_BYTES = 1 << 20


class _Clock:
    """The deadline of the exchange the calling thread is in (None: none running)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextmanager
    def running(self, seconds: float) -> Iterator[None]:
        self._local.deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self._local.deadline = None

    def left(self, timeout: float | None, expired: type[Exception]) -> float | None:
        """``timeout`` cut to what is left of the deadline; ``expired`` raised if none is."""
        deadline = getattr(self._local, "deadline", None)
        if deadline is None:
            return timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise expired("the reward exchange's deadline passed")
        return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, owner: _Backend) -> None:
        self._inner = inner
        self._owner = owner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._owner.clock.left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._owner.clock.left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._owner.forget(self)
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        left = self._owner.clock.left(timeout, httpcore.ConnectTimeout)
        self._inner = self._inner.start_tls(ssl_context, server_hostname, left)
        return self

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)

    def shutdown(self) -> None:
        sock = self._inner.get_extra_info("socket")
        if isinstance(sock, socket.socket):
            with suppress(OSError):  # already closed or never connected
                sock.shutdown(socket.SHUT_RDWR)


class _Backend(httpcore.NetworkBackend):
    """httpcore's sync backend with every stream on the clock and known to ``abort``."""

    def __init__(self) -> None:
        self.clock = _Clock()
        self._inner = httpcore.SyncBackend()
        self._streams: set[_Stream] = set()
        self._lock = threading.Lock()
        self._aborted = False

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = self.clock.left(timeout, httpcore.ConnectTimeout)
        stream = _Stream(
            self._inner.connect_tcp(host, port, left, local_address, socket_options), self
        )
        with self._lock:
            aborted = self._aborted
            if not aborted:
                self._streams.add(stream)
        if aborted:  # closed while connecting: this connection must not outlive it
            stream.close()
            raise httpcore.ConnectError("the reward client was closed")
        return stream

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("reward services are reached over TCP only")

    def forget(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            streams = list(self._streams)
        for stream in streams:
            stream.shutdown()


class RewardClient:
    """POSTs to one reward service, each exchange bounded (module docstring). Thread-safe;
    one per experiment, so close() ends only that experiment's calls."""

    def __init__(
        self, timeout_s: float = REWARD_TIMEOUT_S, max_bytes: int = MAX_REWARD_ANSWER_BYTES
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._backend = _Backend()
        # retries=0: a failed connect is the service's answer; one keep-alive connection
        # (an experiment has one call in flight at a time).
        self._pool = httpcore.ConnectionPool(
            network_backend=self._backend, max_keepalive_connections=1, retries=0
        )
        self.closed = False

    def post(
        self, url: str, body: bytes, headers: list[tuple[str, str]], sni_hostname: str | None
    ) -> tuple[int, bytes]:
        """``(status, body)``; the body is read only for a 200. ExchangeError otherwise."""
        if self.closed:
            raise ExchangeError("was closed: its experiment was removed")
        t = self.timeout_s
        extensions: dict[str, Any] = {"timeout": {"connect": t, "read": t, "write": t, "pool": t}}
        if sni_hostname:
            extensions["sni_hostname"] = sni_hostname
        try:
            with (
                self._backend.clock.running(t),
                self._pool.stream(
                    "POST", url, headers=headers, content=body, extensions=extensions
                ) as resp,
            ):
                if resp.status != 200:
                    return resp.status, b""  # not read: its text must not reach status
                return 200, self._read_capped(resp)
        except httpcore.TimeoutException:
            raise ExchangeError(f"did not answer in full within its deadline of {t:g}s") from None
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as e:
            if self.closed:
                raise ExchangeError("was closed: its experiment was removed") from None
            raise ExchangeError(f"unreachable ({type(e).__name__})") from None

    def _read_capped(self, resp: httpcore.Response) -> bytes:
        too_big = ExchangeError(f"answered more than the limit of {self.max_bytes} bytes")
        for name, value in resp.headers:
            if (
                name.lower() == b"content-length"
                and value.isdigit()
                and int(value) > self.max_bytes
            ):
                raise too_big  # refused before one byte of the body is read
        chunks: list[bytes] = []
        size = 0
        for chunk in resp.iter_stream():
            size += len(chunk)
            if size > self.max_bytes:
                raise too_big  # the connection is dropped unread (the exchange's exit)
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """End every exchange in flight (its thread returns an ExchangeError) and release
        the connections."""
        self.closed = True
        self._backend.abort()
        self._pool.close()
