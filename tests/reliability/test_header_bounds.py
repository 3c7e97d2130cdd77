"""Header bombs against a real ``python -m service``: request headers beyond
``max_header_bytes`` or ``max_header_count`` are answered 431 and closed, on every route, health
included, before the bytes pile up; and probes are answered past the connection cap.

Before the bounds, four connections each sending 200 MB of headers to /health/live all got 200 and
the server's RSS grew by 2.2 GiB; before the exemption, every probe past the cap got 503."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from bench import server_process
from tests.support import (
    RELIABILITY,
    Server,
    recv_until,
    run_python,
    running_server,
    server_env,
)

pytestmark = pytest.mark.slow  # one server, about 10 s

# one front end: the cap is a process's, and probes must meet it whichever process accepts them
LIMITS = {"max_header_bytes": 4096, "max_header_count": 20, "max_connections": 4, "workers": 1}
ROUTES = ("/health/live", "/health/ready", "/v2/health/live", "/predict", "/v2/models/x/infer")


@pytest.fixture(scope="module")
def server(model_repository, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("header-bounds") / "service.log"
    with running_server(model_repository, log, suite=RELIABILITY, **LIMITS) as running:
        yield running


def connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def answer(sock: socket.socket) -> tuple[int, bytes]:
    data = recv_until(sock, lambda _: False)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def send_forever(sock: socket.socket, head: bytes, filler: bytes, most: int) -> int:
    """Send ``head`` then ``filler`` until the server stops reading or ``most`` bytes; bytes sent."""
    sent = 0
    try:
        sock.sendall(head)
        while sent < most:
            sock.sendall(filler)
            sent += len(filler)
    except OSError:  # the server answered and closed
        pass
    return sent


@pytest.mark.parametrize("route", ROUTES)
def test_headers_over_the_byte_limit_are_answered_431(server, route):
    method = "GET" if "health" in route else "POST"
    sock = connect(server)
    head = f"{method} {route} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode()
    sent = send_forever(sock, head, b"a" * 65536, 64 * 1024 * 1024)
    status, body = answer(sock)
    assert status == 431, body
    assert "max_header_bytes=4096" in json.loads(body)["error"]["message"]
    assert sent < 32 * 1024 * 1024, "the server kept reading headers"


def test_many_small_headers_are_answered_431(server):
    sock = connect(server)
    fields = b"".join(b"X-%d: 1\r\n" % n for n in range(21))
    sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    status, body = answer(sock)
    assert status == 431 and "max_header_count=20" in json.loads(body)["error"]["message"]


def test_a_huge_request_line_is_answered_431(server):
    sock = connect(server)
    send_forever(sock, b"GET /health/live?", b"a" * 65536, 8 * 1024 * 1024)
    assert answer(sock)[0] == 431


def test_headers_at_the_limits_are_served(server):
    fields = {f"x-{n}": "1" for n in range(14)}  # with httpx's five and x-pad: 20 in all
    fields["x-pad"] = "a" * 3000
    response = httpx.get(f"{server.url}/health/live", headers=fields)
    assert response.status_code == 200


def test_body_after_small_headers_in_one_chunk_is_not_counted(server):
    body = json.dumps({"images": [{"pixels": [[255] * 28] * 28}] * 2}).encode()  # over 4096 bytes
    assert len(body) > LIMITS["max_header_bytes"]
    sock = connect(server)
    sock.sendall(
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    assert answer(sock)[0] == 200


def test_the_memory_of_many_header_bombs_stays_flat(server):
    before = server.rss_bytes()
    socks = [connect(server) for _ in range(3)]
    for sock in socks:
        send_forever(sock, b"GET /health/live HTTP/1.1\r\nX-Big: ", b"a" * 65536, 50 * 1024**2)
    assert all(answer(sock)[0] == 431 for sock in socks)
    assert server.rss_bytes() - before < 64 * 1024 * 1024


def test_probes_are_answered_past_the_connection_cap(server):
    held = [connect(server) for _ in range(LIMITS["max_connections"])]
    for sock in held:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # kept alive: the cap is full
    try:
        for path, status, body in [
            ("/health/live", 200, {"status": "live", "ready": True}),
            ("/health/ready", 200, {"status": "ready", "ready": True}),
            ("/v2/health/live", 200, {"live": True}),
            ("/v2/health/ready", 200, {"ready": True}),
        ]:
            started = time.monotonic()
            sock = connect(server)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            got, text = answer(sock)
            assert (got, json.loads(text)) == (status, body), path
            assert time.monotonic() - started < 0.9  # not the over-cap wait of one second
        sock = connect(server)
        sock.sendall(b"GET /models HTTP/1.1\r\nHost: x\r\n\r\n")
        status, text = answer(sock)
        assert status == 503 and b"too_many_connections" in text
    finally:
        for sock in held:
            sock.close()


def test_without_httptools_the_service_refuses_to_start_rather_than_serve_h11(model_repository):
    """The bounds above live in a subclass of uvicorn's httptools protocol; without httptools,
    uvicorn would serve with h11, which has none of them (only its own 16 KiB buffer, answered
    400). ``python -m service`` refuses instead, with one line saying why."""
    script = (
        "import sys; sys.modules['httptools'] = None; sys.argv = ['service']\n"
        "from service.__main__ import main\n"
        "main()\n"
    )
    port = server_process.free_port(RELIABILITY.ports)
    result = run_python(script, server_env(model_repository, port, RELIABILITY))
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "cannot start: python -m service serves HTTP with uvicorn's httptools"
    )
    assert "h11" in lines[0] and "Install httptools" in lines[0]
