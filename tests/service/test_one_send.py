"""A response's head and its first body bytes leave in one write (service/frontend/server.py's
``_OneSendResponse``): uvicorn alone writes them apart, two sends and two packets for every small
answer. What must not change with it: a HEAD answer (no body bytes) still goes out and the connection
serves the next request; a streamed body's first chunk is not held behind the next one; a 100 Continue
goes out before the app reads the body; an app that fails after its head still sends the head.

uvicorn's real protocol class runs on a transport that records each write."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from service.frontend.server import guarded_protocol
from service.settings import Settings

App = Callable[
    [dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]
]


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def connection(app: App) -> tuple[Any, RecordingTransport]:
    """A protocol of ``guarded_protocol`` for ``app``, connected to a recording transport."""
    config = uvicorn.Config(
        app, http=guarded_protocol(Settings()), lifespan="off", log_level="error"
    )
    config.load()
    protocol = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=ServerState(), app_state={}
    )
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def serve(app: App, *requests: bytes) -> RecordingTransport:
    """``requests`` fed one after another, each left to be answered; the writes."""
    protocol, transport = connection(app)
    for request in requests:
        protocol.data_received(request)
        await settle()
    protocol.connection_lost(None)
    return transport


async def small_json(scope: dict, receive: Any, send: Any) -> None:
    body = b'{"ok": true}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


GET = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
HEAD = b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n"


def test_a_small_response_is_one_write():
    transport = asyncio.run(serve(small_json, GET))
    assert len(transport.writes) == 1, transport.writes
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and body == b'{"ok": true}'


def test_keep_alive_answers_each_request_in_one_write():
    transport = asyncio.run(serve(small_json, GET, GET, GET))
    assert [w.startswith(b"HTTP/1.1 200 OK") for w in transport.writes] == [True] * 3


def test_a_head_answer_goes_out_and_the_connection_serves_on():
    transport = asyncio.run(serve(small_json, HEAD, GET))
    assert len(transport.writes) == 2, transport.writes
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert transport.writes[0].endswith(b"\r\n\r\n")  # the head alone: HEAD has no body
    assert transport.writes[1].endswith(b'{"ok": true}')


def test_a_streamed_body_is_not_held_behind_its_next_chunk():
    written_before_second: list[bytes] = []

    async def scenario() -> RecordingTransport:
        async def streaming(scope: dict, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            written_before_second.extend(transport.writes)
            await send({"type": "http.response.body", "body": b"second", "more_body": False})

        protocol, transport = connection(streaming)
        protocol.data_received(GET)
        await settle()
        return transport

    transport = asyncio.run(scenario())
    assert len(written_before_second) == 1 and b"first" in written_before_second[0]
    assert written_before_second[0].startswith(b"HTTP/1.1 200 OK")
    assert b"second" in transport.writes[-1]


def test_100_continue_goes_out_before_the_body_is_read():
    order: list[str] = []

    async def reads_body(scope: dict, receive: Any, send: Any) -> None:
        order.append("reading")
        await receive()
        order.append("read")
        await small_json(scope, receive, send)

    async def scenario() -> RecordingTransport:
        protocol, transport = connection(reads_body)
        protocol.data_received(
            b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\nexpect: 100-continue\r\n\r\n"
        )
        await settle()
        assert order == ["reading"]
        assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]  # not held for the answer
        protocol.data_received(b"body")
        await settle()
        return transport

    transport = asyncio.run(scenario())
    assert order == ["reading", "read"]
    assert transport.writes[-1].startswith(b"HTTP/1.1 200 OK")


def test_an_app_that_fails_after_its_head_still_sends_the_head_then_closes():
    async def fails(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("the app failed mid-answer")

    transport = asyncio.run(serve(fails, GET))
    assert transport.closed
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200 OK")
