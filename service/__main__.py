"""``python -m service`` (or ``vitserve``): one engine process and ``--workers`` front-end processes
(service/launcher/supervisor.py), or with ``--workers 0`` a single process that runs the engine itself.
Every setting is a flag and an environment variable (``--help``; service/launcher/cli.py). Connections
get the header and body deadlines and the connection cap of ``service/frontend/server.py``.

Exit codes: 0 after a clean shutdown; 2 when the settings are invalid (one line per invalid setting,
naming its flag or variable, never its value); 3 when start-up failed (a port in use, the model could
not be loaded, or httptools is missing; the reason is logged).
"""

from __future__ import annotations

import sys

from service.launcher.cli import EXIT_START_FAILED, parse_settings

NO_HTTPTOOLS = (
    "cannot start: python -m service serves HTTP with uvicorn's httptools protocol, guarded with "
    "header and body deadlines, header bounds (431) and a connection cap "
    "(service/frontend/server.py), and httptools is not installed ({error}); it will not fall back "
    "to uvicorn's h11 protocol, which has none of these guards. Install httptools "
    "(pip install 'uvicorn[standard]', or requirements/serve.txt)."
)


def main() -> None:
    settings = parse_settings(sys.argv[1:])
    try:  # uvicorn would fall back to h11, unguarded: refuse instead
        import httptools  # noqa: F401
    except ImportError as error:
        print(NO_HTTPTOOLS.format(error=error), file=sys.stderr)
        sys.exit(EXIT_START_FAILED)
    # Imported only now: the service's modules are heavier than the command line, so --help and a
    # settings error answer at once.
    from service.launcher.supervisor import serve

    sys.exit(serve(settings))


if __name__ == "__main__":
    main()
