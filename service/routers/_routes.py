"""One handler, three routes: the default model (``/predict``), a model by name
(``/models/{name}/predict``) and one version of it (``/models/{name}/versions/{version}/predict``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request

from service.pipeline import ModelPipeline
from service.state import default_pipeline, named_pipeline, versioned_pipeline

Handler = Callable[[Request, ModelPipeline], Awaitable[Any]]

_PREFIXES = (
    ("", default_pipeline, ""),
    ("/models/{name}", named_pipeline, " (a model by name)"),
    ("/models/{name}/versions/{version}", versioned_pipeline, " (one version of a model)"),
)


def add_model_routes(
    router: APIRouter, suffix: str, handler: Handler, *, summary: str, **route: Any
) -> None:
    """Register ``handler`` as POST ``suffix`` under each prefix, with the pipeline it runs on."""
    for prefix, dependency, which in _PREFIXES:

        async def endpoint(request: Request, pipeline: ModelPipeline = Depends(dependency)) -> Any:
            return await handler(request, pipeline)

        router.add_api_route(
            prefix + suffix,
            endpoint,
            methods=["POST"],
            name=f"{handler.__name__}{prefix.replace('/', '_').replace('{', '').replace('}', '')}",
            summary=summary + which,
            **route,
        )
