"""The HTTP app's own route table, for tests that must cover every /v1 route.

Read from the app rather than listed by hand, so a route added later is covered by
those tests without anyone remembering to add it.
"""

from __future__ import annotations

from fastapi import FastAPI


def v1_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every /v1 route."""
    out = []
    for route in app.routes:
        path = getattr(route, "path", "")
        if path.startswith("/v1"):
            for method in sorted(getattr(route, "methods", ()) or ()):
                if method != "HEAD":
                    out.append((method, path))
    return out
