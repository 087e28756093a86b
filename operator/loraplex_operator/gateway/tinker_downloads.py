"""Checkpoint downloads through the gateway: ``tinker checkpoint download`` and
``RestClient.get_external_weights_urls``.

The engine signs one download URL per file of an external weights checkpoint (HMAC over
namespace, path, file and expiry; loraplex_engine/server/tinker/checkpoint_routes.py) and
writes its own address into them, which a client outside the cluster cannot reach. So
the gateway answers the signing route with the same URLs on its own address, and
forwards a fetch of one (``external_weights_files/<ns>/<run>/<kind>/<name>/<file>``) to
the engine holding the run, streaming the file back.

The SDK fetches those URLs with no API key (as from a storage bucket): the signature is
the credential, checked by the engine that made it, so a URL whose namespace, path, file
or expiry was changed answers 401. Only a key of the namespace gets URLs signed (another
namespace's run is not found), and a fetch that does carry a key of another namespace
is refused here (404) before any engine sees it.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from loraplex_operator.gateway import proxy, routing
from loraplex_operator.gateway.forwarding import Forwarder
from loraplex_operator.gateway.keys import Key
from loraplex_operator.gateway.paths import TinkerCall
from loraplex_operator.gateway.upstream import Upstream, checked, engine_headers

FILES = "external_weights_files"  # the engine's download route (its first segment)
URLS_SUFFIX = "/external_weights_urls"  # the signing route's last segment
# Headers of the engine's file answer passed on (the SDK reads Content-Length).
FILE_HEADERS = ("content-type", "content-length", "content-encoding", "etag", "last-modified")


def is_download(call: TinkerCall) -> bool:
    return call.name.split("/", 1)[0] == FILES


def on_gateway(answer: bytes, gateway_base: str) -> bytes | None:
    """The engine's signed-URL answer with every download URL on the gateway's address
    (``gateway_base``); None when it is not such an answer (passed on as it came)."""
    try:
        doc = json.loads(answer)
    except ValueError:
        return None
    urls = doc.get("urls") if isinstance(doc, dict) else None
    if not isinstance(urls, dict):
        return None
    moved = {}
    for file, url in urls.items():
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or not parts.path.startswith(f"/api/v1/{FILES}/"):
            return None  # not the engine's download route: never point the client at it
        moved[file] = f"{gateway_base.rstrip('/')}{parts.path}?{parts.query}"
    return json.dumps({**doc, "urls": moved}).encode()


async def signed_urls(forwarder: Forwarder, request: Request, ns: str, route: str) -> Response:
    """The signing route, forwarded to the run's engine, its URLs moved to the gateway."""
    run = route.split("/")[1]
    answer = await forwarder.to_session(request, ns, route, b"", run, "training_run_id")
    if answer.status_code != 200:
        return answer
    moved = on_gateway(bytes(answer.body), str(request.base_url))
    if moved is None:
        return proxy.error(502, "bad_gateway", "the engine's download URLs were not its own")
    return Response(moved, 200, media_type="application/json")


async def download(up: Upstream, request: Request, key: Key | None, call: TinkerCall) -> Response:
    """One file of a signed URL, streamed from the engine holding the run."""
    ns, run = call.ids[0], call.ids[1]
    if key is not None and key.namespace != ns:
        return proxy.error(404, "not_found", "no such checkpoint file for this API key", "path")
    session = routing.session_of(run)
    engine = await up.find_session(ns, session) if session else None
    if engine is None:
        return proxy.error(404, "not_found", f"no training run {run!r}", "path")
    client = up.client
    upstream = client.build_request(
        "GET",
        engine.url + checked(f"/api/v1/{call.route}"),
        params=dict(request.query_params),
        headers=engine_headers(engine, ns),
    )
    try:
        r = await client.send(upstream, stream=True)
    except httpx.TransportError as e:
        up.forget(engine)
        return proxy.lost(engine, e)
    if r.status_code != 200:
        await r.aread()
        await r.aclose()
        return proxy.passed(r)
    headers = {k: v for k in FILE_HEADERS if (v := r.headers.get(k)) is not None}
    done = BackgroundTask(r.aclose)
    return StreamingResponse(r.aiter_raw(), 200, headers=headers, background=done)
