"""JSON log lines (INFEROPS_LOG_FORMAT=json) for the gateway, the replicas and the control plane.

One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id where the
line belongs to a request, and exception when there is one. Standard library only, so the
gateway and the replica (runtime.engine) share it, and Django's LOGGING can name it too
(`"()": "runtime.gateway.jsonlog.JsonFormatter"`).
"""

from __future__ import annotations

import json
import logging
import os
from contextvars import ContextVar
from datetime import UTC, datetime

# The request the running coroutine serves; asyncio copies it into each request's task.
REQUEST_ID: ContextVar[str | None] = ContextVar("inferops_request_id", default=None)
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def request_id(self, record: logging.LogRecord) -> str | None:
        return getattr(record, "request_id", None) or REQUEST_ID.get()

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        request_id = self.request_id(record)
        if request_id:
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def json_logs() -> bool:
    return os.environ.get("INFEROPS_LOG_FORMAT", "").strip().lower() == "json"


def configure(level: str) -> bool:
    """Root logging for a data-plane process; True when the lines are JSON (then uvicorn must be
    started with log_config=None so its own loggers reach this handler instead of its console)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "inferops_console", False)]:
        root.removeHandler(old)  # a second call replaces the first; others' handlers (pytest's) stay
    handler = logging.StreamHandler()
    handler.inferops_console = True
    handler.setFormatter(JsonFormatter() if json_logs() else logging.Formatter(PLAIN_FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper())
    return json_logs()
