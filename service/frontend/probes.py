"""Liveness and readiness answered below the app, for probes that must not wait for busy clients.

- On the main port, a connection beyond ``max_connections`` is refused without reaching the app,
  except a ``GET`` of a health route (``server.py``): a probe must not fail because idle or busy
  clients hold every connection (docs/decisions.md#hostile-clients).
- ``health_port`` (off unless set) serves only the health routes, from a thread that is not the
  event loop's: :class:`ProbeListener`. Under ``python -m service`` with front-end processes it runs
  in the supervisor (``service/launcher/health.py`` says what it answers there); in a single process
  (``workers=0``), beside the event loop, whose liveness it follows (:class:`EventLoopHealth`: it
  fails once the loop has not ticked for ``STALL_S``).

``probe_answer`` gives the status and JSON body the health routers give (``routers/health.py``,
``oip/routes.py``) from the service's phase.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Protocol

PROBE_TIMEOUT_S = 1.0  # a probe connection must send its request within this (one at a time)
STALL_S = 10.0  # health_port's liveness fails once the event loop has not ticked for this long
HEALTH_PATHS = frozenset({"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"})


class Readiness(Protocol):
    """What a probe reads of the service (``service.frontend.state.FrontendState``)."""

    @property
    def ready(self) -> bool: ...

    @property
    def phase(self) -> str: ...


class Health(Readiness, Protocol):
    """What ``health_port``'s listener reads: readiness, and liveness."""

    @property
    def live(self) -> bool: ...


def probe_path(request_line: bytes) -> str | None:
    """The health route a request line asks for (``GET /health/live HTTP/1.1``), else None."""
    parts = request_line.split(b" ")
    if len(parts) != 3 or parts[0] != b"GET" or not parts[2].startswith(b"HTTP/1."):
        return None
    path = parts[1].split(b"?", 1)[0].decode("latin-1")
    return path if path in HEALTH_PATHS else None


def probe_answer(path: str, state: Readiness | None, live: bool = True) -> tuple[int, bytes]:
    """Status and JSON body of a health route, as its router answers it; ``live`` false (the event
    loop is stuck) fails every route."""
    ready = live and state is not None and state.ready
    if not live and path.endswith("/live"):
        body: dict = (
            {"live": False} if path.startswith("/v2") else {"status": "unavailable", "ready": False}
        )
        status = 503
    elif path == "/health/live":
        status, body = 200, {"status": "live", "ready": True}
    elif path == "/v2/health/live":
        status, body = 200, {"live": True}
    elif path == "/v2/health/ready":
        status, body = (200 if ready else 400), {"ready": ready}
    elif ready:
        status, body = 200, {"status": "ready", "ready": True}
    else:
        phase = "starting" if state is None else state.phase if live else "ready"
        reason = {"starting": "starting", "ready": "unavailable"}.get(phase, "shutting_down")
        status, body = 503, {"status": reason, "ready": False}
    return status, json.dumps(body, separators=(",", ":")).encode()


class _ProbeHandler(BaseHTTPRequestHandler):
    """GET of a health route; anything else 404. No logging: probes come every few seconds."""

    server: _ProbeServer
    timeout = PROBE_TIMEOUT_S  # a connection that sends nothing is dropped
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in HEALTH_PATHS:
            health = self.server.health
            status, body = probe_answer(path, health, health.live)
        else:
            status, body = 404, b'{"error":"only /health/* and /v2/health/* are served here"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


class _ProbeServer(HTTPServer):
    """One connection at a time, in the listener's thread: no thread to start per probe (each
    handoff of the GIL to another thread may wait out the interpreter's 5 ms switch interval).
    The port is this listener's alone (no SO_REUSEPORT): another program on it stops start-up."""

    request_queue_size = 64  # probes arriving together wait in the backlog, not refused

    def __init__(self, address: tuple[str, int], health: Health) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _ProbeHandler)
        self.health = health


class EventLoopHealth:
    """A single process's health: readiness from its state, liveness from a heartbeat of its event
    loop (uvicorn's ``callback_notify``, every second or two)."""

    def __init__(self, state: Readiness) -> None:
        self.state = state
        self.last_beat: float | None = None  # when the event loop last ticked (None: not yet)

    @property
    def ready(self) -> bool:
        return self.state.ready

    @property
    def phase(self) -> str:
        return self.state.phase

    @property
    def live(self) -> bool:
        return self.last_beat is None or time.monotonic() - self.last_beat < STALL_S

    async def heartbeat(self) -> None:
        """Called on the event loop: a loop stuck for ``STALL_S`` makes liveness fail here, as it
        would on the main port."""
        self.last_beat = time.monotonic()


class ProbeListener:
    """``health_port``'s listener: its own thread and socket, so that probes are answered within
    milliseconds however busy the event loop is. Binds in the constructor (an ``OSError`` when the
    port is taken); answers once started."""

    def __init__(self, host: str, port: int, health: Health) -> None:
        self.server = _ProbeServer((host, port), health)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="vitserve-probes", daemon=True
        )

    def start(self) -> ProbeListener:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
