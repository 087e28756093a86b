"""The SDK's batched future routes through the gateway: ``cancel_future`` goes to the
engine written in the future's id, ``retrieve_futures`` to the engine of the sampling
session it names. A completion's request id leaves as the gateway's
(``<engine pod>~<id>``), so the SDK's later ``retrieve_future`` finds the engine; the
ids it reports retrieved come back stripped to the engine's own.

The gateway's client config still tells the SDK to poll futures one by one (a session's
engine may change under client experiments, tinker_models.py); these routes serve a
client that calls them anyway, by the same ids and namespace checks as the others.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loraplex_operator.gateway import routing

if TYPE_CHECKING:
    from loraplex_operator.gateway.tinker import Tinker


def _json(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


async def cancel_future(tinker: Tinker, request: Request, ns: str, body: bytes) -> Response:
    from loraplex_operator.gateway.tinker import not_found

    doc = _json(body)
    given = doc.get("request_id")
    split = routing.split_future_id(given) if isinstance(given, str) else None
    engine = tinker.up.directory.engine(split[0]) if split else None
    if split is None or engine is None:
        return not_found(f"request {given!r} (unknown, or its engine is gone)", "request_id")
    forwarded = json.dumps({**doc, "request_id": split[1]}).encode()
    return await tinker._forward(request, engine, ns, "cancel_future", forwarded, True)


async def retrieve_futures(tinker: Tinker, request: Request, ns: str, body: bytes) -> Response:
    from loraplex_operator.gateway.tinker import not_found

    doc = _json(body)
    target = doc.get("target") if isinstance(doc.get("target"), dict) else {}
    ref = target.get("sampling_session_id")
    session = routing.session_of(ref if isinstance(ref, str) else None)
    engine = await tinker.up.find_session(ns, session) if session else None
    if engine is None:
        return not_found(f"sampling session {ref!r}", "target.sampling_session_id")
    ids = doc.get("retrieved_request_ids")
    if isinstance(ids, list):  # the engine's own ids; another engine's are not its to drop
        mine = [routing.split_future_id(i) if isinstance(i, str) else None for i in ids]
        doc["retrieved_request_ids"] = [s[1] for s in mine if s and s[0] == engine.name]
    answer = await tinker._forward(
        request, engine, ns, "retrieve_futures", json.dumps(doc).encode(), True
    )
    if answer.status_code != 200:
        return answer
    out = json.loads(bytes(answer.body))
    for c in out.get("completions") or []:
        if isinstance(c, dict) and isinstance(c.get("request_id"), str):
            c["request_id"] = routing.future_id(engine.name, c["request_id"])
    return JSONResponse(out)
