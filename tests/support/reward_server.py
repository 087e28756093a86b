"""A tenant's HTTP reward service on a loopback port: answers the engine's POST of
``{"items": [...]}`` with ``{"scores": score(path, items)}``. The score function is where a
test records what it was sent, waits, or answers by path (``/slow``, ``/huge``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Scorer = Callable[[str, list[dict[str, Any]]], list[Any]]


def reward_handler(score: Scorer) -> type[BaseHTTPRequestHandler]:
    class Rewards(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
            body = json.dumps({"scores": score(self.path, items)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Rewards


@contextmanager
def reward_server(score: Scorer) -> Iterator[str]:
    """The service, running for the block: its base URL (``http://127.0.0.1:<port>``)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), reward_handler(score))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        srv.server_close()
