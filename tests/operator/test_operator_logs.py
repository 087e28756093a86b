"""The operator's ``LORAPLEX_LOG_FORMAT`` (loraplex_operator/logs.py): JSON lines with the
Kubernetes object kopf logged about, and httpx's per-request INFO lines held back."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from loraplex_operator import logs


@pytest.fixture
def root_handler() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    # An in-process operator of an earlier test leaves kopf's event poster on kopf.objects;
    # its filter reads real kopf settings, which this record's stand-in is not.
    objects = logging.getLogger("kopf.objects")
    saved_objects = objects.handlers[:]
    objects.handlers[:] = []
    out = io.StringIO()
    root.handlers[:] = [logging.StreamHandler(out)]  # as kopf's configure leaves it
    root.setLevel(logging.INFO)
    yield out
    root.handlers[:] = saved
    root.setLevel(level)
    objects.handlers[:] = saved_objects


def test_json_lines_carry_the_object_and_the_exception(root_handler: io.StringIO) -> None:
    logs.configure("json")
    ref = {"apiVersion": "loraplex.dev/v1alpha1", "kind": "LoRAExperiment",
           "namespace": "team-a", "name": "x", "uid": "u-1"}  # fmt: skip
    log = logging.getLogger("kopf.objects")
    log.info("placed on %s", "engine-0", extra={"k8s_ref": ref, "settings": object()})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("loraplex_operator").exception("round failed")
    first, second = (json.loads(line) for line in root_handler.getvalue().splitlines())
    assert {"time", "level", "logger", "message"} <= set(first)
    assert first["message"] == "placed on engine-0" and first["object"]["name"] == "x"
    assert "settings" not in first
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]


def test_httpx_request_lines_are_dropped_at_the_source(root_handler: io.StringIO) -> None:
    import loraplex_operator.engine_client  # noqa: F401  quiets httpx on import

    logs.configure("text")
    logging.getLogger("httpx").info('HTTP Request: GET http://e:8000/v1/experiments "200 OK"')
    logging.getLogger("httpx").warning("kept")
    assert "HTTP Request" not in root_handler.getvalue()
    assert "kept" in root_handler.getvalue()


def test_the_format_comes_from_the_environment() -> None:
    assert logs.log_format({}) == "text"
    assert logs.log_format({"LORAPLEX_LOG_FORMAT": "JSON"}) == "json"
    assert logs.log_format({"LORAPLEX_LOG_FORMAT": "xml"}) == "text"  # logged, not fatal
