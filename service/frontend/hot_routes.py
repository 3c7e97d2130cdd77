"""The inference routes: one handler on three paths, each request's API key and model version checked
by the route itself, and answered without FastAPI's routing once FastAPI has chosen them for a path.

``add_model_routes`` registers a handler for the default model (``/predict``), a model by name
(``/models/{name}/predict``) and one version of it (``/models/{name}/versions/{version}/predict``). The
routes check the API key and resolve the model version themselves rather than through FastAPI
dependencies: on the inference path a generator dependency (an exit stack, a shielded context) and a
security sub-dependency cost more of the event loop than decoding a thumbnail does. The OpenAPI
document still declares the bearer scheme for them (``service.frontend.security.OPENAPI_SECURITY``).

With ``hot_lane``, the default model's and a named model's routes are hot (:func:`hot`); one
version's is not, as FastAPI checks its version number. At c=64 single-image requests, FastAPI's and
Starlette's own frames held 18% of a front end's py-spy samples, most of them under the app's
middleware: matching the path against every router, solving the endpoint's dependencies, and the
exception and exit-stack wrappers (BENCHMARKS.md, "The hot lane"). The hot endpoints need none of
it. They take the request and string path parameters only, check the API key themselves, and
return a finished ``Response``.

The first request for a method and path goes through FastAPI. When the route FastAPI chose for it
is hot, later requests for that method and path call its endpoint directly. They get the same path
parameters, the same ``scope["route"]`` (the HTTP metrics' label), and the app's exception handlers.
An exception with no handler, or only the handler of ``Exception`` or 500, is left to Starlette's
``ServerErrorMiddleware``, as behind FastAPI's router.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, get_type_hints

from fastapi import APIRouter, Path
from fastapi.routing import APIRoute
from starlette._utils import is_async_callable
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from service.contract.candidates import CLIENT_KEY_HEADER
from service.contract.model_repository import MAX_VERSION
from service.frontend.security import OPENAPI_SECURITY, check_api_key
from service.frontend.serving import ServedVersion
from service.frontend.state import FrontendState

Handler = Callable[[Request, ServedVersion], Awaitable[Any]]

_HOT: set[Callable[..., Any]] = set()

# Paths are remembered up to this many; past it, new paths go through FastAPI every time (a model's
# name is part of its path, and clients choose it).
MAX_PATHS = 1024


def hot(
    endpoint: Callable[..., Any], *, answers: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """Mark an endpoint as hot: ``endpoint(request, **path_params)``, with string path parameters
    and no dependencies (:func:`check_hot_routes`), returns a ``Response``, as the return annotation
    of ``answers`` (the endpoint itself unless given: the handler a route's closure returns) says."""
    returned = get_type_hints(answers or endpoint).get("return")
    if not (isinstance(returned, type) and issubclass(returned, Response)):
        raise TypeError(
            f"{endpoint.__qualname__}: a hot endpoint returns a Response, not {returned}"
        )
    _HOT.add(endpoint)
    return endpoint


def check_hot_routes(routes: Iterable[BaseRoute]) -> None:
    """Refuse to start when a hot endpoint's route asks FastAPI for more than the request and its
    path parameters: answered directly, it would not get it."""
    for route in routes:
        if not isinstance(route, APIRoute) or route.endpoint not in _HOT:
            continue
        dependant = route.dependant
        extra = (
            dependant.dependencies
            or dependant.query_params
            or dependant.header_params
            or dependant.cookie_params
            or dependant.body_params
        )
        convertors = {type(c).__name__ for c in route.param_convertors.values()}
        if extra or convertors - {"StringConvertor"}:
            raise TypeError(
                f"{route.path}: a hot endpoint takes only the request and string path parameters "
                "(service/frontend/hot_routes.py)"
            )


async def _serve(handler: Handler, request: Request, name: str | None, version: int | None) -> Any:
    state: FrontendState = request.app.state.frontend
    api_key = state.settings.server.api_key
    if api_key is not None:  # without a key the header is not even looked at
        check_api_key(request.headers.get("authorization"), api_key)
    table = await state.engine.table_to_route_by()
    view = table.route(name, version, request.headers.get(CLIENT_KEY_HEADER))
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

    async def one_version(
        request: Request, name: str, version: int = Path(ge=1, le=MAX_VERSION)
    ) -> Any:
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


class HotRoutes:
    """ASGI middleware, innermost of the app's: the direct path to the hot endpoints."""

    def __init__(self, app: ASGIApp, *, handlers: Mapping[Any, Callable[..., Any]]) -> None:
        self.app = app
        # the app's exception handlers, by class or status code, but for those Starlette gives its
        # ServerErrorMiddleware (the stack is built at the first request, after they are installed)
        self.handlers = {k: v for k, v in handlers.items() if k not in (500, Exception)}
        self.chosen: dict[tuple[str, str, str], tuple[APIRoute, dict[str, str]]] = {}
        self.max_paths = MAX_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = (scope["method"], scope.get("root_path", ""), scope["path"])
        chosen = self.chosen.get(key)
        if chosen is None:
            await self.app(scope, receive, send)
            self._remember(key, scope)
            return
        route, params = chosen
        scope["route"], scope["endpoint"], scope["path_params"] = route, route.endpoint, params
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(request, **params)
        except Exception as error:
            handler = self._handler(error)
            if handler is None:
                raise
            if is_async_callable(handler):
                response = await handler(request, error)
            else:
                response = await run_in_threadpool(handler, request, error)
        await response(scope, receive, send)

    def _remember(self, key: tuple[str, str, str], scope: Scope) -> None:
        route = scope.get("route")
        if (
            isinstance(route, APIRoute)
            and route.endpoint in _HOT
            and key[0] in route.methods
            and len(self.chosen) < self.max_paths
        ):
            self.chosen[key] = (route, dict(scope.get("path_params", {})))

    def _handler(self, error: Exception) -> Callable[..., Any] | None:
        """The handler Starlette's ExceptionMiddleware would pick; None where it has none."""
        if isinstance(error, HTTPException) and error.status_code in self.handlers:
            return self.handlers[error.status_code]
        for kind in type(error).__mro__:
            if kind in self.handlers:
                return self.handlers[kind]
        return None
