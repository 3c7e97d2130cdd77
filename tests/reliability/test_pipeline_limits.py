"""The request pipeline's own limits: decode-slot waiters (a cap and a timeout, 503 with Retry-After),
a client that hangs up before its batch (its images never run), and the batcher's watchdog."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import numpy as np
import pytest

from service.engine.batcher import DynamicBatcher
from service.errors import ServiceUnavailable
from service.frontend.serving import DecodeGate
from service.observability.metrics import Metrics
from service.settings import Settings
from tests.support import RELIABILITY, metric, running_server, submit, wait_until


def test_decode_slot_waiters_are_capped_and_time_out():
    async def scenario():
        metrics = Metrics()
        settings = Settings(
            max_concurrent_decodes=1, max_decode_waiters=1, decode_wait_timeout_s=0.3
        )
        gate = DecodeGate(settings.limits, metrics)
        holding = asyncio.Event()
        release = asyncio.Event()

        async def holder():
            async with gate.slot():
                holding.set()
                await release.wait()

        async def waiter():
            async with gate.slot():
                return "ran"

        held = asyncio.create_task(holder())
        await holding.wait()
        waiting = asyncio.create_task(waiter())
        await asyncio.sleep(0.05)  # the one waiter allowed is waiting
        with pytest.raises(ServiceUnavailable) as refused:
            async with gate.slot():
                pass
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable) as timed_out:
            await waiting
        waited = time.monotonic() - started
        release.set()
        await held
        async with gate.slot():  # the slot is free again: nothing leaked
            pass
        return metrics, refused.value, timed_out.value, waited

    metrics, refused, timed_out, waited = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert "max_decode_waiters=1" in refused.message
    assert "decode_wait_timeout_s=0.3" in timed_out.message and waited < 5
    registry = metrics.registry
    assert (
        registry.get_sample_value(
            "vitserve_decode_rejected_requests_total", {"reason": "waiters_full"}
        )
        == 1
    )
    assert (
        registry.get_sample_value("vitserve_decode_rejected_requests_total", {"reason": "timeout"})
        == 1
    )


def test_a_dead_batcher_loop_fails_what_it_held_and_refuses_new_work():
    """The watchdog: if the batching loop dies, queued callers get a 503 at once (not after their
    timeout) and new work is refused, so readiness can report it."""

    async def scenario():
        batcher = DynamicBatcher(
            "classifier",
            lambda images: (images.reshape(len(images), -1).sum(axis=1),),
            max_batch_size=4,
            max_queue_delay_s=0.2,
            max_queue_size=16,
            timeout_s=30.0,
            retry_after_s=1,
            metrics=Metrics(),
        )

        def broken(waiting: int) -> int:
            raise RuntimeError("a bug in the loop")

        batcher._batch_target = broken  # the loop's next step raises
        batcher.start()
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable) as failed:
            await submit(batcher, np.zeros((1, 1, 2, 2), dtype=np.float32))
        waited = time.monotonic() - started
        with pytest.raises(ServiceUnavailable) as refused:
            batcher.admit(1)
        return batcher, failed.value, refused.value, waited

    batcher, failed, refused, waited = asyncio.run(scenario())
    assert not batcher.healthy and isinstance(batcher.failure, RuntimeError)
    assert failed.code == "batcher_failed" and waited < 5
    assert refused.code == "not_ready"


def test_readiness_turns_false_when_the_default_models_batcher_dies(client):
    pipeline = client.app.state.engine.manager.resolve()
    assert client.get("/health/ready").status_code == 200
    pipeline.classifier.failure = RuntimeError("the loop died")
    try:
        answer = client.get("/health/ready")
        assert answer.status_code == 503 and answer.json()["status"] == "unavailable"
    finally:
        pipeline.classifier.failure = None
    assert client.get("/health/ready").status_code == 200


def test_images_of_a_client_that_hung_up_are_never_run(model_repository, tmp_path, fashion_images):
    """A request queued behind a 3 s queue delay whose client closes the connection: its image is
    dropped from the queue (a metric counts it) and no batch ever runs it."""
    body = json.dumps({"images": [{"pixels": fashion_images[0].tolist()}]}).encode()
    with running_server(
        model_repository,
        tmp_path / "hangup.log",
        suite=RELIABILITY,
        max_queue_delay_ms=3000,
        idle_dispatch="false",  # the image waits in the queue for the delay
    ) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_until(
                lambda: metric(httpx.get(f"{server.url}/metrics").text, "vitserve_queue_depth"),
                "the request to reach the queue",
            )
        # the client is gone: within the queue delay its image must leave the queue unrun
        wait_until(
            lambda: metric(
                httpx.get(f"{server.url}/metrics").text, "vitserve_cancelled_images_total"
            ),
            "the hung-up client's image to be cancelled",
        )
        # a later request is answered once a batch has run: the hung-up client's image, queued
        # before it, would have run in that batch or an earlier one (no fixed wait for the delay)
        answer = httpx.post(
            f"{server.url}/predict",
            json={"images": [{"pixels": fashion_images[0].tolist()}]},
            timeout=30,
        )
        assert answer.status_code == 200  # the service carries on
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "vitserve_batch_size_count", graph="classifier") == 1
        assert metric(text, "vitserve_batch_size_sum", graph="classifier") == 1  # its image only
        assert metric(text, "vitserve_queue_depth", graph="classifier") == 0
