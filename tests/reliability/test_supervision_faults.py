"""The supervisor under the faults it once lost the service to: an engine killed while it reloads, a
stalled front end, a full TMPDIR, and what a killed supervisor or dead processes leave behind.

Each test runs a real ``python -m service`` with two front ends and checks the promise against the
processes themselves (/proc) and the files they leave, not against the supervisor's own bookkeeping.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from bench.machine import descendants
from bench.reliability.supervision import (
    Load,
    alive,
    engine_and_front_ends,
    ready,
    state_of,
    wait_for,
)
from service.link.arena import PREFIX, SHM
from tests.reliability.full_disk import full_tmpfs
from tests.reliability.supervised import start
from tests.support import metric

pytestmark = pytest.mark.timeout(240)


def test_an_engine_killed_while_it_reloads_is_restarted_again(
    model_repository, tmp_path, fashion_png
):
    """kill -9 of the engine, then of its replacement before that one has loaded its models: the
    service comes back ready (it stopped, exit 3, when the supervisor asked whether the current
    engine had started rather than whether any engine ever had)."""
    with start(model_repository, tmp_path) as server:
        supervisor = server.process.pid
        first, front_ends = engine_and_front_ends(supervisor)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: engine_and_front_ends(supervisor)[0] not in (None, first), 30, "engine")
        second = engine_and_front_ends(supervisor)[0]
        assert not ready(server.url)  # still loading: the kill lands during its restart
        os.kill(second, signal.SIGKILL)
        wait_for(lambda: ready(server.url), 60, "ready again")
        assert server.process.poll() is None, server.output()[-3000:]
        third, front_ends_now = engine_and_front_ends(supervisor)
        assert third not in (first, second) and front_ends_now == front_ends
        # ready on the front end that answered the probe; the other may still be reaching the new
        # engine for a moment, and a request there waits for it (RemoteEngine.table_to_route_by)
        for _ in range(8):
            answer = httpx.post(server.url + "/predict", files={"files": ("a.png", fashion_png)})
            assert answer.status_code == 200, answer.text
        # the restarts' backoff: the replacement that died loading waits 0.5 s; the third engine,
        # ready when killed, is restarted at once (its death is the third within 30 s, not a loop)
        os.kill(third, signal.SIGKILL)
        wait_for(lambda: engine_and_front_ends(supervisor)[0] not in (None, third), 30, "engine")
        wait_for(lambda: ready(server.url), 60, "ready again")
        restarts = [line for line in server.output().splitlines() if "restarting it" in line]
        assert [line.split("restarting it")[1] for line in restarts] == ["", " in 0.5 s", ""]


def test_a_stalled_front_end_is_killed_and_replaced(model_repository, tmp_path, fashion_png):
    """A SIGSTOPped front end never answers what its listener holds: its heartbeat stops, and the
    supervisor kills it (KILL_STALLED_S, 15 s) and starts another."""
    with start(model_repository, tmp_path) as server:
        supervisor = server.process.pid
        _, front_ends = engine_and_front_ends(supervisor)
        os.kill(front_ends[0], signal.SIGSTOP)
        try:
            wait_for(lambda: state_of(front_ends[0]) in (None, "Z"), 40, "the stalled one's end")
            wait_for(lambda: len(engine_and_front_ends(supervisor)[1]) == 2, 30, "a new front end")
        finally:
            if state_of(front_ends[0]) not in (None, "Z"):
                os.kill(front_ends[0], signal.SIGCONT)
        assert front_ends[1] in engine_and_front_ends(supervisor)[1]  # the other one untouched
        assert "its event loop has not ticked" in server.output()
        with Load(server.url, fashion_png, clients=4) as load:
            wait_for(lambda: load.answered >= 40, 30, "answers from both front ends")
        assert not load.failures and not load.unexpected, (load.failures, load.unexpected)


def run_dirs(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("vitserve-"))


def arena_blocks(supervisor: int) -> list[str]:
    return [n for n in os.listdir(SHM) if n.startswith(f"{PREFIX}-{supervisor}-")]


def test_what_a_killed_supervisor_left_is_removed_by_the_next_one(
    model_repository, tmp_path, monkeypatch, fashion_png
):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    with start(model_repository, tmp_path, "first.log") as server:
        first = server.process.pid
        children = descendants(first)
        httpx.post(server.url + "/predict", files={"files": ("a.png", fashion_png)})
        os.kill(first, signal.SIGKILL)
        server.process.wait(10)
        wait_for(lambda: not alive(children), 30, "the children's exit")
    (left,) = run_dirs(tmpdir)  # what a kill -9 leaves: the supervisor cleans up nothing
    assert left.startswith(f"vitserve-{first}-")
    leftover_block = Path(SHM) / f"{PREFIX}-{first}-0-1"
    leftover_block.write_bytes(b"\0" * 4096)  # as a front end killed with it would leave it
    try:
        with start(model_repository, tmp_path, "second.log") as server:
            (own,) = run_dirs(tmpdir)
            assert own.startswith(f"vitserve-{server.process.pid}-")
            assert not arena_blocks(first)
    finally:
        leftover_block.unlink(missing_ok=True)
    assert run_dirs(tmpdir) == []  # and a supervisor stopped by SIGTERM leaves none


def test_dead_processes_metric_files_go_and_their_counts_stay(
    model_repository, tmp_path, monkeypatch, fashion_png
):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    with start(model_repository, tmp_path) as server:
        supervisor = server.process.pid
        (run_dir,) = run_dirs(tmpdir)
        metrics_dir = tmpdir / run_dir / "metrics"
        for _ in range(10):
            httpx.post(server.url + "/predict", files={"files": ("a.png", fashion_png)})

        def answered() -> float:
            text = httpx.get(server.url + "/metrics").text
            return metric(text, "vitserve_http_requests_total", route="/predict", status="200")

        before = answered()
        assert before >= 10
        files_before = len(list(metrics_dir.iterdir()))
        for _ in range(3):
            _, front_ends = engine_and_front_ends(supervisor)
            os.kill(front_ends[0], signal.SIGKILL)
            wait_for(
                lambda killed=front_ends[0]: (
                    killed not in engine_and_front_ends(supervisor)[1]
                    and len(engine_and_front_ends(supervisor)[1]) == 2
                ),
                30,
                "a new front end",
            )
            wait_for(lambda: ready(server.url), 30, "ready")
        assert answered() >= before  # the dead front ends' counts are kept
        files = sorted(p.name for p in metrics_dir.iterdir())
        engine, front_ends = engine_and_front_ends(supervisor)
        owners = {str(pid) for pid in [engine, *front_ends]} | {"archive"}
        assert {name.rsplit("_", 1)[1].removesuffix(".db") for name in files} <= owners, files
        assert len(files) <= files_before + 3, files  # + the archive files, not + per death


def test_a_full_tmpdir_neither_kills_nor_restarts_any_process(
    model_repository, tmp_path, monkeypatch, fashion_png
):
    """TMPDIR on a tmpfs with two pages free (Python's tempfile passes over a TMPDIR it cannot write a
    page to; the run directory and its socket take none; each metric file wants 64 KiB): the
    service serves, /metrics answers (missing what could not be written), nothing dies of SIGBUS
    and nothing is restarted."""
    with full_tmpfs(1024, 8192) as full:
        monkeypatch.setenv("TMPDIR", str(full))
        with start(model_repository, tmp_path) as server:
            processes = engine_and_front_ends(server.process.pid)
            with Load(server.url, fashion_png, clients=4) as load:
                wait_for(lambda: load.answered >= 100, 60, "answers")
            assert httpx.get(server.url + "/metrics").status_code == 200
            assert engine_and_front_ends(server.process.pid) == processes
            assert not load.failures and not load.unexpected, (load.failures, load.unexpected)
            assert "died" not in server.output()
            assert "cannot write to PROMETHEUS_MULTIPROC_DIR" in server.output()
            assert any(p.name.startswith("vitserve-") for p in full.iterdir())  # it was TMPDIR
        assert [p.name for p in full.iterdir()] == ["filler"]
