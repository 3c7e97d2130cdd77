"""The gRPC port under ``python -m service``: held by the supervisor for the service's whole life, so
that no other program takes it before the front ends bind or while they are down (another user's
process once did, read the next client's bearer token, and every new front end then failed to bind:
HTTP was down with it); and a front end that cannot bind gRPC still serves HTTP.

What the kernel allows (service/launcher/ports.py): a socket joins a port's SO_REUSEPORT group only
beside sockets that all have SO_REUSEPORT and the same user. The squatters here are another user's
process with SO_REUSEPORT, and a process of the service's own user binding as most servers do
(SO_REUSEADDR): each tries every 2 ms from before the service starts until its front ends have all
been killed and replaced.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench import server_process
from bench.reliability.supervision import engine_and_front_ends, wait_for
from service.launcher.local_app import local_app
from tests.proc import listening_ports
from tests.support import RELIABILITY, free_port, make_settings, server_env

pytestmark = pytest.mark.timeout(180)

SQUATTER = """
import socket, sys, time
reuse = socket.SO_REUSEPORT if sys.argv[2] == "reuseport" else socket.SO_REUSEADDR
while True:
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, reuse, 1)
    try:
        squatter.bind(("127.0.0.1", int(sys.argv[1])))
        squatter.listen()
    except OSError:
        squatter.close()
        time.sleep(0.002)
        continue
    print("bound", flush=True)
    time.sleep(3600)
"""


def squat(port: int, how: str, user: int | None = None) -> subprocess.Popen:
    # the system's Python: another user may not read this checkout's virtual environment
    return subprocess.Popen(
        ["/usr/bin/python3", "-c", SQUATTER, str(port), how],
        stdout=subprocess.PIPE,
        text=True,
        user=user,
    )


def grpc_ready(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            return stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=2).ready
        except grpc.RpcError:
            return False


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's squatter needs root to become one")
def test_no_squatter_takes_the_grpc_port_from_start_through_front_end_deaths(
    model_repository, tmp_path
):
    port = free_port(RELIABILITY.ports)
    grpc_port = next(p for p in iter(lambda: free_port(RELIABILITY.ports), None) if p != port)
    env = server_env(model_repository, port, RELIABILITY, workers=2, grpc_port=grpc_port)
    log = tmp_path / "server.log"
    service = server_process.spawn(["nice", "-n", "10", sys.executable, "-m", "service"], env, log)
    squatters = []
    try:
        # the supervisor binds the HTTP port, then the gRPC port, before any child starts: the
        # squatters start as soon as it listens, while the front ends still import
        wait_for(lambda: port in listening_ports(service.pid), 30, "the HTTP listeners")
        squatters = [squat(grpc_port, "reuseport", user=65534), squat(grpc_port, "reuseaddr")]
        url = f"http://127.0.0.1:{port}"
        server_process.wait_ready(service, url, log, timeout_s=60, poll_s=0.05)
        wait_for(lambda: grpc_ready(grpc_port), 30, "gRPC ready")
        _, front_ends = engine_and_front_ends(service.pid)
        for pid in front_ends:  # both at once: for a moment no front end holds the port
            os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: (
                len(engine_and_front_ends(service.pid)[1]) == 2
                and not set(front_ends) & set(engine_and_front_ends(service.pid)[1])
            ),
            30,
            "two new front ends",
        )
        wait_for(lambda: grpc_ready(grpc_port), 30, "gRPC ready again")
        time.sleep(1.0)  # the squatters try on while the new front ends serve
        for squatter in squatters:
            assert squatter.poll() is None, "a squatter bound the gRPC port"
        output = log.read_text()
        assert "cannot listen for gRPC" not in output
        assert output.count("died") == 2, output  # the two kills, no crash loop
    finally:
        for squatter in squatters:
            squatter.kill()
            squatter.wait()
        server_process.stop_process(service, timeout_s=60)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_front_end_that_cannot_bind_grpc_serves_http_and_binds_once_it_can(model_repository):
    grpc_port = free_port(RELIABILITY.ports)
    blocker = socket.socket()  # what a front end meets when something else holds the port
    blocker.bind(("127.0.0.1", grpc_port))
    blocker.listen()
    settings = make_settings(model_repository, RELIABILITY, grpc_port=grpc_port)
    app = local_app(settings, worker=0)
    records = Records()
    logging.getLogger("vitserve").addHandler(records)
    try:
        with TestClient(app) as client:
            assert client.get("/health/ready").status_code == 200
            assert any(
                "front end 0 serves HTTP, and gRPC once the port can be bound" in line
                for line in records.lines
            ), records.lines
            assert not grpc_ready(grpc_port)
            blocker.close()
            wait_for(lambda: grpc_ready(grpc_port), 30, "gRPC once the port is free")
            assert client.get("/health/ready").status_code == 200
    finally:
        logging.getLogger("vitserve").removeHandler(records)
        blocker.close()


def test_a_single_process_that_cannot_bind_grpc_does_not_start(model_repository):
    grpc_port = free_port(RELIABILITY.ports)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", grpc_port))
        blocker.listen()
        settings = make_settings(model_repository, RELIABILITY, grpc_port=grpc_port)
        with (
            pytest.raises(OSError, match="cannot listen for gRPC"),
            TestClient(local_app(settings)),
        ):
            pass
