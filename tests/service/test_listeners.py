"""The supervisor's HTTP listeners: one per front end on the same port, and connections spread over them
(from one shared socket, one of two front ends took 49 of 64 connections while the other idled)."""

from __future__ import annotations

import contextlib
import select
import socket

import pytest

from service.launcher.ports import check_free, listen


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_connections_spread_over_every_front_ends_listener():
    port = free_port()
    listeners = listen("127.0.0.1", port, 2)
    clients = []
    try:
        assert len({each.fileno() for each in listeners}) == 2
        assert all(each.getsockname()[1] == port for each in listeners)
        for _ in range(64):  # distinct source ports: the kernel spreads them by their addresses
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        accepted = [0, 0]
        for index, listener in enumerate(listeners):
            listener.setblocking(False)
            while select.select([listener], [], [], 0.5)[0]:
                connection, _ = listener.accept()
                connection.close()
                accepted[index] += 1
        assert sum(accepted) == 64
        # binomial(64, 1/2): fewer than 12 on a side has a chance under 1e-7
        assert min(accepted) >= 12, accepted
    finally:
        for client in clients:
            client.close()
        for listener in listeners:
            listener.close()


def test_a_port_held_by_another_program_is_refused():
    with socket.socket() as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # even one that shares
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        port = stranger.getsockname()[1]
        with pytest.raises(OSError, match="in use"):
            check_free("127.0.0.1", port)
        with pytest.raises(OSError, match="in use"):
            listen("127.0.0.1", port, 2)


def test_a_port_left_in_time_wait_is_free():
    """A restart right after a run whose connections the server closed (TIME_WAIT) still binds."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the last run's listeners
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        connection, _ = server.accept()
        connection.close()  # the server side closes first: its end waits in TIME_WAIT
        client.close()
    check_free("127.0.0.1", port)
    for listener in listen("127.0.0.1", port, 2):
        with contextlib.closing(listener):
            pass
