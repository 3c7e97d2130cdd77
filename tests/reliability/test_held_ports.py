"""``ports.hold_grpc``: what another user can bind beside the supervisor's held gRPC socket (nothing), and
what the front ends' gRPC servers can (the port), for each kind of host grpc serves. Checked against the
kernel itself: a process of another user (uid 65534) tries every address grpc would serve, with
SO_REUSEPORT and with SO_REUSEADDR."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from concurrent import futures

import grpc
import pytest

from service.launcher.ports import hold_grpc, is_loose
from tests.support import RELIABILITY, free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="another user's process needs root")

BINDS = """
import json, socket, sys
port, found = int(sys.argv[1]), {}
for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"),
                        (socket.AF_INET6, "::1"), (socket.AF_INET6, "::")):
    for option in ("SO_REUSEPORT", "SO_REUSEADDR"):
        squatter = socket.socket(family)
        squatter.setsockopt(socket.SOL_SOCKET, getattr(socket, option), 1)
        try:
            squatter.bind((address, port))
            squatter.listen()
            found[f"{address} {option}"] = "bound"
        except OSError as error:
            found[f"{address} {option}"] = error.errno
        squatter.close()
print(json.dumps(found))
"""


def binds_of_another_user(port: int) -> dict[str, object]:
    done = subprocess.run(
        ["/usr/bin/python3", "-c", BINDS, str(port)],
        capture_output=True,
        text=True,
        user=65534,
        timeout=30,
        check=True,
    )
    return json.loads(done.stdout)


def strict_hold(host: str) -> tuple[list[socket.socket], int]:
    """A held port of the suite's that no earlier test's connections keep in TIME_WAIT: there the
    hold is loose until it can tighten (test_grpc_hold_time_wait.py), and SO_REUSEADDR binds beside."""
    for _ in range(20):
        port = free_port(RELIABILITY.ports)
        held = hold_grpc(host, port)
        if not any(is_loose(socket_) for socket_ in held):
            return held, port
        for socket_ in held:
            socket_.close()
    raise AssertionError("every port tried has connections in TIME_WAIT")


@pytest.mark.parametrize(
    ("host", "not_served"),
    [
        ("127.0.0.1", {"::1 SO_REUSEPORT", "::1 SO_REUSEADDR"}),  # another address: not grpc's
        ("localhost", set()),  # grpc serves 127.0.0.1 and ::1
        ("0.0.0.0", set()),  # grpc serves :: with IPv4 mapped
    ],
)
def test_another_user_binds_nothing_grpc_serves_and_grpc_binds_beside_the_held_port(
    host, not_served
):
    held, port = strict_hold(host)
    try:
        found = binds_of_another_user(port)
        assert {key for key, result in found.items() if result == "bound"} == not_served, found
        with socket.socket() as client:  # nothing listens: no connection waits in the holder
            assert client.connect_ex(("127.0.0.1", port)) != 0
        server = grpc.server(futures.ThreadPoolExecutor(1), options=[("grpc.so_reuseport", 1)])
        try:
            assert server.add_insecure_port(f"{host}:{port}") == port
        finally:
            server.stop(None)
    finally:
        for socket_ in held:
            socket_.close()
