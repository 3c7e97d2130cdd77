"""``python -m service``: uvicorn on the configured host and port, ready turning false on SIGTERM.

Connections get the header and body deadlines and the connection cap of ``service/frontend/server.py``.

Exit codes: 0 after a clean shutdown; 2 when the settings are invalid (one line per invalid setting,
``cannot start: setting VITSERVE_...: <problem>``, never its value); 3 when start-up failed (the model
could not be loaded; the reason is logged).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from types import FrameType

import uvicorn
from pydantic import ValidationError
from pydantic_settings import SettingsError

from service.engine.state import ServiceState
from service.frontend.probes import ProbeListener
from service.frontend.server import guarded_protocol
from service.observability.logs import uvicorn_log_config
from service.settings import Settings

EXIT_BAD_SETTINGS = 2
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


def settings_problems(error: ValidationError) -> list[str]:
    """One line per invalid setting, naming its environment variable and never its value (pydantic's
    own text quotes the input, which for a model-level check is every setting, the API key too)."""
    lines = []
    for problem in error.errors(include_url=False, include_input=False, include_context=False):
        location = problem.get("loc") or ()
        message = problem.get("msg", "invalid").removeprefix("Value error, ")
        if location:
            name = str(location[0])  # a field, or the alias it was read from (VITSERVE_PORT)
            variable = name if name.isupper() else f"VITSERVE_{name.upper()}"
            lines.append(f"setting {variable}: {message}")
        else:
            lines.append(f"settings: {message}")
    return lines


def load_settings() -> Settings:
    """The settings from the environment; on a problem, its lines on stderr and exit code 2."""
    try:
        return Settings()
    except ValidationError as error:
        problems = settings_problems(error)
    except SettingsError as error:  # a value pydantic-settings could not even read
        problems = [f"settings: {error}"]
    for problem in problems:
        print(f"cannot start: {problem}", file=sys.stderr)
    sys.exit(EXIT_BAD_SETTINGS)


def main() -> None:
    settings = load_settings()
    # Imported only now: service.frontend.app builds its module-level app from the environment's settings,
    # which would fail with a traceback before load_settings could say what is wrong.
    from service.frontend.app import create_app

    app = create_app(settings)
    port = settings.health_port
    probes = ProbeListener(settings.host, port, app.state.service) if port else None
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
        http=guarded_protocol(settings, app.state.service),
        callback_notify=probes.heartbeat if probes else None,
        timeout_notify=1,
    )
    server = _Server(config, app.state.service)

    def exit_after_drain(sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises SIGTERM once it has drained and restored this handler; without it the
        # process would end killed by the signal (-15) although every request was answered.
        sys.exit(0 if server.started else EXIT_START_FAILED)

    signal.signal(signal.SIGTERM, exit_after_drain)
    with contextlib.closing(probes.start()) if probes else contextlib.nullcontext():
        server.run()
    if not server.started:
        sys.exit(EXIT_START_FAILED)  # start-up failed (the reason is logged above)


if __name__ == "__main__":
    main()
