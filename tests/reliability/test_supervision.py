"""The processes of ``python -m service`` under kill -9: a front end, the engine, the supervisor.

Each test runs a real service with two front ends and keeps a steady load on it while it kills one of its
processes, then checks what the issue promises: only the killed front end's requests are lost, the engine's
death turns readiness false at once and the front ends answer 503 with Retry-After until it is back, and no
process is left orphaned or a zombie. The figures for RELIABILITY.md come from
``python -m bench.reliability.supervision``, which runs the same scenarios longer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import server_process
from bench.machine import descendants, parse_pid_stat
from bench.reliability.supervision import (
    Load,
    alive,
    engine_and_front_ends,
    state_of,
    wait_for,
)
from tests.proc import assert_forked_holding_their_own_listener
from tests.reliability.supervised import start
from tests.support import (
    RELIABILITY,
    free_port,
    server_env,
)

pytestmark = pytest.mark.timeout(180)


def test_a_killed_front_end_is_restarted_and_only_its_requests_are_lost(
    model_repository, tmp_path, fashion_png
):
    with start(model_repository, tmp_path) as server:
        engine, front_ends = engine_and_front_ends(server.process.pid)
        assert len(front_ends) == 2
        assert_forked_holding_their_own_listener(server.process.pid, server.port, front_ends)
        with Load(server.url, fashion_png, clients=4) as load:
            wait_for(lambda: load.answered >= 20, 30, "answers before the kill")
            os.kill(front_ends[0], signal.SIGKILL)
            wait_for(
                lambda: (
                    len(engine_and_front_ends(server.process.pid)[1]) == 2
                    and front_ends[0] not in engine_and_front_ends(server.process.pid)[1]
                ),
                30,
                "a new front end",
            )
            answered = load.answered
            wait_for(lambda: load.answered >= answered + 20, 30, "answers after the restart")
        # a front end holds at most one request per client connection it had
        assert load.failed <= 4, load.failures
        assert engine_and_front_ends(server.process.pid)[0] == engine  # the engine was not touched
        assert all(state_of(pid) != "Z" for pid in descendants(server.process.pid))
        # no other thread in the supervisor (no health port): the new one is forked too
        assert_forked_holding_their_own_listener(
            server.process.pid, server.port, engine_and_front_ends(server.process.pid)[1]
        )


def test_a_killed_engine_turns_readiness_off_at_once_and_comes_back(
    model_repository, tmp_path, fashion_png
):
    import httpx

    with start(model_repository, tmp_path) as server:
        engine, _ = engine_and_front_ends(server.process.pid)
        with Load(server.url, fashion_png, clients=4) as load:
            wait_for(lambda: load.answered >= 20, 30, "answers before the kill")
            os.kill(engine, signal.SIGKILL)
            # the front ends watch the engine's pid: not ready at once, not after a heartbeat
            wait_for(
                lambda: httpx.get(server.url + "/health/ready").status_code == 503, 1, "not ready"
            )
            refused = httpx.post(server.url + "/predict", files={"files": ("a.png", fashion_png)})
            wait_for(
                lambda: httpx.get(server.url + "/health/ready").status_code == 200, 60, "ready"
            )
            answered = load.answered
            wait_for(lambda: load.answered >= answered + 20, 30, "answers after the restart")
        new_engine, front_ends = engine_and_front_ends(server.process.pid)
        assert new_engine not in (None, engine) and len(front_ends) == 2
        assert not load.unexpected and not load.failures, (load.unexpected, load.failures)
        if refused.status_code != 200:  # the engine may already be back by this request
            assert refused.status_code == 503 and refused.headers["Retry-After"]


def test_a_killed_supervisor_leaves_no_process_behind(model_repository, tmp_path):
    with start(model_repository, tmp_path) as server:
        children = descendants(server.process.pid)
        assert len(children) >= 3  # the engine and two front ends
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        try:
            wait_for(lambda: not alive(children), 30, "exit")
        except AssertionError:
            pytest.fail(what_runs(server, alive(children), "30 s after the supervisor's kill -9"))


def test_sigterm_stops_every_process_and_exits_0(model_repository, tmp_path, fashion_png):
    import httpx

    with start(model_repository, tmp_path) as server:
        children = descendants(server.process.pid)
        assert httpx.post(
            server.url + "/predict", files={"files": ("a.png", fashion_png)}
        ).is_success
        os.kill(server.process.pid, signal.SIGTERM)
        assert stopped(server, children, 60) == 0
        started = time.monotonic()
        while time.monotonic() - started < 10 and any(state_of(p) for p in children):
            time.sleep(0.05)
        assert not [p for p in children if state_of(p)], "a process outlived the supervisor"


@pytest.mark.parametrize("signal_sent", [signal.SIGKILL, signal.SIGINT], ids=["kill", "int"])
def test_a_front_end_killed_while_it_waits_for_the_engine_does_not_stop_the_start(
    model_repository, tmp_path, signal_sent
):
    """The engine held (SIGSTOP) before it loads, a front end killed while it waits, then the engine
    let go: the service still becomes ready. (With a ``multiprocessing.Event`` to wait on, the engine
    hung in its ``set()``, waiting for the dead waiter to wake, and the service never was.) A SIGINT
    stops that front end alone: forked from the supervisor, it must not run the supervisor's
    handler, which would stop the other front end and the engine."""
    port = free_port(RELIABILITY.ports)
    env = server_env(model_repository, port, RELIABILITY, workers=2)
    log = tmp_path / "server.log"
    process = server_process.spawn(["nice", "-n", "10", sys.executable, "-m", "service"], env, log)
    try:
        engine = None
        while engine is None:
            assert process.poll() is None, server_process.log_tail(log)
            engine, _ = engine_and_front_ends(process.pid)
        os.kill(engine, signal.SIGSTOP)
        try:
            wait_for(lambda: len(engine_and_front_ends(process.pid)[1]) == 2, 60, "front ends")
            front_ends = engine_and_front_ends(process.pid)[1]
            wait_for(lambda: all(map(waiting, front_ends)), 60, "front ends waiting")
            os.kill(front_ends[0], signal_sent)
            wait_for(lambda: state_of(front_ends[0]) in (None, "Z"), 10, "the kill")
        finally:
            os.kill(engine, signal.SIGCONT)
        url = f"http://127.0.0.1:{port}"
        server_process.wait_ready(process, url, log, timeout_s=60, poll_s=0.1)
        engine_now, front_ends_now = engine_and_front_ends(process.pid)
        assert engine_now == engine and front_ends[1] in front_ends_now
    finally:
        server_process.stop_process(process, timeout_s=60)


def waiting(pid: int, over_s: float = 1.0) -> bool:
    """The process has used less than 3 % of a core over ``over_s``: done with its imports, it waits."""
    before = cpu_ticks(pid)
    time.sleep(over_s)
    return cpu_ticks(pid) - before < 0.03 * over_s * os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    return parse_pid_stat(Path(f"/proc/{pid}/stat").read_text())[1]


# Set as freeze_heap, the last step before uvicorn runs: the SIGTERM's handler then runs inside a
# weakref callback (signal.raise_signal runs the handler at once), as a supervisor's death during
# start-up once made it do (a full collection calls weakref callbacks).
SIGTERM_IN_A_WEAKREF_CALLBACK = """
import signal, sys, weakref
from service.launcher.local_app import local_app
from service.launcher import http_server
from service.settings import Settings


