"""Slow and greedy clients against a real ``python -m service``: half-sent headers and
trickled bodies are answered 408 and closed at their deadlines, a slow but steady upload is served,
connections beyond the cap get 503, and a trickling client does not hold up SIGTERM.

The deadlines are shortened here (1-2 s); the defaults are in service/settings/."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.support import RELIABILITY, Server, assert_matches, metric, recv_until, running_server

pytestmark = pytest.mark.slow  # two servers, about 25 s together

DEADLINES = {
    "header_timeout_s": 2,
    "body_timeout_s": 1,
    "body_min_bytes_per_s": 1000,
    "max_connections": 6,
    "retry_after_s": 3,
    # one front end: the cap is then exact (several share it out, each holding its part)
    "workers": 1,
}


@pytest.fixture(scope="module")
def server(model_repository, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("slow-clients") / "service.log"
    with running_server(model_repository, log, suite=RELIABILITY, **DEADLINES) as running:
        yield running


def connect(server: Server, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one answer on ``sock``, read until the server closes it."""
    data = recv_until(sock, lambda _: False)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def post_head(length: int) -> bytes:
    return (
        "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_half_sent_headers_are_answered_408_and_closed_at_the_deadline(server):
    sock = connect(server)
    sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Ty")
    started = time.monotonic()
    status, _, body = read_answer(sock)
    waited = time.monotonic() - started
    assert status == 408 and "header_timeout_s=2" in json.loads(body)["error"]["message"]
    assert 1.5 < waited < 6, waited


def test_the_header_deadline_also_holds_on_a_kept_alive_connection(server):
    sock = connect(server)
    sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /health/live HTTP/1.1\r\nHo")  # the next request never finishes
    started = time.monotonic()
    status, _, _ = read_answer(sock)
    assert status == 408 and time.monotonic() - started < 6


def test_a_trickled_body_is_cut_off_at_its_deadline(server):
    before = httpx.get(f"{server.url}/metrics").text
    sock = connect(server)
    sock.sendall(post_head(1000))
    started = time.monotonic()
    sock.settimeout(0.25)
    answer = b""
    while time.monotonic() - started < 10 and not answer:  # a byte every 0.25 s
        sock.sendall(b" ")
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            continue
    waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"body_timeout_s=1" in answer
    assert 0.8 < waited < 5, waited
    time.sleep(0.5)  # the app notices the hang-up, and counts it
    after = httpx.get(f"{server.url}/metrics").text

    def count(text: str, status: str) -> float:
        return metric(text, "vitserve_http_requests_total", status=status)

    assert count(after, "408") == count(before, "408") + 1
    assert all(count(after, s) == 0 for s in ("500", "503")), after


def test_a_client_hanging_up_mid_body_is_a_499_not_a_500(server):
    before = httpx.get(f"{server.url}/metrics").text
    sock = connect(server)
    sock.sendall(post_head(1000) + b'{"images": [')
    time.sleep(0.3)
    sock.close()
    time.sleep(0.5)
    after = httpx.get(f"{server.url}/metrics").text
    gone = metric(after, "vitserve_http_requests_total", status="499")
    assert gone == metric(before, "vitserve_http_requests_total", status="499") + 1
    assert metric(after, "vitserve_http_requests_total", status="500") == 0
    assert "Traceback" not in server.output()


def test_a_slow_but_steady_upload_is_served(server, fashion_images, reference):
    """Faster than body_min_bytes_per_s (20 kB/s against 1 kB/s), and longer than body_timeout_s."""
    image = fashion_images[2]
    body = json.dumps({"images": [{"pixels": image.tolist()}], "top_k": 10}).encode()
    body = body + b" " * (40_000 - len(body))
    sock = connect(server)
    sock.sendall(post_head(len(body)))
    started = time.monotonic()
    for offset in range(0, len(body), 1000):
        sock.sendall(body[offset : offset + 1000])
        time.sleep(0.05)
    assert time.monotonic() - started > 2 * DEADLINES["body_timeout_s"]
    sock.settimeout(10)
    answer = recv_until(sock, lambda data: b"\r\n\r\n" in data and data.rstrip().endswith(b"}"))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    prediction = json.loads(answer.partition(b"\r\n\r\n")[2])["predictions"][0]
    assert_matches(prediction, reference.probabilities(image[np.newaxis])[0])


def test_connections_beyond_the_cap_get_503_and_the_rest_are_served(server):
    cap = DEADLINES["max_connections"]
    idle = [connect(server) for _ in range(cap)]
    time.sleep(0.2)  # all accepted
    extra = connect(server)
    extra.sendall(b"GET /models HTTP/1.1\r\nHost: x\r\n\r\n")  # health is exempt
    status, headers, body = read_answer(extra)
    assert status == 503 and headers["retry-after"] == "3"
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert f"max_connections={cap}" in json.loads(body)["error"]["message"]
    for sock in idle:
        sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/health/live").status_code == 200


def test_a_trickling_client_does_not_hold_up_sigterm(model_repository, tmp_path):
    """A client trickling its body does not stretch the drain to its full length (graceful 30 s here)."""
    with running_server(
        model_repository,
        tmp_path / "service.log",
        suite=RELIABILITY,
        graceful_shutdown_s=30,
        **DEADLINES,
    ) as running:
        sock = connect(running)
        sock.sendall(post_head(1000) + b"{")
        time.sleep(0.3)
        started = time.monotonic()
        running.process.send_signal(signal.SIGTERM)
        sock.settimeout(0.5)
        for _ in range(20):  # a byte every 0.5 s while the server drains
            try:
                sock.sendall(b" ")
                if sock.recv(65536):
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        code = running.process.wait(timeout=40)
        stopped_after = time.monotonic() - started
    assert code == 0, running.output()
    assert stopped_after < 8, (stopped_after, running.output()[-2000:])
