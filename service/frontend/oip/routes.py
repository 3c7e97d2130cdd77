"""Open Inference Protocol routes: clients built for Triton and KServe (``tritonclient.http``, KServe's
``InferenceRESTClient``, plain ``curl``) talk to vitserve unchanged.

- ``GET /v2``: server metadata ``{"name", "version", "extensions"}``.
- ``GET /v2/health/live``, ``GET /v2/health/ready``: ``{"live": true}``, ``{"ready": true|false}`` (as
  KServe's servers answer), 200 when true, 400 when not (as Triton's).
- ``GET /v2/models/{name}[/versions/{version}]``: model metadata (inputs and outputs as named tensors):
  the graph's tensor input, and ``image`` (BYTES ``[-1, 1]``: image files, service/frontend/oip/encoded.py).
- ``GET /v2/models/{name}[/versions/{version}]/ready``: 200 when ready, 400 when not.
- ``POST /v2/models/{name}[/versions/{version}]/infer``: named tensors in, named tensors out
  (service/frontend/oip/codec.py), through the model's pipeline like ``/predict``; image files are
  decoded by ``/predict``'s own code.
- The model repository extension (service/frontend/oip/repository.py); the model configuration and statistics
  extensions (service/frontend/oip/extensions.py). The same calls over gRPC: service/frontend/oip/grpc_service.py.

Every error is ``{"error": "<message>"}`` (service/errors.py formats it): 400 for a bad request, 404 for an
unknown model or version, 401 for a missing or wrong API key (when one is configured: it applies to
``/v2/models/...`` and ``/v2/repository/...``; server metadata and health stay open), 503 with
``Retry-After`` when not ready, the queue is full or the request timed out, 500 when the model failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from service.contract.model_repository import MAX_VERSION
from service.errors import NotFound, ServiceError
from service.frontend.error_responses import request_id_of
from service.frontend.hot_routes import hot
from service.frontend.oip.codec import decode_request, encode_response
from service.frontend.oip.encoded import EncodedImages
from service.frontend.oip.schemas import (
    EXTENSIONS,
    HEADER_LENGTH,
    PLATFORM,
    PROBABILITIES,
    SERVER_NAME,
    InferRequest,
    MetadataTensor,
    ModelMetadataResponse,
    ServerLive,
    ServerMetadata,
    ServerReady,
)
from service.frontend.security import OPENAPI_SECURITY, check_request_api_key, require_api_key
from service.frontend.serving import INLINE_TENSOR_BYTES, ClientGone, ServedVersion, client_gone
from service.frontend.state import FrontendState, frontend_state

router = APIRouter(prefix="/v2", tags=["open inference protocol"])
PROTECTED = [Depends(require_api_key)]

_ERRORS = {
    400: "Bad request: the message names the tensor, field and limit.",
    401: "API key missing or wrong (only when the service has one).",
    404: "No such model or version.",
    503: "Not ready, queue full or timed out; see Retry-After.",
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}
RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for status, text in _ERRORS.items()
}


def version_number(version: str | None) -> int | None:
    """A protocol version string as the repository's integer; 404 for anything else."""
    if version is None:
        return None
    digits = version.lstrip("0")
    if (
        not (version.isascii() and version.isdigit())
        or not 0 < len(digits) <= len(str(MAX_VERSION))
        or int(digits) > MAX_VERSION  # int() refuses more than 4,300 digits, zeros included
    ):
        shown = version if len(version) <= 40 else f"{version[:40]}..."
        raise NotFound(f"unknown version '{shown}': versions are integers from 1 to {MAX_VERSION}")
    return int(digits)


async def served_version(
    state: FrontendState,
    name: str,
    version: str | None,
    request_id: str | None,
    gone: ClientGone,
) -> ServedVersion:
    """The model version a protocol request goes to (every transport), with the request's id and
    how to tell that its client has gone."""
    requested = version_number(version)
    view = (await state.engine.table_to_route_by()).route(name, requested)
    return ServedVersion(state, view, requested, request_id, gone)


def metadata_of(state: FrontendState, name: str, version: str | None) -> ModelMetadataResponse:
    """A model's metadata (every transport): the inputs and outputs of the version asked for."""
    table = state.engine.table
    meta = table.resolve(name, version_number(version)).metadata
    spec = meta.input
    classes = meta.num_classes
    return ModelMetadataResponse(
        name=name,
        versions=[str(v) for v in table.model(name).ready_versions()],
        platform=PLATFORM,
        inputs=[
            # the graph's tensor only: generic clients fill every input listed (the image files'
            # input is documented, not declared: service/contract/model_config.py)
            MetadataTensor(
                name=spec.name, datatype="FP32", shape=[-1, spec.channels, spec.height, spec.width]
            ),
        ],
        outputs=[
            MetadataTensor(name=meta.outputs.logits, datatype="FP32", shape=[-1, classes]),
            MetadataTensor(name=PROBABILITIES, datatype="FP32", shape=[-1, classes]),
        ],
    )


def model_is_ready(state: FrontendState, name: str, version: str | None) -> bool:
    """Whether a model (version) takes requests now; 404 for an unknown model or version."""
    table = state.engine.table
    model = table.model(name)
    wanted = version_number(version)
    if wanted is not None and wanted not in model.versions:
        raise NotFound(f"unknown version '{version}' of model '{name}'")
    serving = state.phase == "ready" and state.engine.connected and table.phase == "ready"
    return serving and model.view(wanted) is not None


