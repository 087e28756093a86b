"""Pure ASGI middleware in front of the whole HTTP app: bearer auth and a body limit.

Both run before routing, so a route added later cannot be left open by mistake, and a
rejected request never reaches the engine.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex_engine.server.errors import error_json, error_response
from loraplex_engine.spec.errors import BodyTooLargeError, UnauthorizedError

NAMESPACE_HEADER = b"x-loraplex-namespace"  # server/tinker/keys.py's, as ASGI spells headers

# Probes, metrics and the schema stay open: kubelet holds no token; /metrics answers
# tenants' series only to the token (server/metrics_access.py).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})


class BearerAuth:
    """Rejects every non-open path without the right bearer token (constant-time).

    ``tenant_prefix``: paths under it (the Tinker routes, ``/api/v1/``) authenticate
    in the routes (server/tinker/rest.py): with a tenant's own API key, or with this token and
    ``X-Loraplex-Namespace`` (a gateway acting for a namespace). A request that names a
    namespace in that header without this token is refused here, on every path, so a
    tenant key can never claim a namespace. A request with that header is a tenant's,
    whatever its token: outside the tenant routes (the admin API, the OpenAI routes) it
    is refused (403), so a path that reached this engine other than the gateway meant
    (a dot segment resolved on the way) never opens the admin API."""

    def __init__(self, app: ASGIApp, token: str, tenant_prefix: str | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.tenant_prefix = tenant_prefix

    def _tenant(self, path: str) -> bool:
        if self.tenant_prefix is None or not path.startswith(self.tenant_prefix):
            return False
        return not any(s in (".", "..") for s in path.split("/"))

    def _open(self, path: str) -> bool:
        return path in OPEN_PATHS or self._tenant(path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given, delegated = b"", False
        for key, value in scope["headers"]:
            if key == b"authorization" and not given:
                given = value
            elif key == NAMESPACE_HEADER:
                delegated = True
        if delegated or not self._open(scope["path"]):
            # Scheme is case-insensitive (RFC 7235); the token itself is compared exactly.
            if given[:7].lower() == b"bearer ":
                given = b"Bearer " + given[7:].strip()
            if not hmac.compare_digest(given, self.expected):
                error = UnauthorizedError("missing or wrong bearer token")
                response = error_response(error, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        if delegated and not self._tenant(scope["path"]):
            message = (
                "X-Loraplex-Namespace (a tenant's request) is accepted on the Tinker routes only"
            )
            response = error_json("forbidden", message, "X-Loraplex-Namespace", 403)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` with 413 before they are read whole (by
    Content-Length, or by counting a chunked body as it arrives)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = int(value) if value.isdigit() else None
        if length is not None and length > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(f"request body over {self.max_bytes} bytes")
            return message

        await self.app(scope, counting_receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = BodyTooLargeError(f"request body over {self.max_bytes} bytes")
        await error_response(error)(scope, receive, send)
