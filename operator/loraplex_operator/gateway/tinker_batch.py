"""The SDK's batched future route through the gateway: ``retrieve_futures`` goes to
the engine of the sampling session it names. A completion's request id leaves as the
gateway's (``<engine pod>~<id>``), so the SDK's later ``retrieve_future`` or
``cancel_future`` (forwarding.py ``by_future_id``) finds the engine; the ids it reports
retrieved come back stripped to the engine's own.

The gateway's client config still tells the SDK to poll futures one by one (a session's
engine may change under client experiments, tinker_models.py); this route serves a
client that calls it anyway, by the same ids and namespace checks as the others.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loraplex_operator.gateway import routing
from loraplex_operator.gateway.forwarding import Forwarder, json_doc, not_found


async def retrieve_futures(
    forwarder: Forwarder, request: Request, ns: str, body: bytes
) -> Response:
    doc = json_doc(body)
    target = doc.get("target") if isinstance(doc.get("target"), dict) else {}
    ref = target.get("sampling_session_id")
    session = routing.session_of(ref if isinstance(ref, str) else None)
    engine = await forwarder.up.find_session(ns, session) if session else None
    if engine is None:
        return not_found(f"sampling session {ref!r}", "target.sampling_session_id")
    ids = doc.get("retrieved_request_ids")
    if isinstance(ids, list):  # the engine's own ids; another engine's are not its to drop
        mine = [routing.split_future_id(i) if isinstance(i, str) else None for i in ids]
        doc["retrieved_request_ids"] = [s[1] for s in mine if s and s[0] == engine.name]
    answer = await forwarder.forward(
        request, engine, ns, "retrieve_futures", json.dumps(doc).encode(), True
    )
    if answer.status_code != 200:
        return answer
    out = json.loads(bytes(answer.body))
    for c in out.get("completions") or []:
        if isinstance(c, dict) and isinstance(c.get("request_id"), str):
            c["request_id"] = routing.future_id(engine.name, c["request_id"])
    return JSONResponse(out)
