"""``python -m service``: uvicorn on the configured host and port, ready turning false on SIGTERM.

Connections get the header and body deadlines and the connection cap of ``service/frontend/server.py``.

Exit codes: 0 after a clean shutdown; 2 when the settings are invalid (one line per invalid setting,
``cannot start: setting VITSERVE_...: <problem>``, never its value); 3 when start-up failed (the model
could not be loaded; the reason is logged).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from service.launcher.cli import parse_settings
from service.observability.logs import uvicorn_log_config

if TYPE_CHECKING:  # imported by main() only after the command line is parsed: --help stays quick
    from service.engine.state import ServiceState

EXIT_START_FAILED = 3
# uvicorn cancels open requests this long after the service's own drain deadline, which answers what
# is left 503: long enough for those answers to be written.
ANSWER_MARGIN_S = 5.0


class _Server(uvicorn.Server):
    """Readiness turns false the moment a shutdown signal arrives, before the graceful drain."""

    def __init__(self, config: uvicorn.Config, state: ServiceState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.begin_shutdown()
        super().handle_exit(sig, frame)


def main() -> None:
    settings = parse_settings(sys.argv[1:])
    # Imported only now: service.frontend.app builds its module-level app from the environment's settings,
    # which would fail with a traceback before parse_settings could say what is wrong.
    from service.frontend.app import create_app
    from service.frontend.server import guarded_protocol

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=uvicorn_log_config(settings.log_format),
        lifespan="on",
        timeout_graceful_shutdown=settings.graceful_shutdown_s + ANSWER_MARGIN_S,
        access_log=settings.access_log,
        proxy_headers=False,
        http=guarded_protocol(settings),
    )
    server = _Server(config, app.state.service)

    def exit_after_drain(sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises SIGTERM once it has drained and restored this handler; without it the
        # process would end killed by the signal (-15) although every request was answered.
        sys.exit(0 if server.started else EXIT_START_FAILED)

    signal.signal(signal.SIGTERM, exit_after_drain)
    server.run()
    if not server.started:
        sys.exit(EXIT_START_FAILED)  # start-up failed (the reason is logged above)


if __name__ == "__main__":
    main()
