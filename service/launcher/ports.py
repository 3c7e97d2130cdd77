"""The ports the supervisor serves, held by it for the service's whole life.

No other program may take a port while a front end is down or before the front ends bind: a
stranger on the gRPC port received the next client's calls, bearer token included, and every new
front end then failed to bind it. So the supervisor binds each port before any child starts and
closes it only when the service has stopped:

- HTTP: one listening socket per front end in a SO_REUSEPORT group (:func:`listen`);
- gRPC: a socket bound with SO_REUSEPORT and never listening (:func:`hold_grpc`), beside which each
  front end's gRPC server binds its own (``grpc.so_reuseport``), since grpcio cannot serve on a socket
  it is given;
- the health port: the probe listener's socket (service/frontend/probes.py).

The kernel lets a socket join a SO_REUSEPORT group only when every socket already bound there has
SO_REUSEPORT and the same effective uid: another user's bind then fails (EADDRINUSE), and so does any
bind without SO_REUSEPORT. A process of the service's own user can join, as it could also signal,
trace or read the service: the user is the boundary, so run the service as a user of its own.
"""

from __future__ import annotations

import errno
import socket

WILDCARDS = ("0.0.0.0", "::", "")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listen(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on ``port``, one per front end, in one SO_REUSEPORT group.

    The kernel spreads new connections over the group by their addresses, so each front end gets its
    share; from one shared socket, the process that happened to be waiting took most of them (49 of 64
    connections to one of two front ends, measured), and its clients waited while the other was idle.
    The supervisor keeps every socket open: connections that arrive for a front end that died wait in
    its socket's queue for the one that replaces it.
    """
    check_free(host, port)
    listeners = []
    try:
        for _ in range(count):
            listener = socket.socket(_family(host), socket.SOCK_STREAM)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listener.bind((host, port))
            listener.listen(2048)
            listener.set_inheritable(True)
    except OSError:
        for listener in listeners:
            listener.close()
        raise
    return listeners


def hold_grpc(host: str, port: int) -> list[socket.socket]:
    """The gRPC port, bound with SO_REUSEPORT and not listening, for as long as it stays open.

    Not listening: the kernel hands connections to listening sockets only, so none wait in the
    supervisor's while the front ends' gRPC servers take them. Without SO_REUSEADDR: beside a bound
    socket that does not listen, the kernel lets any socket with SO_REUSEADDR bind, whatever its
    user (measured). Every address grpc serves for ``host`` is held: a wildcard on IPv6's ``::``
    with IPv4 mapped onto it (IPv4's alone where the machine has no IPv6), ``localhost`` on both
    loopback addresses.
    """
    check_free(host, port)
    if host in WILDCARDS:
        try:
            return [_bound(socket.AF_INET6, "::", port, dual_stack=True)]
        except OSError:  # no IPv6 here: grpc serves IPv4 alone too
            return [_bound(socket.AF_INET, "0.0.0.0", port)]
    if host == "localhost":
        held = [_bound(socket.AF_INET, "127.0.0.1", port)]
        try:
            held.append(_bound(socket.AF_INET6, "::1", port))
        except OSError as error:
            if error.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # IPv6 is there: held
                held[0].close()
                raise
        return held
    return [_bound(_family(host), host, port)]


def _bound(
    family: socket.AddressFamily,
    host: str,
    port: int,
    dual_stack: bool = False,
    reuse_address: bool = False,
) -> socket.socket:
    held = socket.socket(family, socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if reuse_address:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack:
            held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            held.bind((host, port))
        except OSError as error:
            # check_free passed, so only the port's past connections in TIME_WAIT (a service
            # restarted after serving gRPC clients) refuse the strict bind, for up to a minute:
            # hold it with SO_REUSEADDR until tighten() can replace it.
            if error.errno != errno.EADDRINUSE or reuse_address:
                raise
            held.close()
            return _bound(family, host, port, dual_stack, reuse_address=True)
    except OSError:
        held.close()
        raise
    return held


def is_loose(held: socket.socket) -> bool:
    """Whether ``held`` was bound with SO_REUSEADDR (see :func:`_bound`)."""
    return bool(held.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR))


def tighten(held: list[socket.socket]) -> list[socket.socket]:
    """``held`` with each socket bound with SO_REUSEADDR replaced, where the kernel now allows it, by
    one bound without (bound beside it first, as both have SO_REUSEPORT, so the port is never free)."""
    result = []
    for socket_ in held:
        if not is_loose(socket_):
            result.append(socket_)
            continue
        host, port = socket_.getsockname()[:2]
        dual_stack = socket_.family == socket.AF_INET6 and not socket_.getsockopt(
            socket.IPPROTO_IPV6, socket.IPV6_V6ONLY
        )
        strict = socket.socket(socket_.family, socket.SOCK_STREAM)
        try:
            strict.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if dual_stack:
                strict.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            strict.bind((host, port))
        except OSError:
            strict.close()
            result.append(socket_)
            continue
        socket_.close()
        result.append(strict)
    return result


def check_free(host: str, port: int) -> None:
    """Raise OSError when another program holds ``port`` (the front ends share it among themselves
    with SO_REUSEPORT, which would otherwise also share it with a stranger of the same user)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        # bound past connections in TIME_WAIT, never past a listener
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