def _versioned(path: str, register: Callable[[str], Callable], endpoint: Callable) -> None:
    """Register ``endpoint`` on ``/models/{name}<path>`` and ``/models/{name}/versions/{version}<path>``
    (its ``version`` parameter is None on the first)."""
    register(f"/models/{{name}}{path}")(endpoint)
    register(f"/models/{{name}}/versions/{{version}}{path}")(endpoint)


@router.get("", response_model=ServerMetadata, summary="Server metadata")
async def server_metadata(request: Request) -> ServerMetadata:
    return ServerMetadata(name=SERVER_NAME, version=request.app.version, extensions=EXTENSIONS)


@router.get("/health/live", response_model=ServerLive, summary='Live: 200, {"live": true}')
async def live() -> ServerLive:
    return ServerLive(live=True)


@router.get(
    "/health/ready",
    response_model=ServerReady,
    summary="Ready: 200 once the default model is loaded and warmed up, 400 while starting or "
    "shutting down",
    responses={400: {"model": ServerReady, "description": "Not ready: starting or shutting down"}},
)
async def ready(request: Request) -> JSONResponse:
    ready = frontend_state(request).ready
    return JSONResponse(ServerReady(ready=ready).model_dump(), status_code=200 if ready else 400)


async def model_metadata(
    request: Request, name: str, version: str | None = None
) -> ModelMetadataResponse:
    return metadata_of(frontend_state(request), name, version)


async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    ready = model_is_ready(frontend_state(request), name, version)
    return Response(status_code=200 if ready else 400)


@hot
async def infer(request: Request, name: str) -> Response:
    return await _infer(request, name, None)


@hot
async def infer_version(request: Request, name: str, version: str) -> Response:
    return await _infer(request, name, version)


async def _infer(request: Request, name: str, version: str | None) -> Response:
    check_request_api_key(request)  # not a dependency: a hot route (service/frontend/hot_routes.py)
    served = await served_version(
        frontend_state(request), name, version, request_id_of(request), client_gone(request)
    )
    body = await request.body()
    header_length = request.headers.get(HEADER_LENGTH)
    limit = served.settings.limits.max_images_per_request
    decoded: list = []

    def decode() -> Any:
        decoded.extend(
            decode_request(
                body, header_length, served.metadata, limit, served.settings.limits.max_json_values
            )
        )
        return decoded[1].batch

    try:
        logits = await served.infer(decode, len(body))
    except EncodedImages as encoded:  # image files: decoded as /predict decodes them
        files = encoded.files
        logits = await served.classify(files.images, "auto")
        meta, version_text = served.metadata, str(served.version)
        return encode_response(files.request, files.outputs, logits, meta, name, version_text)
    infer_request, tensors = decoded
    answer = (infer_request, tensors.outputs, logits, served.metadata, name, str(served.version))
    if len(body) <= INLINE_TENSOR_BYTES:  # an answer as small as its request: no thread hop
        return encode_response(*answer)
    return await run_in_threadpool(encode_response, *answer)


_versioned(
    "",
    lambda path: router.get(
        path,
        response_model=ModelMetadataResponse,
        summary="Model metadata",
        dependencies=PROTECTED,
        responses=RESPONSES,
    ),
    model_metadata,
)
_versioned(
    "/ready",
    lambda path: router.get(
        path,
        summary="Model ready: 200 when ready, 400 when not",
        dependencies=PROTECTED,
        response_class=Response,
        responses=RESPONSES,
    ),
    model_ready,
)


def _register_infer(path: str) -> Callable:
    return router.post(
        path,
        summary="Inference (Open Inference Protocol)",
        responses=RESPONSES,
        openapi_extra={
            **OPENAPI_SECURITY,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}},
                    "application/octet-stream": {
                        "schema": {"type": "string", "format": "binary"},
                        "description": "binary_tensor_data: the JSON request, then the tensors' "
                        "bytes; the header Inference-Header-Content-Length gives the JSON's length.",
                        "examples": {
                            "one_image": {
                                "summary": "One 1x1x28x28 FP32 image as 3136 raw bytes",
                                "description": "Inference-Header-Content-Length: 107; the JSON "
                                "below, then the 784 little-endian float32 values.",
                                "value": '{"inputs":[{"name":"images","shape":[1,1,28,28],'
                                '"datatype":"FP32","parameters":{"binary_data_size":3136}}]}'
                                "<3136 bytes>",
                            }
                        },
                    },
                },
            },
        },
    )


# Two endpoints, not one with an optional version: without {version} in its path, FastAPI would
# read a version from the query string, which the protocol does not have.
_register_infer("/models/{name}/infer")(infer)
_register_infer("/models/{name}/versions/{version}/infer")(infer_version)
OPENAPI_MODELS = (InferRequest,)


def not_in_protocol_route(routers: list[APIRouter]) -> APIRouter:
    """A catch-all under /v2, registered last: 405 for a known route and another method, else 404,
    both in the protocol's error shape."""
    catch_all = APIRouter(prefix="/v2", include_in_schema=False)
    routes = [route for r in routers for route in r.routes if isinstance(route, APIRoute)]

    @catch_all.api_route(
        "/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    )
    async def not_in_protocol(path: str, request: Request) -> Response:
        for route in routes:
            if route.path_regex.match(request.url.path) and request.method not in (
                route.methods or set()
            ):
                allowed = ", ".join(sorted(route.methods or ()))
                raise ServiceError(
                    f"method {request.method} is not allowed on {request.url.path}; use {allowed}",
                    status_code=405,
                    code="method_not_allowed",
                    headers={"Allow": allowed},
                )
        raise NotFound(
            f"/v2/{path} is not served: vitserve implements the Open Inference Protocol's health, "
            "metadata, ready and infer routes and the extensions "
            f"{', '.join(EXTENSIONS)}"
        )

    return catch_all
