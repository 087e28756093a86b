"""``--log-format``: the JSON lines (loraplex_engine/logs.py) and the libraries held quiet."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from loraplex_engine.logs import QUIET_LOGGERS, announce, setup_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, old in levels.items():
        logging.getLogger(name).setLevel(old)
    setup_state_text()


def setup_state_text() -> None:
    from loraplex_engine import logs

    logs._state["format"] = "text"
    logging.captureWarnings(False)


def test_json_lines_parse_with_extras_and_exceptions(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("json", "info", stream=out)
    log = logging.getLogger("loraplex_engine.test")
    log.info("hello %s", "world", extra={"request_id": "r1", "status": 200, "obj": object()})
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        log.exception("it failed")
    log.debug("not at info")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "hello world" and first["level"] == "INFO"
    assert first["logger"] == "loraplex_engine.test" and first["time"].endswith("+00:00")
    assert (first["request_id"], first["status"]) == ("r1", 200)
    assert "obj" not in first  # only plain extra values
    assert second["level"] == "ERROR" and "ValueError: bad\nthing" in second["exception"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_library_info_lines_are_dropped(fmt: str, restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging(fmt, "debug", stream=out)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).info('HTTP Request: POST http://x "HTTP/1.1 200 OK"')
    logging.getLogger("httpx").warning("a real problem")
    text = out.getvalue()
    assert "HTTP Request" not in text and "a real problem" in text


def test_announce_is_a_json_line_in_json(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("json", "error", stream=io.StringIO())
    announce("loraplex-engine ready: url=http://h:1 startup_s=1.0")
    line = capsys.readouterr().err.strip()
    assert json.loads(line)["message"] == "loraplex-engine ready: url=http://h:1 startup_s=1.0"


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        setup_logging("xml")
