"""Pure ASGI middleware: request ids, the body size limit, and per-route HTTP metrics.

The body limit is enforced before the body is read: a Content-Length over it is answered 413 at once,
and a body without one (chunked) is counted as it streams in, failing with 413 when it passes the limit.
A Content-Length that is not a plain ASCII number is answered 400. The JSON limits of the app are
published for ``service.frontend.inputs.parse_json`` while the request runs.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge
from service.frontend.error_responses import error_body, is_protocol_path
from service.frontend.inputs import ImageJsonLimits, current_json_limits
from service.observability import logs
from service.observability.metrics import Metrics


def _route_template(scope: Scope, static_paths: frozenset[str]) -> str:
    """The matched route's path template; for a request answered before routing (an early 413), its
    path when that is one of the app's parameter-free routes. Never the raw path of an unknown URL."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    path = scope.get("path", "")
    return path if path in static_paths else "unmatched"


MAX_SERIES = 1024


def _context_headers(scope: Scope) -> tuple[str | None, str | None]:
    """The request's X-Request-ID and Content-Length (the first of each), in one pass over its
    headers (ASGI names them in lower case)."""
    request_id = length = None
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if request_id is None:
                request_id = value.decode("latin-1")
        elif name == b"content-length" and length is None:
            length = value.decode("latin-1")
    return request_id, length


def _too_large(limit: int) -> str:
    return f"the request body is over the limit max_body_bytes={limit} bytes"


def declared_length(value: str) -> int | None:
    """A Content-Length header's byte count; None unless it is ASCII digits (``int`` would take
    Unicode digits, and refuses more than 4300 of them). Twenty digits or more is more than any
    limit: it is read as the largest count."""
    text = value.strip(" \t")
    if not text or not text.isascii() or not text.isdigit():
        return None
    return int(text) if len(text) < 20 else 10**20


class RequestContextMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        metrics: Metrics,
        static_paths: frozenset[str] = frozenset(),
        json_limits: ImageJsonLimits | None = None,
    ) -> None:
        self.app = app
        self.static_paths = static_paths
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.json_limits = json_limits
        # each (route template, method, status)'s two series, looked up once: prometheus-client's
        # labels() takes a lock and checks every label on each call
        self._series: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming_id, length = _context_headers(scope)
        request_id = logs.request_id(incoming_id)
        id_header = (b"x-request-id", request_id.encode("latin-1"))
        scope.setdefault("state", {})["request_id"] = request_id
        # for every log line of this request; not reset: each request runs in a task of its own,
        # and the error handlers outside this middleware still log for it
        logs.REQUEST_ID.set(request_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers") or ())
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append(id_header)
                message["headers"] = headers
            await send(message)

        limit = self.max_body_bytes
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(_too_large(limit), field="body")
            return message

        token = current_json_limits.set(self.json_limits)
        try:
            path = scope.get("path", "")
            declared = None if length is None else declared_length(length)
            if length is not None and declared is None:
                shown = length if len(length) <= 40 else f"{length[:40]}..."
                message = f"Content-Length: {shown!r} is not a byte count (ASCII digits)"
                await self._reject(send_with_id, request_id, path, 400, "bad_request", message)
                return
            if declared is not None and declared > limit:
                shown = str(declared) if declared < 10**20 else "20 digits or more"
                message = f"{_too_large(limit)} (Content-Length: {shown})"
                await self._reject(
                    send_with_id, request_id, path, 413, "payload_too_large", message
                )
                return
            await self.app(scope, receive_limited, send_with_id)
        finally:
            current_json_limits.reset(token)
            counted, timed = self._series_of(scope, status)
            counted.inc()
            timed.observe(time.perf_counter() - started)

    def _series_of(self, scope: Scope, status: int) -> tuple[Any, Any]:
        """The request counter's and the latency histogram's series for this request."""
        key = (_route_template(scope, self.static_paths), scope.get("method", ""), status)
        series = self._series.get(key)
        if series is None:
            template, method, _ = key
            series = (
                self.metrics.requests.labels(template, method, str(status)),
                self.metrics.latency.labels(template, method),
            )
            if len(self._series) < MAX_SERIES:  # templates, methods and statuses are few
                self._series[key] = series
        return series

    @staticmethod
    async def _reject(
        send: Send, request_id: str, path: str, status: int, code: str, message: str
    ) -> None:
        """Answer before the app sees the request (a bad or too large Content-Length)."""
        field = "body" if status == 413 else "Content-Length"
        error = (
            {"error": message}
            if is_protocol_path(path)
            else error_body(code, message, request_id, field)
        )
        body = json.dumps(error).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
