"""A real uvicorn process over HTTP: agreement, batching, limits, queue policy, graceful shutdown."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.support import SERVICE, assert_error, b64, encode, metric, running_server


def wait_for_queue(url: str, depth: int) -> None:
    """Until the classifier queue holds ``depth`` images (the requests really are waiting in it)."""
    deadline = time.monotonic() + 30
    while (
        metric(httpx.get(f"{url}/metrics").text, "vitserve_queue_depth", graph="classifier") < depth
    ):
        assert time.monotonic() < deadline, f"the queue never reached {depth} images"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(model_repository, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "service.log"
    with running_server(
        model_repository, log, suite=SERVICE, max_queue_delay_ms=50, max_batch_size=8
    ) as running:
        yield running


def test_predictions_over_http_match_onnxruntime(http, fashion_images, reference):
    images = fashion_images[:8]
    response = http.post(
        "/predict", json={"images": [{"b64": b64(encode(i))} for i in images], "top_k": 10}
    )
    assert response.status_code == 200, response.text
    assert "server" not in response.headers  # nothing advertised about what serves it
    assert "date" in response.headers
    expected = reference.probabilities(images)
    for prediction, probabilities in zip(response.json()["predictions"], expected, strict=True):
        assert prediction["index"] == int(np.argmax(probabilities))
        scores = {entry["index"]: entry["score"] for entry in prediction["top_k"]}
        assert [scores[i] for i in range(10)] == pytest.approx(
            probabilities.tolist(), rel=1e-4, abs=1e-6
        )
    files = [("files", (f"{n}.png", encode(i), "image/png")) for n, i in enumerate(images)]
    multipart = http.post("/predict", files=files, data={"top_k": "10"})
    assert multipart.json() == response.json()


def test_concurrent_requests_are_batched(http, fashion_images, reference):
    """Requests that arrive while a batch runs share the next one (an idle server runs a request at
    once, so the test keeps it busy: 24 requests of 4 images at once, batches of up to 8)."""
    before = http.get("/metrics").text
    images = fashion_images[:16]
    expected = np.argmax(reference.probabilities(images), axis=1)

    def one(index: int) -> list[int]:
        chosen = [(index + k) % 16 for k in range(4)]
        body = {"images": [{"pixels": images[i].tolist()} for i in chosen]}
        answer = http.post("/predict", json=body)
        assert answer.status_code == 200, answer.text
        got = [p["index"] for p in answer.json()["predictions"]]
        assert got == expected[chosen].tolist()  # every caller got its own rows back
        return got

    with ThreadPoolExecutor(24) as pool:
        list(pool.map(one, range(24)))
    after = http.get("/metrics").text
    images_run = metric(after, "vitserve_batch_size_sum", graph="classifier") - metric(
        before, "vitserve_batch_size_sum", graph="classifier"
    )
    executions = metric(after, "vitserve_batch_size_count", graph="classifier") - metric(
        before, "vitserve_batch_size_count", graph="classifier"
    )
    assert images_run == 96
    assert executions < 24, "24 concurrent requests ran one by one: nothing was batched"
    assert metric(after, "vitserve_queue_wait_seconds_count", graph="classifier") >= 96


def test_errors_over_http_and_serving_goes_on(http, fashion_images):
    big = b"x" * (256 * 1024 + 1)
    assert_error(
        http.post("/predict", content=big, headers={"Content-Type": "application/json"}),
        413,
        "max_body_bytes=262144",
    )

    def stream():
        for _ in range(300):
            yield b" " * 1024

    chunked = http.post("/predict", content=stream(), headers={"Content-Type": "application/json"})
    assert_error(chunked, 413, "max_body_bytes=262144")
    assert_error(
        http.post("/predict", content=b"x", headers={"Content-Type": "text/csv"}), 415, "text/csv"
    )
    assert_error(http.post("/predict", json={"images": [{"b64": "!!"}]}), 422, "images[0].b64")
    assert_error(
        http.post("/attention", json={"image": {"pixels": [[0]]}, "layer": 9}), 422, "layer"
    )
    good = http.post("/predict", json={"images": [{"pixels": fashion_images[0].tolist()}]})
    assert good.status_code == 200
    metrics = http.get("/metrics").text
    assert metric(metrics, "vitserve_http_requests_total", route="/predict", status="413") >= 2
    assert metric(metrics, "vitserve_http_requests_total", route="/predict", status="415") >= 1


def test_attention_png_over_http(http, fashion_images):
    response = http.post(
        "/attention",
        files={"file": ("a.png", encode(fashion_images[5]), "image/png")},
        data={"format": "png"},
    )
    assert response.status_code == 200
    assert response.content.startswith(b"\x89PNG\r\n\x1a\n")
    assert http.get("/docs").status_code == 200


def test_full_queue_and_timeout_over_http(model_repository, tmp_path, fashion_images):
    """uvicorn's own CLI on the module-level app: a batch that never fills, a queue of 8 images."""
    command = [
        "-m",
        "uvicorn",
        "service.launcher.local_app:app",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
    ]
    settings = {
        "max_queue_size": 8,
        "max_batch_size": 16,
        "max_queue_delay_ms": 5000,
        "request_timeout_s": 5,
        "retry_after_s": 3,
        "idle_dispatch": "false",  # the eight images wait in the queue
    }
    with running_server(
        model_repository, tmp_path / "b.log", suite=SERVICE, command=command, **settings
    ) as server:
        eight = {"images": [{"pixels": image.tolist()} for image in fashion_images[:8]]}
        answers: dict[str, httpx.Response] = {}
        waiting = threading.Thread(
            target=lambda: answers.update(
                first=httpx.post(f"{server.url}/predict", json=eight, timeout=30)
            )
        )
        waiting.start()
        wait_for_queue(server.url, 8)
        full = httpx.post(f"{server.url}/predict", json={"images": eight["images"][:1]}, timeout=30)
        # refused at once: while the eight images still wait for their 5 s timeout, not after it
        assert waiting.is_alive() and not answers
        error = assert_error(full, 503, "queue is full", "max_queue_size=8")
        assert error["code"] == "queue_full" and full.headers["retry-after"] == "3"
        waiting.join()
        timed_out = answers["first"]
        error = assert_error(timed_out, 503, "request_timeout_s=5")
        assert error["code"] == "timeout" and timed_out.headers["retry-after"] == "3"
        assert httpx.get(f"{server.url}/health/ready").status_code == 200
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric(metrics, "vitserve_rejected_requests_total", reason="queue_full") == 1
        assert metric(metrics, "vitserve_rejected_requests_total", reason="timeout") == 1
        assert (
            metric(metrics, "vitserve_queue_depth", graph="classifier") == 0
        )  # the timed-out images left


def test_sigterm_finishes_queued_requests_then_exits(model_repository, tmp_path, fashion_images):
    """Four requests wait in the queue (a batch of 8 never fills, the delay is 8 s) when SIGTERM
    comes: all four are answered 200 at once, and the process exits 0."""
    log = tmp_path / "c.log"
    with running_server(
        model_repository, log, suite=SERVICE, max_queue_delay_ms=8000, idle_dispatch="false"
    ) as server:
        results: list[httpx.Response] = []

        def one(index: int) -> None:
            body = {"images": [{"pixels": fashion_images[index].tolist()}]}
            results.append(httpx.post(f"{server.url}/predict", json=body, timeout=60))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        wait_for_queue(server.url, 4)  # all four wait in the queue for their 8 s delay
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        answered_in = time.monotonic() - signalled
        # python -m service exits 0 after a clean drain, although uvicorn re-raises the signal
        assert server.process.wait(timeout=60) == 0
        assert [response.status_code for response in results] == [200] * 4
        assert answered_in < 4, f"answered {answered_in:.1f} s after SIGTERM: the 8 s delay ran"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health/live", timeout=2)
    output = log.read_text()
    assert "stopped: every queued request was answered" in output
    assert "Finished server process" in output
