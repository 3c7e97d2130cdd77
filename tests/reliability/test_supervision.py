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

from bench.machine import descendants
from bench.reliability.supervision import Load, engine_and_front_ends, state_of, wait_for
from tests.support import RELIABILITY, encode, running_server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def fashion_png(fashion_images) -> bytes:
    return encode(fashion_images[0])


def start(model_repository: Path, tmp_path: Path):
    return running_server(model_repository, tmp_path / "server.log", suite=RELIABILITY, workers=2)


def test_a_killed_front_end_is_restarted_and_only_its_requests_are_lost(
    model_repository, tmp_path, fashion_png
):
    with start(model_repository, tmp_path) as server:
        engine, front_ends = engine_and_front_ends(server.process.pid)
        assert len(front_ends) == 2
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
        wait_for(lambda: not [p for p in children if state_of(p) not in (None, "Z")], 30, "exit")


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


def stopped(server, children: list[int], timeout_s: float) -> int:
    """The service's exit code once it has stopped; when it has not within ``timeout_s``, a failure
    that says which processes still run, where each one's threads are (py-spy) and the log's end."""
    try:
        return server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    live = [p for p in [server.process.pid, *children] if state_of(p) not in (None, "Z")]
    py_spy = str(Path(sys.executable).with_name("py-spy"))
    dumps = []
    for pid in live:
        try:
            dump = subprocess.run(
                [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
            )
            dumps.append(f"--- pid {pid}\n{dump.stdout}{dump.stderr}")
        except (OSError, subprocess.TimeoutExpired) as error:
            dumps.append(f"--- pid {pid}: no dump ({error})")
    log = "\n".join(server.log.read_text(errors="replace").splitlines()[-40:])
    pytest.fail(
        f"the service had not stopped {timeout_s:g} s after SIGTERM; still running: {live}\n"
        + "\n".join(dumps)
        + f"\n--- the log's end:\n{log}"
    )
