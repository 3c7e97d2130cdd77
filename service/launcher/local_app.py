"""The service in one process, the engine in it: ``VITSERVE_WORKERS=0`` (``python -m service
--workers 0``), the tests' apps, and ``uvicorn service.launcher.local_app:app``.

The front end (``service/frontend/app.py``'s ``create_app``) is given the engine it calls and
never imports ``service/engine/``; this module builds the engine in the front end's own process
(``service/engine/local.py``'s ``LocalEngine``) and hands it over. Creating the app loads nothing;
its lifespan starts the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from service.engine.local import LocalEngine
from service.frontend.app import create_app
from service.observability.metrics import Metrics
from service.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


def local_app(
    settings: Settings | None = None,
    tracer_provider: TracerProvider | None = None,
    worker: int | None = None,
) -> FastAPI:
    """The app with the engine in its own process and event loop (``app.state.engine``: the
    ``Engine``, which tests read); ``settings`` from the environment unless given."""
    settings = settings or Settings()
    metrics = Metrics()  # one registry for the front end's series and the engine's
    local = LocalEngine.create(settings, metrics)
    app = create_app(
        settings, local, tracer_provider=tracer_provider, worker=worker, process_metrics=metrics
    )
    app.state.engine = local.engine
    return app


def __getattr__(name: str) -> Any:
    """``uvicorn service.launcher.local_app:app``: the app is made on first use, not at import."""
    if name == "app":
        globals()["app"] = local_app()
        return globals()["app"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
