"""Where a request is decoded: small ones on the event loop (a thread hop costs more than parsing them),
large ones in a decode thread (the loop must stay free). Checked by the thread ``decode`` runs on."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from service.frontend.serving import INLINE_TENSOR_BYTES, DecodeGate, ServedVersion
from service.observability.metrics import Metrics
from service.settings import Settings


class EchoEngine:
    """Answers each row with itself; serves no model with a candidate."""

    table = SimpleNamespace(models={})

    def admit(self, view, requested, graph, count) -> None:
        pass

    async def infer(self, call):
        return [call.rows]

    def record_failure(self, view, ns) -> None:
        pass


@pytest.mark.parametrize(
    ("request_bytes", "on_loop"),
    [(1_000, True), (INLINE_TENSOR_BYTES, True), (INLINE_TENSOR_BYTES + 1, False)],
)
def test_tensor_requests_decode_on_the_loop_only_when_small(request_bytes, on_loop):
    settings = Settings()
    state = SimpleNamespace(
        engine=EchoEngine(), gate=DecodeGate(settings.limits, Metrics()), settings=settings
    )
    view = SimpleNamespace(name="m", version=1, metadata=None, serving=None)
    decoded_on: list[int] = []

    def decode() -> np.ndarray:
        decoded_on.append(threading.get_ident())
        return np.ones((2, 3), np.float32)

    async def scenario() -> tuple[np.ndarray, int]:
        served = ServedVersion(state, view, None)
        logits = await served.infer(decode, request_bytes)
        return logits, threading.get_ident()

    logits, loop_thread = asyncio.run(scenario())
    np.testing.assert_array_equal(logits, np.ones((2, 3), np.float32))
    assert (decoded_on == [loop_thread]) is on_loop
