"""Signed checkpoint download URLs through the gateway (gateway/tinker_downloads.py):
the engine's URLs are moved onto the gateway's address, path and signature unchanged,
and an answer whose URLs are not the engine's download route is never passed on. Pure:
the live download is tests/engine/server/test_gateway_live.py's."""

from __future__ import annotations

import json

from loraplex_operator.gateway.tinker_downloads import on_gateway

ENGINE = "http://10.0.0.7:8000"
FILE = "/api/v1/external_weights_files/team-a/s01:train:0/external_weights/x/a.json"
QUERY = "expires=1900000000&signature=abc"


def test_urls_move_to_the_gateway_with_path_and_signature_kept() -> None:
    answer = {"urls": {"a.json": f"{ENGINE}{FILE}?{QUERY}"}, "expires": "2030-01-01T00:00:00"}
    moved = on_gateway(json.dumps(answer).encode(), "https://gw.example/")
    assert moved is not None
    doc = json.loads(moved)
    assert doc["urls"] == {"a.json": f"https://gw.example{FILE}?{QUERY}"}
    assert doc["expires"] == answer["expires"]


def test_other_answers_are_not_rewritten() -> None:
    elsewhere = {"urls": {"a.json": f"{ENGINE}/v1/experiments?x=1"}}
    assert on_gateway(json.dumps(elsewhere).encode(), "https://gw.example") is None
    assert on_gateway(b"not json", "https://gw.example") is None
    assert on_gateway(b'{"urls": ["x"]}', "https://gw.example") is None