class Thing:
    pass


def freeze_heap():
    thing = Thing()
    ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGTERM))
    del thing


http_server.freeze_heap = freeze_heap
settings = Settings()
sys.exit(http_server.serve_http(local_app(settings), settings))
"""


def test_a_sigterm_before_uvicorn_runs_stops_the_front_end_wherever_it_lands(
    model_repository, tmp_path
):
    """An exception raised by a signal handler is lost in a weakref callback or a __del__: a front end
    whose handler raised SystemExit went on serving, orphaned, after its supervisor's death."""
    port = free_port(RELIABILITY.ports)
    env = server_env(model_repository, port, RELIABILITY)
    log = tmp_path / "server.log"
    process = server_process.spawn([sys.executable, "-c", SIGTERM_IN_A_WEAKREF_CALLBACK], env, log)
    try:
        code = process.wait(60)
    except subprocess.TimeoutExpired:
        server_process.stop_process(process, timeout_s=10)
        pytest.fail(f"still serving 60 s after a SIGTERM:\n{server_process.log_tail(log)}")
    assert code == 0, server_process.log_tail(log)
    assert "Shutting down" in log.read_text() or "Finished server process" in log.read_text()


def stopped(server, children: list[int], timeout_s: float) -> int:
    """The service's exit code once it has stopped; when it has not within ``timeout_s``, a failure
    that says what still runs."""
    try:
        return server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(
            what_runs(
                server, alive([server.process.pid, *children]), f"{timeout_s:g} s after SIGTERM"
            )
        )


def what_runs(server, running: list[int], when: str) -> str:
    """What a failure says of the processes still ``running``: where each one's threads are (py-spy)
    and the log's end (a service that does not stop is seldom caught twice)."""
    py_spy = str(Path(sys.executable).with_name("py-spy"))
    dumps = []
    for pid in running:
        try:
            dump = subprocess.run(
                [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
            )
            dumps.append(f"--- pid {pid}\n{dump.stdout}{dump.stderr}")
        except (OSError, subprocess.TimeoutExpired) as error:
            dumps.append(f"--- pid {pid}: no dump ({error})")
    log = "\n".join(server.log.read_text(errors="replace").splitlines()[-40:])
    return (
        f"processes still running {when}: {running}\n"
        + "\n".join(dumps)
        + f"\n--- the log's end:\n{log}"
    )
