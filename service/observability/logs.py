"""Log lines: plain text (the default) or, with ``VITSERVE_LOG_FORMAT=json``, one JSON object per line
(python-json-logger), for vitserve's own logger and uvicorn's (its access log included).

Every JSON line carries ``time`` (ISO 8601, UTC), ``level``, ``logger`` and ``message``, plus the
``request_id`` of the request it was logged for (the ``X-Request-ID`` answered over HTTP, the
``x-request-id`` metadata over gRPC; null outside a request) and, while tracing (service/observability/tracing.py),
its ``trace_id`` and ``span_id``. The request id is kept in a context variable that the HTTP middleware
and the gRPC service set, so it reaches every line logged while the request is handled. uvicorn's
access lines also carry ``client``, ``method``, ``path`` and ``status``.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import sys
import time
from contextvars import ContextVar
from typing import Any

from service.observability import tracing

LOGGER = "vitserve"
TEXT_FORMAT = "%(levelname)-9s vitserve: %(message)s"
REQUEST_ID: ContextVar[str | None] = ContextVar("vitserve_request_id", default=None)
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id(incoming: str | None) -> str:
    """The client's request id when it is a plausible one (1-128 of ``A-Za-z0-9._:-``), else a new one."""
    return incoming if incoming and _VALID_REQUEST_ID.match(incoming) else os.urandom(16).hex()


class Throttle:
    """Whether a condition that keeps recurring is due to be logged again: the first time, then at
    most once every ``every_s`` seconds (what it counts is counted elsewhere, every time)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: float | None = None

    def due(self) -> bool:
        now = time.monotonic()
        if self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        return True


class ContextFilter(logging.Filter):
    """Adds the current request id and trace ids to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.trace_id, record.span_id = tracing.current_ids()
        args = record.args
        if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
            record.client, record.method, record.path, _, record.status = args  # uvicorn's fields
        return True


def json_formatter() -> logging.Formatter:
    from pythonjsonlogger.core import RESERVED_ATTRS
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(levelname)s %(name)s %(message)s %(request_id)s %(trace_id)s %(span_id)s",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],  # uvicorn's ANSI-coloured copy
    )


def configure(level: str, log_format: str) -> None:
    """vitserve's logger: to stderr, in ``log_format`` ('text' or 'json'), at ``level``."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(level.upper())
    ours = [h for h in logger.handlers if getattr(h, "vitserve", False)]
    handler = ours[0] if ours else logging.StreamHandler(sys.stderr)
    if not ours:
        handler.vitserve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    if log_format == "json":
        handler.setFormatter(json_formatter())
        handler.filters = [ContextFilter()]
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
        handler.filters = []
    logger.propagate = False


def uvicorn_log_config(log_format: str) -> dict[str, Any]:
    """uvicorn's ``log_config`` for ``python -m service``: its own for 'text', JSON lines for 'json'."""
    from uvicorn.config import LOGGING_CONFIG

    if log_format != "json":
        return copy.deepcopy(LOGGING_CONFIG)
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "json",
        "filters": ["context"],
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": ContextFilter}},
        "formatters": {"json": {"()": json_formatter}},
        "handlers": {
            "default": {**handler, "stream": "ext://sys.stderr"},
            "access": {**handler, "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False},
        },
    }
