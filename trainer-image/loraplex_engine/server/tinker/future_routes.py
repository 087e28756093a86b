"""The SDK's batched future routes: ``/retrieve_futures`` (a sampling session's completion
queue, long-polled) and ``/cancel_future`` (drop an abandoned sample). The queues and
the cancel live in completions.py; these routes check the request and its namespace."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from loraplex_engine.server.tinker.completions import read_poll
from loraplex_engine.server.tinker.protocol import Protocol
from loraplex_engine.server.tinker.rest import Ns
from loraplex_engine.spec.errors import NotFoundError


def add_future_routes(r: APIRouter, proto: Protocol, long_poll_s: float) -> None:
    @r.post("/retrieve_futures")
    async def retrieve_futures(ns: Ns, body: dict[str, Any]) -> dict[str, Any]:
        poll = read_poll(ns, body, long_poll_s)
        try:  # the session must be this namespace's: another's is 404, as none
            proto.registry.sampler(ns, poll.target.sampling_session_id)
        except NotFoundError as e:
            raise NotFoundError(e.message, field="target.sampling_session_id") from None
        return await proto.completions.poll(poll)

    @r.post("/cancel_future")
    def cancel_future(ns: Ns, body: dict[str, Any]) -> dict[str, Any]:
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid or len(rid) > 200:
            raise NotFoundError(f"no request {str(rid)[:80]!r}", field="request_id")
        proto.completions.cancel(ns, rid)
        return {}
