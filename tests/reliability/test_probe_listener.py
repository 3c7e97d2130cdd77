"""``VITSERVE_HEALTH_PORT``'s listener and what it answers.

- In a single process (``workers=0``): the health routes from a thread of its own, whose liveness still
  follows the event loop (it fails once the loop has not ticked for STALL_S).
- Under the supervisor: what ``SupervisedHealth`` reads from the board its children write (the engine's
  readiness and beat, each front end's beat), as a clock moves on. The real processes are in
  ``test_health_port.py``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from service.frontend.probes import STALL_S, EventLoopHealth, ProbeListener, probe_answer
from service.launcher import health as health_module
from service.launcher.health import ENGINE_SILENT_S, HealthBoard, SupervisedHealth
from tests.support import RELIABILITY, free_port


@dataclass
class Phase:
    phase: str = "ready"

    @property
    def ready(self) -> bool:
        return self.phase == "ready"


@pytest.fixture
def loop_health() -> EventLoopHealth:
    return EventLoopHealth(Phase())


@pytest.fixture
def listener(loop_health) -> Iterator[ProbeListener]:
    probes = ProbeListener("127.0.0.1", free_port(RELIABILITY.ports), loop_health).start()
    try:
        yield probes
    finally:
        probes.close()


def get(probes: ProbeListener, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{probes.port}{path}", timeout=5)


def test_the_health_routes_and_nothing_else(listener, loop_health):
    assert get(listener, "/health/live").json() == {"status": "live", "ready": True}
    assert get(listener, "/health/ready").json() == {"status": "ready", "ready": True}
    assert get(listener, "/v2/health/live").json() == {"live": True}
    assert get(listener, "/v2/health/ready").json() == {"ready": True}
    assert get(listener, "/predict").status_code == 404
    loop_health.state.phase = "shutting_down"
    answer = get(listener, "/health/ready")
    assert answer.status_code == 503 and answer.json()["status"] == "shutting_down"
    assert get(listener, "/v2/health/ready").status_code == 400


def test_liveness_fails_when_the_event_loop_stops_ticking(listener, loop_health):
    asyncio.run(loop_health.heartbeat())
    assert get(listener, "/health/live").status_code == 200
    loop_health.last_beat = time.monotonic() - STALL_S - 1
    for path in ("/health/live", "/v2/health/live", "/health/ready"):
        assert get(listener, path).status_code == 503, path
    asyncio.run(loop_health.heartbeat())
    assert get(listener, "/v2/health/live").json() == {"live": True}


def test_the_port_is_its_own(listener, loop_health):
    """No SO_REUSEPORT: a second listener (another instance's) on the same port is refused."""
    with pytest.raises(OSError, match="in use"):
        ProbeListener("127.0.0.1", listener.port, loop_health)


# --- under the supervisor: the board -----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(health_module.time, "monotonic", clock)
    return clock


@pytest.fixture
def board() -> HealthBoard:
    return HealthBoard(multiprocessing.get_context("spawn"), front_ends=2)


def answer(health: SupervisedHealth, path: str) -> tuple[int, dict]:
    status, body = probe_answer(path, health, health.live)
    return status, json.loads(body)


ENGINE = 4242  # the engine's pid, as it writes it and front ends ready with it report it


def test_starting_is_live_and_not_ready(board, clock):
    health = SupervisedHealth(board)
    assert health.live and not health.ready
    assert answer(health, "/health/ready") == (503, {"status": "starting", "ready": False})
    board.engine_beat(ready=False, pid=ENGINE)  # loading its models
    board.front_end_beat(0, ready_with=0)
    assert health.live and not health.ready
    board.engine_beat(ready=True, pid=ENGINE)
    assert not health.ready  # the front end has not seen it ready yet
    board.front_end_beat(0, ready_with=ENGINE)
    assert health.ready  # the other front end is still starting: one serving is enough
    assert answer(health, "/v2/health/ready") == (200, {"ready": True})


def test_readiness_follows_the_engine(board, clock):
    health = SupervisedHealth(board)
    board.engine_beat(ready=True, pid=ENGINE)
    board.front_end_beat(0, ready_with=ENGINE)
    board.front_end_beat(1, ready_with=ENGINE)
    assert health.ready
    board.engine_beat(ready=False, pid=ENGINE)  # its default model's batcher failed, or it drains
    assert answer(health, "/health/ready") == (503, {"status": "unavailable", "ready": False})
    board.engine_beat(ready=True, pid=ENGINE)
    clock.now += ENGINE_SILENT_S  # ready when last heard, but not heard from since
    board.front_end_beat(0, ready_with=ENGINE)
    board.front_end_beat(1, ready_with=ENGINE)
    assert not health.ready and health.live
    board.engine_beat(ready=True, pid=ENGINE)
    assert health.ready
    board.engine_starting()  # the supervisor saw it die: not ready at once
    assert not health.ready and health.live
    assert answer(health, "/health/ready")[1]["status"] == "unavailable"


def test_after_an_engine_restart_every_serving_front_end_must_be_ready_with_the_new_one(
    board, clock
):
    """The engine is ready before the front ends have its first table: until each front end
    that serves is ready with it, a request could still be answered 503, so readiness waits."""
    health = SupervisedHealth(board)
    board.engine_beat(ready=True, pid=ENGINE)
    board.front_end_beat(0, ready_with=ENGINE)
    board.front_end_beat(1, ready_with=ENGINE)
    board.engine_starting()
    board.engine_beat(ready=True, pid=ENGINE + 1)  # restarted, its models loaded
    assert not health.ready  # both still report the engine that died
    board.front_end_beat(0, ready_with=ENGINE + 1)
    assert not health.ready  # front end 1 would still answer 503
    board.front_end_beat(1, ready_with=0)
    assert not health.ready
    board.front_end_beat(1, ready_with=ENGINE + 1)
    assert health.ready


def test_a_front_end_whose_loop_stopped_ticking_is_not_live(board, clock):
    health = SupervisedHealth(board)
    board.engine_beat(ready=True, pid=ENGINE)
    board.front_end_beat(0, ready_with=ENGINE)
    board.front_end_beat(1, ready_with=ENGINE)
    clock.now += STALL_S - 0.5
    board.engine_beat(ready=True, pid=ENGINE)
    board.front_end_beat(1, ready_with=ENGINE)
    assert health.live
    clock.now += 0.5
    assert health.stalled() == ["front end 0"]
    for path in ("/health/live", "/v2/health/live"):
        assert answer(health, path)[0] == 503, path
    board.front_end_starting(0)  # the supervisor restarts it: starting, not stalled
    assert health.live and health.ready


def test_a_stalled_engine_is_not_live(board, clock):
    health = SupervisedHealth(board)
    board.engine_beat(ready=True, pid=ENGINE)
    board.front_end_beat(0, ready_with=ENGINE)
    clock.now += STALL_S
    board.front_end_beat(0, ready_with=ENGINE)
    assert health.stalled() == ["engine"] and not health.ready
    assert answer(health, "/health/ready")[0] == 503


def test_no_front_end_serving_is_not_ready(board, clock):
    health = SupervisedHealth(board)
    board.engine_beat(ready=True, pid=ENGINE)
    assert not health.ready  # none has served yet
    board.front_end_beat(1, ready_with=ENGINE)
    assert health.ready
    board.front_end_draining(1)
    assert not health.ready and health.live  # draining is not a stall


def test_shutting_down_is_not_ready_and_still_live(board, clock):
    health = SupervisedHealth(board)
    board.engine_beat(ready=True, pid=ENGINE)
    board.front_end_beat(0, ready_with=ENGINE)
    assert health.ready
    health.stopping = True
    assert answer(health, "/health/ready") == (503, {"status": "shutting_down", "ready": False})
    assert answer(health, "/health/live") == (200, {"status": "live", "ready": True})
