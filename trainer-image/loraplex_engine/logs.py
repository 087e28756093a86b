"""The engine's logging: ``--log-format text`` (the default) or ``json``.

``json`` writes one JSON object per line to stderr: ``time`` (UTC, RFC 3339, ms),
``level``, ``logger``, ``message``, ``exception`` (the traceback, with one) and the
record's plain extra fields (the access log's ``method``, ``path``, ``status``,
``duration_ms``, ``request_id``: server/observe.py). Python warnings go through the same
handler (``py.warnings``).

Libraries that log every request or download at INFO are held at WARNING whatever the
level: ``httpx``/``httpcore`` (a reward or worker call per tick), ``urllib3``,
``transformers``, ``huggingface_hub``, ``filelock``; uvicorn's own access log is off
(server/observe.py's replaces it) and its other loggers propagate here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = (
    "httpx",
    "httpcore",
    "urllib3",
    "transformers",
    "huggingface_hub",
    "filelock",
    "uvicorn.access",
)
# Every attribute a LogRecord has of its own; anything else came as `extra`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's message with terminal colours
}
_PLAIN = (str, int, float, bool, type(None))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in out and isinstance(value, _PLAIN):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")


def setup_logging(
    log_format: str = "text", level: str = "info", stream: TextIO | None = None
) -> None:
    """The root logger's one handler (stderr) in ``log_format``, at ``level``; the noisy
    libraries at WARNING."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    quiet_libraries()
    logging.captureWarnings(True)
    _state["format"] = log_format


def quiet_libraries() -> None:
    """The libraries' per-request INFO lines and progress bars off; transformers' own
    stderr handler dropped so its warnings reach ours (a no-op until it is imported)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    tf = sys.modules.get("transformers.utils.logging")
    if tf is not None:
        tf.disable_default_handler()
        tf.enable_propagation()
        tf.set_verbosity_warning()
        tf.disable_progress_bar()  # "Loading weights: 0%|..." is no log line


_state: dict[str, str] = {"format": "text"}


def announce(line: str, logger: str = "loraplex_engine") -> None:
    """A line tests and humans wait for (``loraplex-engine ready: ...``), whatever the
    level: as is in text, as a JSON object (``message`` = the line) in json."""
    if _state["format"] == "json":
        record = logging.LogRecord(logger, logging.INFO, "", 0, line, (), None)
        line = JsonFormatter().format(record)
    print(line, file=sys.stderr, flush=True)
