"""A front end lets a burst of new connections in at once, not one per turn of its event loop.

uvloop accepts one connection each time the loop turns (libuv#3696); a busy front end's turn is
long, and at c=256 the last connections of a client's pool waited seconds before their first
request was read (the seam issue's tail). ``service/launcher/http_server.py``'s server accepts every
waiting connection (up to ``ACCEPT_BATCH``) when its socket is readable. Counted in turns of the
loop, not in time: a turn here does no work, under load each one is a batch of requests.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvicorn
import uvloop

from service.frontend.server import guarded_protocol
from service.launcher import http_server
from service.settings import Settings

BURST = 60


def listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    return sock


async def turns_to_let_in(server: uvicorn.Server, sock: socket.socket) -> int:
    """Open ``BURST`` connections at once (the kernel completes them in the listen queue), then
    count the loop's turns until the server holds every one."""
    await server.startup(sockets=[sock])
    clients = [socket.create_connection(sock.getsockname()) for _ in range(BURST)]
    turns = 0
    try:
        while len(server.server_state.connections) < BURST and turns < 10 * BURST:
            await asyncio.sleep(0)  # one turn of the loop
            turns += 1
        assert len(server.server_state.connections) == BURST
        return turns
    finally:
        for client in clients:
            client.close()
        await server.shutdown(sockets=[sock])


def server() -> uvicorn.Server:
    async def app(scope, receive, send):  # never called: no request is sent
        raise AssertionError(scope)

    config = uvicorn.Config(
        app, http=guarded_protocol(Settings()), lifespan="off", log_level="error"
    )
    config.load()
    running = http_server._Server(config, app=None)  # type: ignore[arg-type]
    running.lifespan = config.lifespan_class(config)  # as uvicorn.Server.serve sets it
    return running


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_burst_of_connections_is_let_in_within_a_few_turns_of_the_loop(loop):
    run = uvloop.run if loop == "uvloop" else asyncio.run
    with listener() as sock:
        turns = run(turns_to_let_in(server(), sock))
    assert turns <= 5, f"{BURST} waiting connections took {turns} turns of the {loop} loop"


def test_accepting_stops_at_shutdown_and_the_socket_is_left_to_its_owner():
    async def scenario(sock: socket.socket) -> bool:
        running = server()
        await running.startup(sockets=[sock])
        (accepting,) = running.servers
        accepting.close()
        late = socket.create_connection(sock.getsockname())  # queued by the kernel, not taken
        for _ in range(20):
            await asyncio.sleep(0)
        taken = len(running.server_state.connections)
        late.close()
        return taken == 0

    with listener() as sock:
        assert uvloop.run(scenario(sock))
