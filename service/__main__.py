"""``python -m service`` (or ``vitserve``): one engine process and ``--workers`` front-end processes
(service/launcher/supervisor.py), or with ``--workers 0`` a single process that runs the engine itself.
Every setting is a flag and an environment variable (``--help``; service/launcher/cli.py). Connections
get the header and body deadlines and the connection cap of ``service/frontend/server.py``.

Exit codes: 0 after a clean shutdown; 2 when the settings are invalid (one line per invalid setting,
naming its flag or variable, never its value); 3 when start-up failed (a port in use, or the model could
not be loaded; the reason is logged).
"""

from __future__ import annotations

import sys

from service.launcher.cli import parse_settings


def main() -> None:
    settings = parse_settings(sys.argv[1:])
    # Imported only now: the service's modules are heavier than the command line, so --help and a
    # settings error answer at once.
    from service.launcher.supervisor import serve

    sys.exit(serve(settings))


if __name__ == "__main__":
    main()
