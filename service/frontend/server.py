"""The HTTP connections of ``python -m service``: deadlines for headers and body, a connection cap.

uvicorn has a keep-alive timeout for idle connections but none for a request that is being sent: a
client could hold a connection forever with half-sent headers, or a body trickled a byte at a time
(and hold up a graceful shutdown with it). ``guarded_protocol`` makes a subclass of uvicorn's
httptools protocol (the one ``uvicorn[standard]`` runs) that adds

- a header deadline: the request headers must be complete ``header_timeout_s`` after the connection
  opened, or after the previous response on it;
- a body deadline: ``body_timeout_s`` plus one second per ``body_min_bytes_per_s`` bytes received, so
  a client at least that fast is never cut off; time the server itself is not reading (flow control)
  does not count;
- a connection cap: a connection beyond ``max_connections`` is answered 503 with Retry-After as soon
  as its request headers arrive (or after one second) and closed, without reaching the app; a ``GET``
  of a health route is answered instead, by ``probes.probe_answer``, so probes never meet the cap;
- header bounds: request headers of more than ``max_header_bytes`` bytes (request line included) or
  more than ``max_header_count`` fields are answered 431 and the connection closed; the parser is
  never fed more header bytes than the limit, so they cannot pile up in memory.

And one send per small response: uvicorn writes a response's status line and headers, then its body,
each with a send of its own (two syscalls and, on a loopback or a LAN, two packets the client wakes
for); the head is held until the first body bytes and goes out with them (``_OneSendResponse``).

And a cheap client-gone signal: each request's scope carries ``CLIENT_GONE`` (an ASGI extension),
which makes a future that completes when the connection is lost (service/frontend/serving.py's
``client_gone``), where watching for the ASGI disconnect message costs a task per request.

A deadline that passes is answered 408 (when no response has started) and the connection closed. The
app, if it was reading the body, sees the client gone (``error_responses.CUT_OFF`` in the request's state
says why).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service.frontend.error_responses import CUT_OFF
from service.frontend.probes import Readiness, probe_answer, probe_path
from service.settings import Settings

CLIENT_GONE = (
    "vitserve.client_gone"  # the scope's extension: () -> a future, done when the client goes
)
_EARLY_BYTES = 64 * 1024  # what an over-cap connection may send before it is answered
_OVER_CAP_WAIT_S = 1.0  # how long an over-cap connection may take to send its request headers


def _response(status: int, reason: str, code: str, message: str, retry_after: int | None) -> bytes:
    body = json.dumps(
        {"error": {"code": code, "message": message, "field": None, "request_id": None}}
    ).encode()
    return _raw(status, reason, body, retry_after)


def _raw(status: int, reason: str, body: bytes, retry_after: int | None = None) -> bytes:
    headers = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after is not None:
        headers.append(f"retry-after: {retry_after}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


class _OneSendResponse:
    """A response's transport as its uvicorn cycle sees it: the head (the cycle's first write once
    its response has started) is held and sent with the first body bytes, in one write; the rest
    passes through. The cycle's ``send`` is wrapped so that the head goes out after each body
    message even when that message wrote nothing (a HEAD request's), and ``close`` sends it first."""

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._transport: asyncio.Transport = cycle.transport
        self._head: bytes | None = None
        self._holding = False
        original = cycle.send

        async def send(message: Any) -> None:
            if message["type"] == "http.response.start":
                self._holding = True
            try:
                await original(message)
            finally:
                if message["type"] != "http.response.start":
                    self.flush()

        cycle.send = send  # type: ignore[method-assign]  # read when the app is called, after this
        cycle.transport = self  # type: ignore[assignment]

    def write(self, data: bytes) -> None:
        if self._holding and self._head is None:
            self._head = data
            return
        if self._head is not None:
            data, self._head, self._holding = self._head + data, None, False
        self._transport.write(data)

    def flush(self) -> None:
        self._holding = False
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        if not self._transport.is_closing():
            self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the cap above (class attributes: see
    ``guarded_protocol``)."""

    header_timeout_s = 30.0
    body_timeout_s = 30.0
    body_min_bytes_per_s = 16 * 1024
    max_connections = 512
    retry_after_s = 1
    max_header_bytes = 64 * 1024
    max_header_count = 100
    readiness: Readiness | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._body_since = 0.0
        self._body_bytes = 0
        self._over_cap = False
        self._head = bytearray()  # an over-cap connection's first bytes, at most _EARLY_BYTES
        self._in_headers = True  # the parser is inside a request's line and headers
        self._header_bytes = 0
        self._header_count = 0
        self._lost = False
        self._gone_watchers: set[asyncio.Future[None]] = set()

    # --- timers -----------------------------------------------------------------------------------

    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close_with(
        self, status: int, reason: str, code: str, message: str, *, answer: bool = True
    ) -> None:
        """Answer (unless ``answer`` is false: a response has started) and close."""
        if self.transport.is_closing():
            return
        if answer:
            retry = self.retry_after_s if status == 503 else None
            self.transport.write(_response(status, reason, code, message, retry))
        self.transport.close()

    def _headers_late(self) -> None:
        self._deadline = None
        self._close_with(
            408,
            "Request Timeout",
            "request_timeout",
            "the request headers were not complete within header_timeout_s="
            f"{self.header_timeout_s:g} seconds",
        )

    def _body_check(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete:
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the server is not reading: the client cannot be late
            self._body_since, self._body_bytes = now, 0
            self._arm(self.body_timeout_s, self._body_check)
            return
        allowed = self.body_timeout_s + self._body_bytes / self.body_min_bytes_per_s
        late = now - self._body_since - allowed
        if late < 0:
            self._arm(-late, self._body_check)
            return
        cycle.scope["state"][CUT_OFF] = "body_timeout_s"  # type: ignore[typeddict-unknown-key]
        self._close_with(
            408,
            "Request Timeout",
            "request_timeout",
            f"the request body did not arrive in time: body_timeout_s={self.body_timeout_s:g} "
            f"seconds plus one per body_min_bytes_per_s={self.body_min_bytes_per_s} bytes",
            answer=not cycle.response_started,
        )

    def _headers_too_large(self, what: str) -> None:
        self._disarm()
        self._close_with(
            431,
            "Request Header Fields Too Large",
            "headers_too_large",
            f"the request headers are larger than {what}",
        )

    def _refuse_over_cap(self) -> None:
        self._deadline = None
        end = self._head.find(b"\r\n")
        path = probe_path(bytes(self._head[:end])) if end > 0 else None
        if path is not None and not self.transport.is_closing():
            status, body = probe_answer(path, self.readiness)
            reason = {200: "OK", 400: "Bad Request"}.get(status, "Service Unavailable")
            self.transport.write(_raw(status, reason, body))
            self.transport.close()
            return
        self._close_with(
            503,
            "Service Unavailable",
            "too_many_connections",
            f"the server has max_connections={self.max_connections} connections open; retry later",
        )

    # --- uvicorn's protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._over_cap = True
            self._arm(min(_OVER_CAP_WAIT_S, self.header_timeout_s), self._refuse_over_cap)
        else:
            self._arm(self.header_timeout_s, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._lost = True
        for watcher in list(self._gone_watchers):
            if not watcher.done():
                watcher.set_result(None)
        super().connection_lost(exc)

    def client_gone(self) -> asyncio.Future[None]:
        """A future that completes when this connection is lost (at once when it has been); its
        taker may cancel it."""
        watcher: asyncio.Future[None] = self.loop.create_future()
        if self._lost:
            watcher.set_result(None)
        else:
            self._gone_watchers.add(watcher)
            watcher.add_done_callback(self._gone_watchers.discard)
        return watcher

    def data_received(self, data: bytes) -> None:
        if self._over_cap:
            # Never parsed: answered once the request headers are in (or enough bytes for them).
            searched = max(0, len(self._head) - 3)
            self._head += data[: _EARLY_BYTES + 4 - len(self._head)]
            if b"\r\n\r\n" in self._head[searched:] or len(self._head) > _EARLY_BYTES:
                self._disarm()
                self._refuse_over_cap()
            return
        # While a request's headers are being read, the parser gets at most max_header_bytes of
        # them; the rest of a chunk is fed once they are complete. (A next request that starts
        # inside a chunk of the previous body is counted from the next chunk: at most one read,
        # 256 KiB, more.)
        while data and not self.transport.is_closing():
            if not self._in_headers:
                self._feed(data)
                return
            room = self.max_header_bytes - self._header_bytes
            if room <= 0:
                self._headers_too_large(f"max_header_bytes={self.max_header_bytes} bytes")
                return
            part, data = data[:room], data[room:]
            self._header_bytes += len(part)
            self._feed(part)

    def _feed(self, data: bytes) -> None:
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if not self.transport.is_closing():  # not when a 431 went out already (on_header)
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {CLIENT_GONE: self.client_gone}
        self._in_headers, self._header_bytes, self._header_count = True, 0, 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_header_count:
            self._headers_too_large(f"max_header_count={self.max_header_count} fields")
            raise ValueError("too many header fields")  # stops the parser (httptools wraps it)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        super().on_headers_complete()
        if self.cycle is not None:  # the request's cycle, made just now; its app runs later
            _OneSendResponse(self.cycle)
        self._body_since, self._body_bytes = self.loop.time(), 0
        self._arm(self.body_timeout_s, self._body_check)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        # The body is in: its deadline ends. (When the answer went out before the body was read,
        # the timer running is already the next request's header deadline, which stays.)
        if self.cycle is None or not self.cycle.response_complete:
            self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a next request whose headers are in already
        super().on_response_complete()
        if not self.transport.is_closing() and not pipelined:
            self._arm(self.header_timeout_s, self._headers_late)


def guarded_protocol(
    settings: Settings, readiness: Readiness | None = None
) -> type[GuardedProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with the deadlines and bounds of
    ``settings``; ``readiness`` (the service's state) answers probes past the connection cap."""
    return type(
        "VitserveHttpProtocol",
        (GuardedProtocol,),
        {
            "header_timeout_s": settings.server.header_timeout_s,
            "body_timeout_s": settings.server.body_timeout_s,
            "body_min_bytes_per_s": settings.server.body_min_bytes_per_s,
            "max_connections": settings.server.max_connections,
            "retry_after_s": settings.limits.retry_after_s,
            "max_header_bytes": settings.server.max_header_bytes,
            "max_header_count": settings.server.max_header_count,
            "readiness": readiness,
        },
    )
