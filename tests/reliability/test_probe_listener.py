"""``VITSERVE_HEALTH_PORT``'s listener (issue 25): the health routes from a thread of its own, whose
liveness still follows the event loop (it fails once the loop has not ticked for STALL_S)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from service.frontend.probes import STALL_S, ProbeListener
from tests.support import RELIABILITY, free_port


@dataclass
class Phase:
    phase: str = "ready"

    @property
    def ready(self) -> bool:
        return self.phase == "ready"


@pytest.fixture
def listener() -> Iterator[ProbeListener]:
    probes = ProbeListener("127.0.0.1", free_port(RELIABILITY.ports), Phase()).start()
    try:
        yield probes
    finally:
        probes.close()


def get(probes: ProbeListener, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{probes.port}{path}", timeout=5)


def test_the_health_routes_and_nothing_else(listener):
    assert get(listener, "/health/live").json() == {"status": "live", "ready": True}
    assert get(listener, "/health/ready").json() == {"status": "ready", "ready": True}
    assert get(listener, "/v2/health/live").json() == {"live": True}
    assert get(listener, "/v2/health/ready").json() == {"ready": True}
    assert get(listener, "/predict").status_code == 404
    listener.server.readiness.phase = "shutting_down"
    answer = get(listener, "/health/ready")
    assert answer.status_code == 503 and answer.json()["status"] == "shutting_down"
    assert get(listener, "/v2/health/ready").status_code == 400


def test_liveness_fails_when_the_event_loop_stops_ticking(listener):
    asyncio.run(listener.heartbeat())
    assert get(listener, "/health/live").status_code == 200
    listener.server.last_beat = time.monotonic() - STALL_S - 1
    for path in ("/health/live", "/v2/health/live", "/health/ready"):
        assert get(listener, path).status_code == 503, path
    asyncio.run(listener.heartbeat())
    assert get(listener, "/v2/health/live").json() == {"live": True}
