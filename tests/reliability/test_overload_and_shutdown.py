"""A real ``python -m service`` process driven past capacity, and stopped with SIGTERM under load
(issue 6). Bounded: a few seconds of load, a few hundred requests, every process stopped."""

from __future__ import annotations

import signal
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from PIL import Image

from tests.support import (
    NUM_CLASSES,
    RELIABILITY,
    assert_error,
    assert_matches,
    b64,
    encode,
    metric,
    running_server,
)

pytestmark = pytest.mark.slow  # about 30 s together; still run in CI

# Capacity by construction: a batch never fills (8 > the queue of 4 images), so each one waits the
# full 100 ms queue delay: about 40 images a second, whatever the CPU. 16 clients without pause
# offer far more.
OVERLOAD = {
    "max_batch_size": 8,
    "max_queue_size": 4,
    "max_images_per_request": 2,
    "max_queue_delay_ms": 100,
    "retry_after_s": 2,
    "request_timeout_s": 10,
}
CLIENTS = 16
LOAD_SECONDS = 4.0
MAX_REQUESTS_PER_CLIENT = 200


@dataclass(frozen=True)
class Outcome:
    image: int
    status: int
    seconds: float
    response: httpx.Response


@pytest.fixture(scope="module")
def overloaded(model_repository, tmp_path_factory):
    log = tmp_path_factory.mktemp("overload") / "service.log"
    with running_server(model_repository, log, suite=RELIABILITY, **OVERLOAD) as server:
        yield server


def drive(url: str, images, seconds: float) -> list[Outcome]:
    """CLIENTS threads, each sending one-image requests back to back until ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    bodies = [{"images": [{"pixels": image.tolist()}], "top_k": NUM_CLASSES} for image in images]

    def client(number: int) -> list[Outcome]:
        outcomes = []
        with httpx.Client(base_url=url, timeout=30) as http:
            for count in range(MAX_REQUESTS_PER_CLIENT):
                if time.monotonic() > deadline:
                    break
                index = (number + count) % len(bodies)
                started = time.perf_counter()
                response = http.post("/predict", json=bodies[index])
                outcomes.append(
                    Outcome(index, response.status_code, time.perf_counter() - started, response)
                )
        return outcomes

    with ThreadPoolExecutor(CLIENTS) as pool:
        return [outcome for outcomes in pool.map(client, range(CLIENTS)) for outcome in outcomes]


def test_a_large_compressed_image_costs_bounded_memory(overloaded, fashion_images):
    """A 65 kB PNG of 4096 x 4096 RGBA pixels (the pixel limit) is served, costing far less than
    its 0.8 GB of float pixels: the image is brought down before it becomes floats."""
    big = encode(Image.new("RGBA", (4096, 4096), (10, 10, 10, 255)))
    assert len(big) < 100_000
    before = overloaded.rss_bytes()
    for _ in range(3):
        response = httpx.post(
            f"{overloaded.url}/predict", json={"images": [{"b64": b64(big)}]}, timeout=60
        )
        assert response.status_code == 200, response.text
    growth = overloaded.rss_bytes("VmHWM") - before
    assert growth < 400 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MiB"


def test_overload_is_refused_fast_and_every_accepted_request_is_right(
    overloaded, fashion_images, reference
):
    url = overloaded.url
    expected = reference.probabilities(fashion_images)
    before = httpx.get(f"{url}/metrics").text
    outcomes = drive(url, fashion_images, LOAD_SECONDS)
    accepted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 503]
    assert len(accepted) + len(refused) == len(outcomes), {o.status for o in outcomes}
    assert len(refused) > len(outcomes) // 4, (len(accepted), len(refused))  # it was overloaded
    assert len(accepted) > 10
    for outcome in accepted:  # every accepted request got its own, right answer
        assert_matches(outcome.response.json()["predictions"][0], expected[outcome.image])
    for outcome in refused:
        error = assert_error(outcome.response, 503, "queue is full", "max_queue_size=4")
        assert error["code"] == "queue_full"
        assert outcome.response.headers["retry-after"] == "2"
    refusal = statistics.median(o.seconds for o in refused)
    acceptance = statistics.median(o.seconds for o in accepted)
    assert refusal < acceptance and refusal < 0.25, (refusal, acceptance)  # refused at once
    after = httpx.get(f"{url}/metrics").text
    counted = metric(after, "vitserve_rejected_requests_total", reason="queue_full") - metric(
        before, "vitserve_rejected_requests_total", reason="queue_full"
    )
    assert counted == len(refused)
    assert metric(after, "vitserve_rejected_requests_total", reason="timeout") == 0
    # it recovers: ready, an empty queue, and plain requests served right
    assert httpx.get(f"{url}/health/ready").status_code == 200
    assert metric(after, "vitserve_queue_depth", graph="classifier") == 0
    for index in range(4):
        body = {"images": [{"pixels": fashion_images[index].tolist()}], "top_k": NUM_CLASSES}
        response = httpx.post(f"{url}/predict", json=body, timeout=30)
        assert response.status_code == 200
        assert_matches(response.json()["predictions"][0], expected[index])


def _probe(sock: socket.socket) -> bytes:
    """``GET /health/ready`` on an already open connection; the raw answer, or b"" if closed."""
    try:
        sock.sendall(b"GET /health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        data = b""
        while b"}" not in data:
            piece = sock.recv(4096)
            if not piece:
                break
            data += piece
        return data
    except OSError:
        return b""


def test_sigterm_under_load_drains_then_exits_zero(
    model_repository, tmp_path, fashion_images, reference
):
    log = tmp_path / "shutdown.log"
    expected = reference.probabilities(fashion_images[:6])
    with running_server(
        model_repository, log, suite=RELIABILITY, max_queue_delay_ms=3000, max_batch_size=8
    ) as server:
        answers: dict[int, httpx.Response] = {}

        def one(index: int) -> None:
            body = {"images": [{"pixels": fashion_images[index].tolist()}], "top_k": NUM_CLASSES}
            answers[index] = httpx.post(f"{server.url}/predict", json=body, timeout=30)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 5
        while metric(httpx.get(f"{server.url}/metrics").text, "vitserve_queue_depth") < 6:
            assert time.monotonic() < deadline, "the six requests never reached the queue"
            time.sleep(0.02)
        # all six are accepted and wait for their 3 s queue delay: now stop the server, with three
        # connections open (idle) on which to ask for readiness right after the signal
        probes = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        readiness = [_probe(sock) for sock in probes]
        answered = [r for r in readiness if r]
        assert answered, "no readiness probe was answered after SIGTERM"
        for raw in answered:  # readiness is false at once, before the drain
            assert raw.startswith(b"HTTP/1.1 503") and b'"ready":false' in raw, raw
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no new connection is accepted
            httpx.get(f"{server.url}/health/live", timeout=2)
        assert not answers, "the queued requests should still be waiting for their batch"
        for thread in threads:
            thread.join(timeout=30)
        code = server.process.wait(timeout=30)
        stopped_in = time.monotonic() - signalled
        for sock in probes:
            sock.close()
    assert code == 0, log.read_text()
    assert stopped_in < 10, stopped_in
    assert sorted(answers) == list(range(6))
    for index, response in answers.items():  # every accepted request was answered, right
        assert response.status_code == 200, response.text
        assert_matches(response.json()["predictions"][0], expected[index])
    output = log.read_text()
    assert "stopped: every queued request was answered" in output
    assert "Traceback" not in output
