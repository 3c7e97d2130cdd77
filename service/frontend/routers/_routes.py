"""One handler, three routes: the default model (``/predict``), a model by name
(``/models/{name}/predict``) and one version of it (``/models/{name}/versions/{version}/predict``).

The routes check the API key and resolve the model version themselves rather than through FastAPI
dependencies: on the inference path a generator dependency (an exit stack, a shielded context) and a
security sub-dependency cost more of the event loop than decoding a thumbnail does. The OpenAPI
document still declares the bearer scheme for them (``service.frontend.security.OPENAPI_SECURITY``).
With ``hot_lane``, the default model's and a named model's are hot (service/frontend/hot_routes.py);
one version's is not, as FastAPI checks its version number.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Path, Request

from service.contract.candidates import CLIENT_KEY_HEADER
from service.frontend.hot_routes import hot
from service.frontend.security import OPENAPI_SECURITY, check_request_api_key
from service.frontend.serving import ServedVersion
from service.frontend.state import frontend_state

Handler = Callable[[Request, ServedVersion], Awaitable[Any]]


async def _serve(handler: Handler, request: Request, name: str | None, version: int | None) -> Any:
    check_request_api_key(request)
    state = frontend_state(request)
    view = state.engine.table.route(name, version, request.headers.get(CLIENT_KEY_HEADER))
    return await handler(request, ServedVersion.of(request, state, view, version))


def add_model_routes(
    router: APIRouter,
    suffix: str,
    handler: Handler,
    *,
    summary: str,
    hot_lane: bool = False,
    **route: Any,
) -> None:
    """Register ``handler`` as POST ``suffix`` under each prefix, with the model version it runs on."""

    async def default_model(request: Request) -> Any:
        return await _serve(handler, request, None, None)

    async def named_model(request: Request, name: str) -> Any:
        return await _serve(handler, request, name, None)

    async def one_version(request: Request, name: str, version: int = Path(ge=1)) -> Any:
        return await _serve(handler, request, name, version)

    if hot_lane:
        hot(default_model, answers=handler)
        hot(named_model, answers=handler)
    openapi_extra = {**route.pop("openapi_extra", {}), **OPENAPI_SECURITY}
    for prefix, endpoint, which, kind in (
        ("", default_model, "", ""),
        ("/models/{name}", named_model, " (a model by name)", "_model"),
        (
            "/models/{name}/versions/{version}",
            one_version,
            " (one version of a model)",
            "_model_version",
        ),
    ):
        router.add_api_route(
            prefix + suffix,
            endpoint,
            methods=["POST"],
            name=handler.__name__ + kind,  # and operation id: predict, predict_model, ...
            summary=summary + which,
            openapi_extra=openapi_extra,
            **route,
        )
