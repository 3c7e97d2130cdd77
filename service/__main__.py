"""``python -m service``: one engine process and ``VITSERVE_WORKERS`` front-end processes
(service/launcher/supervisor.py), or with ``VITSERVE_WORKERS=0`` a single process that runs the engine
itself. Connections get the header and body deadlines and the connection cap of
``service/frontend/server.py``.

Exit codes: 0 after a clean shutdown; 2 when the settings are invalid (one line per invalid setting,
``cannot start: setting VITSERVE_...: <problem>``, never its value); 3 when start-up failed (a port in
use, or the model could not be loaded; the reason is logged).
"""

from __future__ import annotations

import sys

from pydantic import ValidationError
from pydantic_settings import SettingsError

from service.settings import Settings

EXIT_BAD_SETTINGS = 2


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
    # Imported only now: the service's modules are heavier than the settings, and a settings error
    # should be said at once.
    from service.launcher.supervisor import serve

    sys.exit(serve(settings))


if __name__ == "__main__":
    main()
