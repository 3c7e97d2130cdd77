"""A client that hangs up while its request waits in the queue, against a real ``python -m service``
(two front ends, the engine in its own process): its images never run, they are counted as cancelled,
and nothing else is lost.

The front end learns of the hang-up from its HTTP protocol (``CLIENT_GONE`` in the request's scope,
service/frontend/server.py), one future per request, where it used to run a task per request that
waited for the ASGI disconnect message."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.support import RELIABILITY, b64, encode, metric, running_server, wait_until

pytestmark = pytest.mark.slow  # one server, about 8 s

# a batch of 8 never fills and idle instances do not run a lone request: it waits out the delay
QUEUED = {"max_queue_delay_ms": 6000, "max_batch_size": 8, "idle_dispatch": "false", "workers": 2}


def predict_request(image_b64: str) -> bytes:
    body = json.dumps({"images": [{"b64": image_b64}]}).encode()
    return (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


def test_a_queued_request_whose_client_hangs_up_never_runs(
    model_repository, fashion_images, tmp_path
):
    request = predict_request(b64(encode(fashion_images[0])))
    with running_server(
        model_repository, tmp_path / "service.log", suite=RELIABILITY, **QUEUED
    ) as server:

        def counts() -> tuple[float, float]:
            text = httpx.get(f"{server.url}/metrics").text
            return metric(text, "vitserve_cancelled_images_total"), metric(
                text, "vitserve_batch_size_sum"
            )

        cancelled_before, run_before = counts()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(request)
        wait_until(
            lambda: metric(httpx.get(f"{server.url}/metrics").text, "vitserve_queue_depth") >= 1,
            timeout_s=5,
            what="the request to be queued",
        )
        sock.close()
        started = time.monotonic()
        wait_until(
            lambda: counts()[0] == cancelled_before + 1,
            timeout_s=4,
            what="the queued image to be cancelled",
        )
        assert time.monotonic() - started < 4  # well before its 6 s queue delay would have run it
        time.sleep(0.2)
        assert counts() == (cancelled_before + 1, run_before)
