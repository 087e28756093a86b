"""The operator's log format: ``text`` (kopf's own, the default) or ``json``.

``json`` (``LORAPLEX_LOG_FORMAT=json``, the chart's ``operator.logFormat``, or
``python -m loraplex_operator --log-format json``) writes one JSON object per line:
``time`` (UTC, RFC 3339, ms), ``level``, ``logger``, ``message``, ``object`` (the
Kubernetes object a kopf handler logged about: kind, namespace, name, uid), and
``exception`` with a traceback: the engine's format (loraplex_engine/logs.py), so one
query reads both. It replaces the formatter of kopf's handler once kopf has set it up
(``configure``).

Either way the HTTP libraries are held at WARNING: httpx logs a line per request at
INFO, and the operator polls every engine every few seconds (engine_client.py).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
ENV = "LORAPLEX_LOG_FORMAT"
QUIET_LOGGERS = ("httpx", "httpcore", "urllib3", "aiohttp.access")
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
    "k8s_ref",
    "k8s_skip",
    "settings",
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
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, Mapping):
            out["object"] = {k: v for k, v in ref.items() if isinstance(v, _PLAIN)}
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in out and isinstance(value, _PLAIN):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def log_format(env: Mapping[str, str] = os.environ) -> str:
    """``LORAPLEX_LOG_FORMAT``; a value that is neither is logged and read as text."""
    value = env.get(ENV, "text").strip().lower() or "text"
    if value not in LOG_FORMATS:
        logging.getLogger("loraplex_operator").error(
            "%s=%r is not one of %s: logging as text", ENV, value, ", ".join(LOG_FORMATS)
        )
        return "text"
    return value


def quiet_libraries() -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def configure(fmt: str) -> None:
    """The libraries quiet; with ``json``, every root handler (kopf's) writes JSON lines.

    Called when the handlers module is imported (``kopf run`` has set up its logging by
    then, so its first lines are JSON already), again by the startup handler, and by
    ``python -m loraplex_operator`` after ``kopf.configure``; it adds no handler."""
    quiet_libraries()
    if fmt != "json":
        return
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonFormatter())
