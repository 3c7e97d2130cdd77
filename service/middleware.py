"""Pure ASGI middleware: request ids, the body size limit, and per-route HTTP metrics.

The body limit is enforced before the body is read: a Content-Length over it is answered 413 at once,
and a body without one (chunked) is counted as it streams in, failing with 413 when it passes the limit.
"""

from __future__ import annotations

import json
import time

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import logs
from service.errors import PayloadTooLarge, error_body, is_protocol_path
from service.metrics import Metrics


def _route_template(scope: Scope, static_paths: frozenset[str]) -> str:
    """The matched route's path template; for a request answered before routing (an early 413), its
    path when that is one of the app's parameter-free routes. Never the raw path of an unknown URL."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    path = scope.get("path", "")
    return path if path in static_paths else "unmatched"


def _too_large(limit: int) -> str:
    return f"the request body is over the limit max_body_bytes={limit} bytes"


class RequestContextMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        metrics: Metrics,
        static_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.static_paths = static_paths
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = logs.request_id(headers.get("x-request-id"))
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
                MutableHeaders(scope=message).setdefault("X-Request-ID", request_id)
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

        try:
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                await self._reject_too_large(
                    send_with_id, request_id, int(length), scope.get("path", "")
                )
                return
            await self.app(scope, receive_limited, send_with_id)
        finally:
            template = _route_template(scope, self.static_paths)
            method = scope.get("method", "")
            self.metrics.requests.labels(template, method, str(status)).inc()
            self.metrics.latency.labels(template, method).observe(time.perf_counter() - started)

    async def _reject_too_large(self, send: Send, request_id: str, length: int, path: str) -> None:
        message = f"{_too_large(self.max_body_bytes)} (Content-Length: {length})"
        error = (
            {"error": message}
            if is_protocol_path(path)
            else error_body("payload_too_large", message, request_id, "body")
        )
        body = json.dumps(error).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
