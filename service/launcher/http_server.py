"""A front end's HTTP server: uvicorn with the guarded protocol (service/frontend/server.py), and the
health port's listener for a single process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from service.frontend.probes import EventLoopHealth, ProbeListener
from service.frontend.server import guarded_protocol
from service.launcher.cli import EXIT_START_FAILED
from service.launcher.health import FrontEndBeat
from service.launcher.ports import listen
from service.launcher.process_setup import ANSWER_MARGIN_S, freeze_heap
from service.observability.logs import uvicorn_log_config
from service.settings import Settings

logger = logging.getLogger("vitserve")


# Connections taken from a listening socket each time it is readable (what asyncio's own loop takes:
# its default backlog); more stay for the next turn of the event loop.
ACCEPT_BATCH = 100
ACCEPT_PAUSE_S = (
    1.0  # after an accept failed for want of file descriptors or memory, as asyncio waits
)


class BatchAccept:
    """Accepts a listening socket's waiting connections in batches, for uvicorn's protocol.

    uvloop (libuv, since libuv/libuv#3696 of 2022) accepts one connection each time the event loop
    turns. A front end's turn lasts as long as the requests it decodes in it (tens of milliseconds
    under load), so a burst of new connections (a client opening its pool) was let in one a turn:
    at c=256 the last of them waited 2-5 s in the kernel's queue before their first request was
    read, the p99 of the seam issue's tail while every request the app saw took under 0.5 s.
    asyncio's loop takes up to its backlog at once; this does the same on any loop. The object
    stands in uvicorn's ``servers`` list: its shutdown ``close``s it before closing the socket."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        listener: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
    ) -> None:
        self._loop = loop
        self._listener = listener
        self._protocol_factory = protocol_factory
        self._connecting: set[asyncio.Task[object]] = set()
        self._closed = False
        listener.setblocking(False)
        loop.add_reader(listener.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # gone before it was taken: the next one
                continue
            except OSError as error:  # out of file descriptors or memory: let the queue wait
                logger.error(
                    "cannot accept connections (%s); trying again in %g s",
                    error.strerror or error,
                    ACCEPT_PAUSE_S,
                )
                self._loop.remove_reader(self._listener.fileno())
                self._loop.call_later(ACCEPT_PAUSE_S, self._resume)
                return
            connection.setblocking(False)
            task = self._loop.create_task(
                self._loop.connect_accepted_socket(self._protocol_factory, connection)
            )
            self._connecting.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[object]) -> None:
        self._connecting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("an accepted connection could not be served: %r", task.exception())

    def _resume(self) -> None:
        if not self._closed:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting (the socket itself stays open: uvicorn closes it next)."""
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._listener.fileno())

    async def wait_closed(self) -> None:
        return None


class _Server(uvicorn.Server):
    """Readiness turns false the moment a shutdown signal arrives, before the graceful drain; the
    listening sockets' connections are accepted in batches (``BatchAccept``)."""

    def __init__(
        self, config: uvicorn.Config, app: FastAPI, beat: FrontEndBeat | None = None
    ) -> None:
        super().__init__(config)
        self._app = app
        self._beat = beat

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None:  # a socket of uvicorn's own (serve_http always gives its sockets)
            await super().startup(sockets)
            return
        await super().startup([])  # the app's lifespan, with no server of uvicorn's own
        if not self.started:
            return
        loop = asyncio.get_running_loop()
        config = self.config

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=loop,
            )

        self.servers = [BatchAccept(loop, listener, protocol) for listener in sockets]  # type: ignore[misc]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.state.frontend.begin_shutdown()
        if self._beat is not None:  # the loop stops ticking while it drains: not a stall
            self._beat.draining()
        super().handle_exit(sig, frame)


def serve_http(
    app: FastAPI,
    settings: Settings,
    sockets: list[socket.socket] | None = None,
    beat: FrontEndBeat | None = None,
) -> int:
    """Serve ``app`` with uvicorn and the guarded protocol until a signal; the exit code. A front
    end of several gives its event loop's ``beat`` to the supervisor, which answers ``health_port``
    (health.py); a single process (no ``beat``) answers ``health_port`` itself, from a thread."""
    port = settings.server.health_port if beat is None else 0
    health = EventLoopHealth(app.state.frontend)
    try:
        probes = ProbeListener(settings.server.host, port, health) if port else None
    except OSError as error:
        logger.error(
            "cannot start: cannot listen on %s, health port %d: %s",
            settings.server.host,
            port,
            error.strerror or error,
        )
        return EXIT_START_FAILED
    if sockets is None:  # one process: its own socket, so that it too accepts in batches
        try:
            sockets = listen(settings.server.host, settings.server.port, 1)
        except OSError as error:
            logger.error(
                "cannot start: cannot listen on %s, HTTP port %d: %s",
                settings.server.host,
                settings.server.port,
                error.strerror or error,
            )
            if probes is not None:
                probes.close()
            return EXIT_START_FAILED
        logger.info(
            "vitserve: one process on http://%s:%d", settings.server.host, settings.server.port
        )
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        log_config=uvicorn_log_config(settings.server.log_format),
        lifespan="on",
        timeout_graceful_shutdown=settings.server.graceful_shutdown_s + ANSWER_MARGIN_S,
        access_log=settings.server.access_log,
        proxy_headers=False,
        server_header=False,  # no "server: uvicorn" on every answer: nothing to advertise
        http=guarded_protocol(settings, app.state.frontend),
        callback_notify=beat if beat is not None else health.heartbeat if probes else None,
        timeout_notify=1,
    )
    server = _Server(config, app, beat)
    # The server's own handler from here on, not only while uvicorn runs: a SIGTERM before uvicorn
    # takes over (the supervisor's death, during start-up) stops it once it has started, and the
    # one uvicorn raises again after its drain is not fatal (the process would end by the signal,
    # -15, with every request answered). A handler that raised SystemExit instead was lost whenever
    # the signal landed in a weakref callback or a __del__: the front end then served on, orphaned.
    signal.signal(signal.SIGTERM, server.handle_exit)
    freeze_heap()
    with contextlib.closing(probes.start()) if probes else contextlib.nullcontext():
        server.run(sockets=sockets)
    return 0 if server.started else EXIT_START_FAILED
