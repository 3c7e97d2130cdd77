"""A front end's HTTP server: uvicorn with the guarded protocol (service/frontend/server.py), and the
health port's listener for a single process."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from service.frontend.probes import EventLoopHealth, ProbeListener
from service.frontend.server import guarded_protocol
from service.launcher.cli import EXIT_START_FAILED
from service.launcher.health import FrontEndBeat
from service.launcher.process_setup import ANSWER_MARGIN_S, freeze_heap
from service.observability.logs import uvicorn_log_config
from service.settings import Settings

logger = logging.getLogger("vitserve")


class _Server(uvicorn.Server):
    """Readiness turns false the moment a shutdown signal arrives, before the graceful drain."""

    def __init__(
        self, config: uvicorn.Config, app: FastAPI, beat: FrontEndBeat | None = None
    ) -> None:
        super().__init__(config)
        self._app = app
        self._beat = beat

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
