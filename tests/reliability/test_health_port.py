"""``VITSERVE_HEALTH_PORT`` under ``python -m service`` with two front ends: the supervisor
answers it, from what its children report (service/launcher/health.py).

- Probes there do not wait for any front end: with every front end stopped (SIGSTOP), they are answered
  at once, and liveness fails once their event loops have not ticked for STALL_S
  (docs/decisions.md#health-off-the-event-loop).
- Readiness there follows the engine: not ready at once when it is killed, ready again once it has
  reloaded its models; not ready at once on SIGTERM, and live through the drain.
- The port is the service's own: one in use stops start-up (exit 3) naming it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench import server_process
from bench.reliability.supervision import engine_and_front_ends, wait_for
from service.frontend.probes import STALL_S
from tests.proc import assert_forked_holding_their_own_listener, command_line, listening_ports
from tests.support import (
    RELIABILITY,
    encode,
    server_env,
    service_process,
    start_process,
    stop_process,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROBES = ("/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready")


@contextlib.contextmanager
def service(
    repository: Path, log: Path, workers: int = 2
) -> Iterator[tuple[server_process.RunningServer, int]]:
    """A real service (two front ends by default), ready, and its health port (a free one of the
    suite's range, not the HTTP port)."""
    chosen: list[int] = []

    def env(port: int) -> dict[str, str]:
        health = next(
            p for p in reversed(RELIABILITY.ports) if p != port and server_process.port_is_free(p)
        )
        chosen.append(health)
        return server_env(repository, port, RELIABILITY, workers=workers, health_port=health)

    with service_process(env, log, RELIABILITY) as server:
        yield server, chosen[-1]


def probe(port: int, path: str, timeout_s: float = 2.0) -> int:
    """The status of one GET on the health port; 0 when it was not answered in ``timeout_s``."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=timeout_s).status_code
    except httpx.HTTPError:
        return 0


def test_probes_are_answered_while_every_front_end_is_stopped(model_repository, tmp_path):
    with service(model_repository, tmp_path / "server.log") as (server, health_port):
        _, front_ends = engine_and_front_ends(server.process.pid)
        assert len(front_ends) == 2
        assert [probe(health_port, path) for path in PROBES] == [200] * 4
        for pid in front_ends:
            os.kill(pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            # answered at once, by the supervisor: the front ends' loops are not needed
            assert [probe(health_port, path) for path in PROBES] == [200] * 4
            wait_for(lambda: probe(health_port, "/health/live") == 503, STALL_S + 5, "not live")
            # each beat is at most about 2 s old when its loop stops
            assert time.monotonic() - stopped > STALL_S - 3
            assert probe(health_port, "/v2/health/live") == 503
            assert probe(health_port, "/health/ready") == 503
        finally:
            for pid in front_ends:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: probe(health_port, "/health/live") == 200, 10, "live again")
        wait_for(lambda: probe(health_port, "/health/ready") == 200, 10, "ready again")


def test_readiness_follows_the_engine_and_sigterm(model_repository, tmp_path):
    with service(model_repository, tmp_path / "server.log") as (server, health_port):
        engine, _ = engine_and_front_ends(server.process.pid)
        assert probe(health_port, "/health/ready") == 200
        os.kill(engine, signal.SIGKILL)
        wait_for(lambda: probe(health_port, "/health/ready") == 503, 1, "not ready")
        answer = httpx.get(f"http://127.0.0.1:{health_port}/health/ready", timeout=2).json()
        assert answer == {"status": "unavailable", "ready": False}
        lives = []

        def ready_again() -> bool:
            lives.append(probe(health_port, "/health/live"))
            return probe(health_port, "/health/ready") == 200

        wait_for(ready_again, 60, "ready again")
        assert set(lives) == {200}, lives  # the engine's restart is not a liveness failure
        assert httpx.get(server.url + "/health/ready", timeout=5).status_code == 200

        os.kill(server.process.pid, signal.SIGTERM)
        drain_lives: list[int] = []  # liveness, probed once readiness says shutting down

        def shutting_down() -> bool:
            try:
                ready = httpx.get(f"http://127.0.0.1:{health_port}/health/ready", timeout=2)
            except httpx.HTTPError:
                return False
            if ready.status_code != 503:
                return False
            assert ready.json() == {"status": "shutting_down", "ready": False}
            drain_lives.append(probe(health_port, "/health/live"))
            return True

        wait_for(shutting_down, 1, "not ready on SIGTERM")
        # a drain is no liveness failure; with nothing in flight it can end, and the port close
        # (probe: 0), before the next probe
        assert drain_lives and all(live in (200, 0) for live in drain_lives), drain_lives
        assert server.process.wait(60) == 0


def test_front_ends_hold_no_probe_port_and_one_spawned_once_the_probes_run_serves(
    model_repository, tmp_path, fashion_images
):
    """The front ends are forked before the probe listener's thread starts, and drop its port: one
    that held it would keep it bound past the supervisor. Once that thread runs, a killed front end
    is spawned, not forked (a lock the thread held would stay held in the child), and serves."""
    with service(model_repository, tmp_path / "server.log") as (server, health_port):
        supervisor = server.process.pid
        _, front_ends = engine_and_front_ends(supervisor)
        assert_forked_holding_their_own_listener(supervisor, server.port, front_ends)
        assert listening_ports(supervisor).count(health_port) == 1
        os.kill(front_ends[0], signal.SIGKILL)
        wait_for(
            lambda: len(set(engine_and_front_ends(supervisor)[1]) - set(front_ends)) == 1,
            30,
            "a new front end",
        )
        (spawned,) = set(engine_and_front_ends(supervisor)[1]) - set(front_ends)
        assert "--multiprocessing-fork" in command_line(spawned), command_line(spawned)
        wait_for(lambda: listening_ports(spawned) == [server.port], 30, "the new one's listener")
        png = encode(fashion_images[0])
        answers = {
            httpx.post(server.url + "/predict", files={"files": ("a.png", png)}).status_code
            for _ in range(20)  # new connections: the kernel spreads them over both front ends
        }
        assert answers == {200}, answers
        assert probe(health_port, "/health/ready") == 200


def test_a_single_process_answers_its_health_port_itself(model_repository, tmp_path):
    with service(model_repository, tmp_path / "server.log", workers=0) as (server, health_port):
        assert engine_and_front_ends(server.process.pid) == (None, [])
        assert [probe(health_port, path) for path in PROBES] == [200] * 4
        os.kill(server.process.pid, signal.SIGTERM)
        wait_for(lambda: probe(health_port, "/health/ready") != 200, 5, "not ready on SIGTERM")


def test_a_health_port_in_use_stops_start_up_naming_it(model_repository, tmp_path):
    log = tmp_path / "server.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        http_port = server_process.free_port(RELIABILITY.ports)
        env = server_env(model_repository, http_port, RELIABILITY, workers=2, health_port=port)
        process = start_process(["-m", "service"], env, log)
        try:
            assert process.wait(90) == 3
        finally:
            stop_process(process)
    text = log.read_text()
    assert f"cannot start: cannot listen on 127.0.0.1, health port {port}" in text, text
    assert "Traceback" not in text
