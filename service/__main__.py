"""``python -m service``: uvicorn on the configured host and port, ready turning false on SIGTERM."""

from __future__ import annotations

import signal
import sys
from types import FrameType

import uvicorn

from service.logs import uvicorn_log_config
from service.main import create_app
from service.settings import Settings
from service.state import ServiceState


class _Server(uvicorn.Server):
    """Readiness turns false the moment a shutdown signal arrives, before the graceful drain."""

    def __init__(self, config: uvicorn.Config, state: ServiceState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.begin_shutdown()
        super().handle_exit(sig, frame)


def main() -> None:
    settings = Settings()
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=uvicorn_log_config(settings.log_format),
        lifespan="on",
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        proxy_headers=False,
    )
    server = _Server(config, app.state.service)

    def exit_after_drain(sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises SIGTERM once it has drained and restored this handler; without it the
        # process would end killed by the signal (-15) although every request was answered.
        sys.exit(0 if server.started else 3)

    signal.signal(signal.SIGTERM, exit_after_drain)
    server.run()
    if not server.started:
        sys.exit(3)  # start-up failed (the reason is logged above); uvicorn's exit code for it


if __name__ == "__main__":
    main()
