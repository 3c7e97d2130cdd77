"""The gRPC port's hold on a port whose last server's connections are in TIME_WAIT (a service
restarted after serving gRPC clients): held at once with SO_REUSEADDR, then held strictly once the
kernel allows it, never left free in between."""

from __future__ import annotations

import socket
import time

from bench import server_process
from service.launcher import ports
from tests.support import RELIABILITY, free_port

HOST = "127.0.0.1"


def leave_time_wait(port: int) -> None:
    """A served connection closed by the server first: the server's side stays in TIME_WAIT."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((HOST, port))
    listener.listen()
    client = socket.create_connection((HOST, port))
    accepted, _ = listener.accept()
    accepted.close()
    time.sleep(0.1)
    client.close()
    listener.close()


def plain_bind_fails(port: int) -> bool:
    with socket.socket() as stranger:
        try:
            stranger.bind((HOST, port))
        except OSError:
            return True
    return False


def test_a_port_in_time_wait_is_held_at_once():
    port = free_port(RELIABILITY.ports)
    leave_time_wait(port)
    held = ports.hold_grpc(HOST, port)
    try:
        assert [ports.is_loose(s) for s in held] == [True]
        assert plain_bind_fails(port)
    finally:
        for s in held:
            s.close()


def test_a_loose_hold_is_tightened_on_the_same_port():
    port = free_port(RELIABILITY.ports)
    loose = ports._bound(socket.AF_INET, HOST, port, reuse_address=True)
    tightened = ports.tighten([loose])
    try:
        assert loose.fileno() == -1  # closed once its strict replacement was bound
        assert [ports.is_loose(s) for s in tightened] == [False]
        assert tightened[0].getsockname() == (HOST, port)
        assert plain_bind_fails(port)
        assert ports.tighten(tightened) == tightened  # a strict hold is left as it is
    finally:
        for s in tightened:
            s.close()


def test_a_free_port_is_one_no_connection_holds_while_there_is_one():
    """A test binds its blocker without SO_REUSEADDR: a port in TIME_WAIT would refuse it."""
    port = next(
        p
        for p in RELIABILITY.ports[:-1]
        if all(server_process.port_is_free(q, time_wait_allowed=False) for q in (p, p + 1))
    )
    leave_time_wait(port)
    assert plain_bind_fails(port)
    assert server_process.free_port(range(port, port + 2)) == port + 1  # looking from port on
    assert not plain_bind_fails(port + 1)
    # a server's SO_REUSEADDR binds it
    assert server_process.free_port(range(port, port + 1)) == port
