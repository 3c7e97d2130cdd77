"""Liveness and readiness answered below the app, for probes that arrive past the connection cap.

A connection beyond ``max_connections`` is refused without reaching the app, except a ``GET`` of a
health route: a Kubernetes probe must not fail because idle or busy clients hold every connection
(issue 25). ``probe_answer`` gives the status and JSON body the health routers give
(``routers/health.py``, ``oip/routes.py``), from the request's first line and the service's phase.
"""

from __future__ import annotations

import json
from typing import Protocol

HEALTH_PATHS = frozenset({"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"})


class Readiness(Protocol):
    """What a probe reads of the service (``service.engine.state.ServiceState``)."""

    @property
    def ready(self) -> bool: ...

    phase: str


def probe_path(request_line: bytes) -> str | None:
    """The health route a request line asks for (``GET /health/live HTTP/1.1``), else None."""
    parts = request_line.split(b" ")
    if len(parts) != 3 or parts[0] != b"GET" or not parts[2].startswith(b"HTTP/1."):
        return None
    path = parts[1].split(b"?", 1)[0].decode("latin-1")
    return path if path in HEALTH_PATHS else None


def probe_answer(path: str, state: Readiness | None) -> tuple[int, bytes]:
    """Status and JSON body of a health route, as its router answers it."""
    ready = state is not None and state.ready
    if path == "/health/live":
        status, body = 200, {"status": "live", "ready": True}
    elif path == "/v2/health/live":
        status, body = 200, {"live": True}
    elif path == "/v2/health/ready":
        status, body = (200 if ready else 400), {"ready": ready}
    elif ready:
        status, body = 200, {"status": "ready", "ready": True}
    else:
        phase = "starting" if state is None else state.phase
        reason = {"starting": "starting", "ready": "unavailable"}.get(phase, "shutting_down")
        status, body = 503, {"status": reason, "ready": False}
    return status, json.dumps(body, separators=(",", ":")).encode()
